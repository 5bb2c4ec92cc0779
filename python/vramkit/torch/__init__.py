"""vramkit with PyTorch: ``track()``, a meter of live tensor storage bytes (CPU included), and
vramkit as PyTorch's CUDA allocator (``use_as_cuda_allocator()``).

``meters`` holds the meters (``LiveMeter``, ``SiteMeter``, ``track``); ``allocator`` the
pluggable-allocator hook-up and ``is_vramkit_out_of_memory`` (its out-of-memory error).
Importing this package imports torch. Inside vramkit, ``import torch`` (an absolute import) is
always the real PyTorch.
"""

from __future__ import annotations

from .allocator import is_vramkit_out_of_memory
from .meters import LiveMeter, SiteMeter, track, use_as_cuda_allocator

__all__ = ["LiveMeter", "SiteMeter", "is_vramkit_out_of_memory", "track", "use_as_cuda_allocator"]
