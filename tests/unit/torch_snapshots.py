"""Hand-built PyTorch memory snapshots (``torch.cuda.memory._snapshot()``'s dict), no torch needed.

The builders only lay out the format; every address, size and state is the test's to write, as
PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp) would have produced it:

* ``alloc``, ``free_requested`` and ``free_completed`` entries carry the *requested* bytes
  (``alloc_found_block`` records ``orig_size``; ``free`` and ``free_block`` record
  ``block->requested_size``);
* ``segment_alloc`` / ``segment_free`` carry the segment (cudaMalloc) size;
* an ``oom`` entry has ``device_free`` instead of ``addr`` and the request rounded up to 512;
* blocks list ``size`` (the rounded block size) and ``requested_size``, and their state is
  "active_allocated", "active_pending_free" (what PyTorch's C++ writes; its docstring says
  "active_awaiting_free") or "inactive".

The segment's totals (``total_size``, ``allocated_size``, ``active_size``, ``requested_size``)
are sums over its blocks, as ``DeviceCachingAllocator::snapshot()`` forms them, and block
addresses follow each other from the segment's address, as in ``_memory_snapshot_pickled``.
"""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any, Iterable

KiB = 1 << 10
MiB = 1 << 20

_clock = itertools.count(1_700_000_000_000_000, 7)  # time_us, microseconds since the epoch

Frame = dict[str, Any]


def frame(filename: str, line: int, name: str) -> Frame:
    return {"filename": filename, "line": line, "name": name}


def _entry(action: str, addr: int, size: int, stream: int, frames: Iterable[Frame]) -> dict[str, Any]:
    # a list is kept as it is: pickled snapshots share one frames list among the entries of a context
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": next(_clock),
            "frames": frames if isinstance(frames, list) else list(frames)}


def alloc(addr: int, size: int, stream: int = 0, frames: Iterable[Frame] = ()) -> dict[str, Any]:
    return _entry("alloc", addr, size, stream, frames)


def free_requested(addr: int, size: int, stream: int = 0, frames: Iterable[Frame] = ()) -> dict[str, Any]:
    return _entry("free_requested", addr, size, stream, frames)


def free_completed(addr: int, size: int, stream: int = 0, frames: Iterable[Frame] = ()) -> dict[str, Any]:
    return _entry("free_completed", addr, size, stream, frames)


def free(addr: int, size: int, stream: int = 0) -> list[dict[str, Any]]:
    """A free with no other stream using the block: both entries, back to back."""
    return [free_requested(addr, size, stream), free_completed(addr, size, stream)]


def segment_alloc(addr: int, size: int, stream: int = 0) -> dict[str, Any]:
    return _entry("segment_alloc", addr, size, stream, ())


def segment_free(addr: int, size: int, stream: int = 0) -> dict[str, Any]:
    return _entry("segment_free", addr, size, stream, ())


def oom(size: int, device_free: int, stream: int = 0) -> dict[str, Any]:
    return {"action": "oom", "device_free": device_free, "size": size, "stream": stream, "time_us": next(_clock),
            "frames": []}


def snapshot_entry(total_active: int) -> dict[str, Any]:
    """The entry `_snapshot()` itself records (size: the active bytes at that moment)."""
    return {"action": "snapshot", "addr": 0, "size": total_active, "stream": 0, "time_us": next(_clock)}


def block(size: int, requested_size: int = 0, state: str = "inactive", frames: Iterable[Frame] = ()) -> dict[str, Any]:
    return {"size": size, "requested_size": requested_size, "state": state, "frames": list(frames)}


def live(size: int, requested_size: int, frames: Iterable[Frame] = ()) -> dict[str, Any]:
    return block(size, requested_size, "active_allocated", frames)


def pending(size: int, requested_size: int, state: str = "active_pending_free") -> dict[str, Any]:
    return block(size, requested_size, state)


def segment(address: int, blocks: list[dict[str, Any]], stream: int = 0, device: int = 0,
            segment_type: str | None = None) -> dict[str, Any]:
    addr = address
    out = []
    for b in blocks:
        out.append({"address": addr, **b})
        addr += b["size"]
    total = sum(b["size"] for b in blocks)
    active = [b for b in blocks if b["state"] != "inactive"]
    return {
        "device": device, "address": address, "total_size": total,
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": stream, "segment_type": segment_type or ("small" if total == 2 * MiB else "large"),
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": out,
    }


def flatten(entries: Iterable[Any]) -> list[dict[str, Any]]:
    """Entries, with lists (from `free`) spliced in."""
    out: list[dict[str, Any]] = []
    for e in entries:
        out.extend(e if isinstance(e, list) else [e])
    return out


def snapshot(device_traces: list[list[Any]], segments: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"segments": segments, "device_traces": [flatten(t) for t in device_traces],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0, "expandable_segments": False,
                                   "roundup_power2_divisions": {}},
            **extra}


def write_pickle(snap: Any, path: str | os.PathLike) -> str:
    """As torch.cuda.memory._dump_snapshot() writes it: pickle.dump of the dict."""
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    return os.fspath(path)
