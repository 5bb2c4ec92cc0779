"""The memory API, named and shaped as torch.cuda's, for every vramkit device.

Every function takes `device=None` (the default device, see set_device): 'cpu', 'cuda',
'cuda:N', 'sim:N', an int CUDA index or a torch.device.
"""

from __future__ import annotations

import collections
import pickle
from typing import Any, Mapping, NamedTuple, Sequence

from .. import _C
from .._core.devices import DeviceLike
from .._core.files import write_atomically

Buffer = _C.Buffer


class MemoryCounters(NamedTuple):
    """The four counters of one device, read together, in bytes. Code that needs more than
    one of them reads them by name from here rather than by position from the extension's
    tuple, whose order (allocated, peak allocated, reserved, peak reserved) is easy to mix up."""

    allocated: int        # memory_allocated
    peak_allocated: int   # max_memory_allocated
    reserved: int         # memory_reserved
    peak_reserved: int    # max_memory_reserved


def memory_counters(device: DeviceLike = None) -> MemoryCounters:
    """memory_allocated, max_memory_allocated, memory_reserved and max_memory_reserved of a
    device (or a MemPool's name) in one call, as a MemoryCounters."""
    return MemoryCounters(*_C.memory_counters(device))


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes in blocks handed out and not yet freed (allocated_bytes.all.current)."""
    return memory_counters(device).allocated


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak of memory_allocated since start or the last reset_peak_memory_stats()."""
    return memory_counters(device).peak_allocated


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes held from the device in segments, allocated or cached (reserved_bytes.all.current)."""
    return memory_counters(device).reserved


def max_memory_reserved(device: DeviceLike = None) -> int:
    """Peak of memory_reserved since start or the last reset_peak_memory_stats()."""
    return memory_counters(device).peak_reserved


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Set every peak counter to its current value."""
    _C.reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Zero the allocated/freed totals and the event counters (retries, OOMs, device allocs...)."""
    _C.reset_accumulated_memory_stats(device)


def memory_stats(device: DeviceLike = None) -> "collections.OrderedDict[str, int]":
    """All counters with torch.cuda.memory_stats' keys, sorted by key.

    The 108 core keys are {allocation, segment, active, inactive_split, allocated_bytes,
    reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes} x {all, small_pool,
    large_pool} x {current, peak, allocated, freed}; then num_alloc_retries, num_ooms,
    num_sync_all_streams, num_device_alloc, num_device_free, max_split_size and the
    oversize_allocations / oversize_segments counters.

    The cpu pool adds its host keys: host_cache_limit (the cap on reserved - allocated bytes,
    -1 for none), host_reclaimable_bytes (cached bytes whose pages hold nothing the kernel
    cannot take back: given back with madvise, or never touched), host_lazy_reused_bytes
    (bytes handed out again after MADV_FREE, which the kernel still counts as free),
    host_untouched_bytes (bytes handed out from never-touched pages that the last host check,
    or mem_get_info("cpu"), had not yet seen written: the check counts them as used), and the
    counters num_host_page_releases, num_host_cache_limit_releases and
    num_host_memory_rejections (new segments refused because the host could not give them).
    """
    return collections.OrderedDict(sorted(_C.memory_stats(device).items()))


def memory_summary(device: DeviceLike = None, abbreviated: bool = False) -> str:
    """PyTorch's 75-column memory summary table, titled 'vramkit memory summary, device <dev>'."""
    return _C.memory_summary(device, abbreviated)


def memory_snapshot(device: DeviceLike = None) -> dict[str, Any]:
    """The allocator state in torch.cuda.memory._snapshot()'s schema.

    {'segments': [{address, total_size, stream, segment_type, allocated_size, active_size,
    requested_size, device, blocks: [{address, size, requested_size, state, frames}], ...}],
    'device_traces': [[{action, addr, size, stream, time_us, frames}, ...]]}. The trace holds
    what record_memory_history() recorded; frames list the Python stack, innermost first.
    """
    return _C.memory_snapshot(device)


def write_snapshot(snapshot: dict[str, Any], path: str) -> str:
    """Pickle a snapshot dict to `path` in the form pytorch.org/memory_viz loads.

    Pickle protocol 4 is used because the viewer's unpickler knows protocols 2 to 4 only. The
    file is written to a temporary name and renamed: a failure leaves no partial file.
    """
    return write_atomically(path, pickle.dumps(snapshot, protocol=4))


def dump_snapshot(path: str = "vramkit-snapshot.pickle", device: DeviceLike = None) -> str:
    """Pickle memory_snapshot() to `path`; drag the file onto https://pytorch.org/memory_viz."""
    return write_snapshot(memory_snapshot(device), path)


def record_memory_history(enabled: Any = True, max_entries: int = 100_000, device: DeviceLike = None) -> None:
    """Record allocations, frees and segment changes (with Python stacks) in a ring buffer.

    enabled: True or "all" to record, False or None to stop (and drop the recorded history).
    max_entries: how many of the newest events to keep.
    """
    if enabled in (False, None):
        _C.history_enable(device, 0)
        return
    if enabled is not True and enabled != "all":
        raise ValueError(f"enabled must be True, 'all', False or None; got {enabled!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"max_entries must be a positive integer, got {max_entries!r}")
    _C.history_enable(device, max_entries)


def empty_cache(device: DeviceLike = None) -> int:
    """Return every wholly free cached segment to the device; returns the bytes released.

    Waits for streams that still use freed blocks first. Memory in use is untouched, and a
    segment with any live block stays.
    """
    return _C.empty_cache(device)


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of the device as its backend reports them: cudaMemGetInfo on CUDA,
    capacity minus reserved on sim, and on cpu what the cpu pool checks each new segment
    against (host_memory_info()'s available and total, less the pages vramkit reused after
    MADV_FREE, which the kernel still counts as free)."""
    return _C.mem_get_info(device)


def host_memory_info() -> dict[str, Any]:
    """The host memory the cpu pool checks before it maps a new segment, in bytes.

    total: what this process may use, min(MemTotal, cgroup limit). available: what it can
    still map and touch, min(MemAvailable + SwapFree, the cgroup's limit minus what it cannot
    reclaim plus its free swap). ram_total, mem_available, swap_free: from /proc/meminfo.
    cgroup_limit (None if no limit applies), cgroup_usage and cgroup_reclaimable (inactive
    file pages) of the tightest memory cgroup from this process's up to the root, its
    directory cgroup_path, and cgroup_version (1, 2, or 0 without a memory controller).
    Containers and CI runners set such limits; past them the kernel's OOM killer ends the
    process even when the machine has memory free.
    """
    return _C.host_memory_info()


def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """Cap this process's reserved memory at fraction x the device's total capacity."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"Invalid type for fraction argument, must be `float`, got {type(fraction).__name__}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _C.set_memory_fraction(float(fraction), device)


def set_memory_limit(nbytes: int | None, device: DeviceLike = None) -> None:
    """Cap this process's reserved memory at an absolute number of bytes (None removes the cap).

    Requests that would need a segment beyond the cap free cached memory first, then raise
    OutOfMemoryError, exactly as if the device were that small.
    """
    _C.set_memory_limit(nbytes, device)


def _format_option(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}:{value}"
    if value is None:
        return f"{key}:None"
    if key == "roundup_power2_divisions" and isinstance(value, Mapping):
        return f"{key}:[" + ",".join(f"{k}:{v}" for k, v in value.items()) + "]"
    if key == "roundup_power2_divisions" and isinstance(value, Sequence) and not isinstance(value, str):
        return f"{key}:[" + ",".join(f"{k}:{v}" for k, v in value) + "]"
    return f"{key}:{value}"


def configure(device: DeviceLike = None, **options: Any) -> dict[str, Any]:
    """Change allocator options at run time; returns the settings now in force.

    Options use VRAMKIT_ALLOC_CONF's names (PyTorch's PYTORCH_CUDA_ALLOC_CONF names):
    max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions (an int, or a
    mapping like {256: 1, 512: 2, ">": 8}), garbage_collection_threshold,
    per_process_memory_fraction, memory_limit_mb, expandable_segments (bool; one growing
    address range per stream with memory mapped in pages on demand, as PyTorch's; it can be
    changed only while no memory of the device is in use, and the change releases the cache)
    and expandable_page_mb (the large pool's page in expandable segments: default 20 on
    devices, as PyTorch's, 2 on cpu). None resets max_split_size_mb and memory_limit_mb. All
    or nothing: on error nothing changes.

    The cpu pool also takes the host_* options (see the README): host_memory_check (bool),
    host_reserve_mb, host_page_release_mb (None: never), host_lazy_free (bool),
    host_cache_limit_mb and host_cache_limit_fraction (None: no cap). Other devices refuse
    them with ValueError.
    """
    if options:
        _C.configure(",".join(_format_option(k, v) for k, v in options.items()), device)
    return _C.get_settings(device)


def get_settings(device: DeviceLike = None) -> dict[str, Any]:
    """The allocator options in force for a device (sizes in bytes, None for 'no limit')."""
    return _C.get_settings(device)


def pool_check(device: DeviceLike = None) -> None:
    """Verify every allocator invariant of a device's pool; raises VramkitError naming the first
    violation. Blocks must tile their segments, free neighbours must be merged, the free index
    must hold exactly the free blocks, and every counter must equal a recount."""
    _C.pool_check(device)


raw_alloc = _C.raw_alloc
raw_free = _C.raw_free


def record_stream(memory: "int | Buffer", stream: Any) -> None:
    """Mark memory (an address from raw_alloc, or a Buffer) as used on another stream: once freed
    it is not reused until the work queued on that stream by then has finished.

    On cpu and sim devices streams are logical queues that finish when synchronize() is
    called for them (or by empty_cache)."""
    _C.record_stream(memory.ptr if isinstance(memory, Buffer) else memory, stream)


def synchronize(device: DeviceLike = None, stream: Any = None) -> None:
    """Wait for `stream` (or every stream) of a device, then reclaim blocks whose other-stream
    uses have finished."""
    _C.synchronize(device, stream)


_DLPACK_CODES = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}


def _buffer_layout(dtype: Any) -> tuple[Any, str, int, int]:
    import numpy as np

    dt = np.dtype(np.uint8 if dtype is None else dtype)
    if dt.name == "bfloat16":
        code = 4
    elif dt.kind in _DLPACK_CODES and not dt.fields and not dt.subdtype:
        code = _DLPACK_CODES[dt.kind]
    else:
        raise TypeError(f"dtype must be a boolean, integer, floating or complex type (or ml_dtypes.bfloat16); got {dt}")
    try:
        fmt = memoryview(np.empty(0, dt)).format  # type: ignore[arg-type]  # numpy types __buffer__ only on 3.12+
    except (ValueError, TypeError):
        fmt = "B" if dt.itemsize == 1 else f"{dt.itemsize}x"  # exported as raw bytes of each element
    return dt, fmt, code, dt.itemsize * 8


def empty(nbytes_or_shape: "int | Sequence[int]", dtype: Any = None, device: DeviceLike = None) -> "Buffer":
    """A new uninitialised Buffer from the device's cache; it returns there when garbage collected.

    With dtype=None the buffer holds bytes, so an int is both its size in bytes and its shape;
    with a dtype, the first argument is the shape (an int for one dimension). Host buffers
    support numpy.asarray (zero-copy); CUDA buffers __cuda_array_interface__; both DLPack.
    """
    dt, fmt, code, bits = _buffer_layout(dtype)
    if isinstance(nbytes_or_shape, bool):
        raise TypeError("nbytes_or_shape must be an int or a sequence of ints, got bool")
    try:
        import operator

        # a sequence is no index: operator.index raises TypeError, handled below
        shape: tuple[int, ...] = (operator.index(nbytes_or_shape),)  # type: ignore[arg-type]
    except TypeError:
        if not isinstance(nbytes_or_shape, Sequence) or isinstance(nbytes_or_shape, (str, bytes)):
            raise TypeError(f"nbytes_or_shape must be an int or a sequence of ints, got "
                            f"{type(nbytes_or_shape).__name__}") from None
        shape = tuple(nbytes_or_shape)
        for d in shape:
            if isinstance(d, bool) or not hasattr(d, "__index__"):
                raise TypeError(f"shape entries must be ints, got {type(d).__name__}") from None
        shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape entries must be non-negative, got {shape}")
    count = 1
    for d in shape:
        count *= d
    return _C.empty_buffer(count * dt.itemsize, device, shape, fmt, dt.str, dt.itemsize, code, bits)
