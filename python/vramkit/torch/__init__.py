"""vramkit with PyTorch: ``track()``, a meter of live tensor storage bytes (CPU included), and
vramkit as PyTorch's CUDA allocator (``use_as_cuda_allocator()``).

``meters`` holds the meters (``LiveMeter``, ``SiteMeter``, ``track``); ``allocator`` the
pluggable-allocator hook-up. Importing this package imports torch. Inside vramkit,
``import torch`` (an absolute import) is always the real PyTorch.
"""

from __future__ import annotations

from .meters import LiveMeter, SiteMeter, is_out_of_memory, track, use_as_cuda_allocator

__all__ = ["LiveMeter", "SiteMeter", "is_out_of_memory", "track", "use_as_cuda_allocator"]
