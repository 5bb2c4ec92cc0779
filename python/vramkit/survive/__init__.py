"""Survive "out of memory": the tools a training run leans on when memory is short.

``batch_size`` (``find_batch_size``: the largest batch size that fits, by trying it; every rank
of a torchrun job together, ``batch_agree``),
``leaks`` (``vramkit.watch_leaks``: memory that grows every iteration, and what holds it),
``smi`` (GPUs and the processes holding their memory, stale ones flagged: ``vramkit smi``)
and ``oom`` (``vramkit.on_oom``: a post-mortem of every out-of-memory). ``vramkit.leaks`` and
``vramkit.smi`` stay importable under those names. The pytest plugin's markers and ``vram``
fixture live in the ``vramkit_pytest`` package beside vramkit, which pytest loads without
importing vramkit.
"""

from __future__ import annotations

from .batch_agree import DistributedSearchError
from .batch_size import Attempt, BatchSizeResult, find_batch_size, out_of_memory_rule
from .oom import OomDumpWarning, OomWatch, PostMortem, on_oom

__all__ = ["Attempt", "BatchSizeResult", "DistributedSearchError", "OomDumpWarning", "OomWatch", "PostMortem", "find_batch_size",
           "on_oom", "out_of_memory_rule"]
