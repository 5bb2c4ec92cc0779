"""The rest of torch.cuda.memory's public names, with torch's signatures, for vramkit's pools.

Old scripts and copied snippets call these; each behaves as torch's does, on any vramkit device:

* ``memory_stats_as_nested_dict`` — ``memory_stats`` before torch flattens it ("a.b.c" keys
  split back into nested dicts);
* the deprecated aliases ``memory_cached``, ``max_memory_cached``, ``reset_max_memory_allocated``
  and ``reset_max_memory_cached``, with torch's ``FutureWarning``;
* ``caching_allocator_alloc`` / ``caching_allocator_delete`` — a raw block of the device's pool
  on a stream (a ``torch.cuda.Stream``-like object with ``cuda_stream``, or an int);
* ``get_per_process_memory_fraction`` — the fraction of the device's capacity this process may
  reserve (1.0 without a cap);
* ``host_memory_stats`` and friends — torch's host (pinned) allocator statistics, here from
  vramkit's host pool, ``cpu``, in torch's key names: ``allocations`` are the host segments,
  ``allocated_bytes`` their bytes (blocks owned by the allocator, active or cached),
  ``active_requests`` / ``active_bytes`` the blocks handed out, ``num_host_alloc`` /
  ``num_host_free`` the segments mapped and unmapped. vramkit does not time host allocations,
  so torch's ``host_alloc_time`` / ``host_free_time`` keys are absent;
* ``caching_allocator_enable`` / ``caching_allocator_disabled`` — caching on or off for every
  pool (off: freed segments go straight back to the device); the blocks are counted, so they
  may nest and overlap across threads, and override the enable flag while any is active;
* ``get_allocator_backend`` — ``"native"``: vramkit implements PyTorch's native caching
  policy (not ``cudaMallocAsync``).

``list_gpu_processes`` is in ``vramkit.smi`` (it needs NVML). What is still missing, and why,
is listed with the parity test (tests/unit/test_torch_memory_parity.py).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any, Iterator

from .. import _C
from .._core.devices import DeviceLike
from .api import get_settings, max_memory_reserved, mem_get_info, memory_reserved, memory_stats, raw_alloc, raw_free, reset_accumulated_memory_stats, reset_peak_memory_stats

__all__ = [
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_disabled", "caching_allocator_enable", "get_allocator_backend",
    "get_per_process_memory_fraction", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "max_memory_cached", "memory_cached", "memory_stats_as_nested_dict", "reset_accumulated_host_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_peak_host_memory_stats",
]


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_stats_as_nested_dict(device: DeviceLike = None) -> dict[str, Any]:
    """Return the result of memory_stats() as a nested dictionary, as torch's does."""
    return _nest(dict(memory_stats(device)))


def memory_cached(device: DeviceLike = None) -> int:
    """Deprecated; see memory_reserved()."""
    warnings.warn("`vramkit.memory_cached` has been renamed to `vramkit.memory_reserved` (as in torch.cuda)",
                  FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device: DeviceLike = None) -> int:
    """Deprecated; see max_memory_reserved()."""
    warnings.warn("`vramkit.max_memory_cached` has been renamed to `vramkit.max_memory_reserved` (as in torch.cuda)",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def reset_max_memory_allocated(device: DeviceLike = None) -> None:
    """Reset the peak of memory_allocated(); like torch's, it resets every peak statistic."""
    warnings.warn("vramkit.reset_max_memory_allocated now calls vramkit.reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats.", FutureWarning, stacklevel=2)
    return reset_peak_memory_stats(device)


def reset_max_memory_cached(device: DeviceLike = None) -> None:
    """Reset the peak of memory_reserved(); like torch's, it resets every peak statistic."""
    warnings.warn("vramkit.reset_max_memory_cached now calls vramkit.reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats.", FutureWarning, stacklevel=2)
    return reset_peak_memory_stats(device)


def caching_allocator_alloc(size: int, device: DeviceLike = None, stream: Any = None) -> int:
    """Allocate `size` bytes from the device's pool on `stream` (None: the default stream);
    free the address with caching_allocator_delete()."""
    if stream is None:
        stream = 0
    elif hasattr(stream, "cuda_stream"):  # a torch.cuda.Stream or a cupy one
        stream = stream.cuda_stream
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError("Invalid type for stream argument, must be `torch.cuda.Stream` or `int` representing a "
                        f"pointer to an existing stream; got {type(stream).__name__}")
    return raw_alloc(size, device, stream)


def caching_allocator_delete(mem_ptr: int) -> None:
    """Give back an address from caching_allocator_alloc(); its device and stream are tracked."""
    raw_free(mem_ptr)


def caching_allocator_enable(value: bool = True) -> None:
    """Turn caching on or off for every vramkit pool of the process (on by default).

    Off, each free that leaves a segment wholly free returns it to the device at once (an
    empty_cache after every free; expandable segments unmap their free pages): slow, but what is
    reserved is then what is live, which helps to find what a step really needs, or a
    use-after-free that the cache would hide. What a pool cached before the switch goes back at
    its next free (or empty_cache).

    The value is the process's default: while any caching_allocator_disabled() block is active,
    on any thread, caching stays off whatever it says; it applies again when the last block
    ends (so enabling inside a block takes effect after the block)."""
    _C.set_caching_enabled(bool(value))


@contextlib.contextmanager
def caching_allocator_disabled() -> Iterator[None]:
    """Context manager that turns caching off for its duration (see caching_allocator_enable).

    Blocks may nest and overlap, on one thread or many, entered and left in any order: caching
    is off while at least one is active (a process-wide count, not a saved and restored flag),
    and follows caching_allocator_enable() again once the last one has ended."""
    _C.caching_disable_enter()
    try:
        yield
    finally:
        _C.caching_disable_exit()


def get_per_process_memory_fraction(device: DeviceLike = None) -> float:
    """The share of the device's capacity this process may reserve, in range 0~1 (1.0 without a cap).

    With a cap set in bytes (set_memory_limit), the fraction it amounts to."""
    settings = get_settings(device)
    if settings["memory_fraction"] is not None and settings["memory_limit"] is None:
        return float(settings["memory_fraction"])
    if settings["memory_limit"] is None:
        return 1.0
    total = mem_get_info(device)[1]
    return min(1.0, settings["allowed_bytes"] / total) if total else 0.0


# torch's host statistic -> vramkit's cpu pool statistic it is read from.
_HOST_KEYS = {"allocations": "segment.all", "allocated_bytes": "reserved_bytes.all",
              "active_requests": "active.all", "active_bytes": "active_bytes.all"}
_HOST_COUNTERS = {"num_host_alloc": "num_device_alloc", "num_host_free": "num_device_free"}


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """host_memory_stats() as a nested dictionary."""
    stats = _C.memory_stats("cpu")
    nested: dict[str, Any] = {name: {m: stats[f"{key}.{m}"] for m in ("current", "peak", "allocated", "freed")}
                              for name, key in _HOST_KEYS.items()}
    nested.update({name: stats[key] for name, key in _HOST_COUNTERS.items()})
    return nested


def host_memory_stats() -> "collections.OrderedDict[str, int]":
    """Host allocator statistics in torch's key names, from vramkit's host pool (see the module doc)."""
    flat: dict[str, int] = {}
    for name, value in host_memory_stats_as_nested_dict().items():
        if isinstance(value, dict):
            flat.update({f"{name}.{m}": v for m, v in value.items()})
        else:
            flat[name] = value
    return collections.OrderedDict(sorted(flat.items()))


def reset_accumulated_host_memory_stats() -> None:
    """Zero the host pool's accumulated statistics (allocated/freed totals and event counters)."""
    reset_accumulated_memory_stats("cpu")


def reset_peak_host_memory_stats() -> None:
    """Set the host pool's peak statistics to their current values."""
    reset_peak_memory_stats("cpu")


def get_allocator_backend() -> str:
    """'native': vramkit's pools follow PyTorch's native caching allocator's policy."""
    return "native"
