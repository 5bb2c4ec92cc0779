"""vramkit: train models in the memory you have.

A caching allocator in C for CUDA memory, host memory and simulated devices, with the
counters, summaries and snapshots PyTorch users know (memory_allocated, memory_reserved,
memory_stats, memory_summary, empty_cache, memory snapshots for pytorch.org/memory_viz), and
fused loss-scaling kernels with a GradScaler for NumPy, torch and CuPy (vramkit.amp).
"""

from __future__ import annotations

import os as _os
import types as _types

from . import _C
from ._core.devices import current_device, device_count, is_available, set_device
from ._core.errors import OutOfMemoryError, VramkitError
from .memory.cache import CacheReport, clear_cache
from .memory.api import (
    Buffer,
    configure,
    dump_snapshot,
    empty,
    empty_cache,
    get_settings,
    host_memory_info,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    pool_check,
    raw_alloc,
    raw_free,
    record_memory_history,
    record_stream,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_memory_limit,
    set_per_process_memory_fraction,
    synchronize,
)
from .memory.compat import (
    caching_allocator_alloc,
    caching_allocator_delete,
    caching_allocator_disabled,
    caching_allocator_enable,
    get_allocator_backend,
    get_per_process_memory_fraction,
    host_memory_stats,
    host_memory_stats_as_nested_dict,
    max_memory_cached,
    memory_cached,
    memory_stats_as_nested_dict,
    reset_accumulated_host_memory_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_host_memory_stats,
)
from .memory.mempool import MemPool, use_mem_pool
from .survive.smi import list_gpu_processes
from . import amp, sim, survive
from .survive.leaks import watch_leaks
from .survive.oom import on_oom

__version__ = _C.__version__

# Stacks recorded in the history start at the caller's code, not inside vramkit (the bundled
# examples, installed inside the package, count as the caller's code).
_here = _os.path.dirname(_os.path.abspath(__file__)) + _os.sep
_C._set_hidden_prefix(_here, _here + "examples" + _os.sep)

__all__ = [
    "Buffer", "CacheReport", "OutOfMemoryError", "VramkitError", "clear_cache", "configure", "current_device",
    "device_count", "dump_snapshot", "empty", "empty_cache", "get_settings", "host_memory_info", "is_available",
    "max_memory_allocated",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_reserved", "memory_snapshot", "memory_stats",
    "memory_summary", "pool_check", "raw_alloc", "raw_free", "record_memory_history", "record_stream",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats", "set_device", "set_memory_limit", "amp",
    "on_oom", "set_per_process_memory_fraction", "sim", "survive", "synchronize", "watch_leaks",
    # torch.cuda.memory's other names (memory/compat.py, survive/smi.py)
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_disabled", "caching_allocator_enable",
    "get_allocator_backend", "get_per_process_memory_fraction",
    "host_memory_stats", "host_memory_stats_as_nested_dict", "list_gpu_processes", "max_memory_cached",
    "memory_cached", "memory_stats_as_nested_dict", "reset_accumulated_host_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_peak_host_memory_stats",
    "MemPool", "use_mem_pool",
]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext vramkit`` in IPython or Jupyter: the ``%%vram`` and ``%vram_free`` magics
    (``vramkit.integrations.notebook``)."""
    from .integrations.notebook import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> _types.ModuleType:
    # vramkit.numpy imports NumPy's handler machinery only when first used.
    if name == "numpy":
        import importlib

        return importlib.import_module(".numpy", __name__)
    raise AttributeError(f"module 'vramkit' has no attribute {name!r}")
