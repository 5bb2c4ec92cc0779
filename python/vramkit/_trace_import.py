"""Import a PyTorch memory snapshot's allocation trace as a ``Trace`` (``from_torch_snapshot``).

A snapshot is what ``torch.cuda.memory._snapshot()`` returns (or ``_dump_snapshot()`` pickles)
after ``torch.cuda.memory._record_memory_history()``: ``{"segments": [...], "device_traces":
[[entry, ...] per device]}``; vramkit's ``memory_snapshot()`` / ``dump_snapshot()`` write the
same schema. One device's entries become one ``Trace``.

What maps to what
-----------------
* ``alloc`` -> ALLOC with a fresh id (ids dense from 0, in event order). Entries name a block by
  address, and an address is handed out again once freed, so the import keeps address -> the
  id now living there.
* ``free_completed`` -> FREE of that id: from then on PyTorch's allocator can hand the memory
  out again (``free_block``). ``free_requested`` (or ``free``, as older snapshots name it) makes
  no event: it marks the tensor's death, when ``memory_allocated`` drops, and it comes earlier
  than ``free_completed`` when the block was used on other streams and waits for their events.
  A ``free_requested`` never followed by its ``free_completed`` leaves the block live to the end
  of the trace (``meta["unfinished_frees"]``). The live bytes of the trace are therefore
  PyTorch's *active* bytes (``active_bytes``), which for single-stream code equal
  ``memory_allocated``.
* Blocks alive before the first entry become ALLOC events ahead of it, in address order:
  addresses whose first entry is a ``free_requested``/``free_completed`` (the ring buffer
  dropped their ``alloc``, or recording began after it), and blocks still active in the final
  ``segments`` that no entry mentions. ``meta["initial_allocations"]`` counts them.
* ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap`` (cudaMalloc, cudaFree,
  expandable-segment mapping), ``oom``, ``snapshot`` and annotations make no events: the replay
  makes its own segments. They, and the final ``segments``, give the ``meta["recorded_*"]``
  figures that the replay is compared with.
* ``stream``: the entry's stream (a ``cudaStream_t`` value; 0, the default stream, if absent).
* Attribution: ``alloc_module`` is "filename:line" of the innermost frame that is the user's
  (not inside a ``torch/`` or ``vramkit/`` directory, not a ``<...>`` pseudo-file, not a C++
  frame); ``alloc_op`` that frame's function name; -1 without such a frame. Allocations seen
  only by their free get -1: a free entry's stack is where the block was freed. The category is
  "unknown" and the dtype -1: a snapshot records neither.

Sizes
-----
PyTorch's ``CUDACachingAllocator.cpp`` records the *requested* bytes on ``alloc``
(``alloc_found_block``: ``orig_size``), on ``free_requested`` (``free``) and on
``free_completed`` (``free_block``): ``block->requested_size``. ``segment_alloc`` and
``segment_free`` carry the segment (cudaMalloc) size, ``oom`` the request rounded to 512 bytes
(``params.size()``) with ``device_free`` where other entries have ``addr``. The trace's sizes are
those requested bytes, so allocations alive before the trace take their size from the same
quantity: the free entry's size, or the final block's ``requested_size``. vramkit's own
snapshots (they carry a ``vramkit_device`` key) record block sizes (512-rounded) in their
entries; for them the block ``size`` is used throughout (``meta["trace_sizes"]``).

Recorded figures (``meta``)
---------------------------
``recorded_reserved``: the final segments' ``total_size``. ``recorded_allocated``: the block
``size`` (rounded, what PyTorch's byte counters add) of blocks ``active_allocated`` or awaiting
their free (``active_pending_free``, as PyTorch's C++ writes it; ``active_awaiting_free`` in its
docstring), i.e. ``active_bytes``; ``recorded_memory_allocated`` leaves out the blocks awaiting
their free, as ``torch.cuda.memory_allocated()`` does. ``recorded_requested``: their
``requested_size``. ``recorded_peak_reserved``: reserved bytes before the first entry (the final
figure less the trace's segment allocations plus its segment frees), then the running maximum.
``recorded_peak_allocated``: the same curve over this trace's ALLOC/FREE events (active bytes),
each allocation counted at its block size: known from the final segments for those still live,
else the recorded size (vramkit snapshots), else the request rounded up to 512 bytes as PyTorch
rounds it. That last one is an estimate (``meta["allocated_size_estimates"]`` counts them): a
large block handed out without splitting is bigger than the rounded request (by up to 1 MiB,
or up to 20 MiB for blocks above ``max_split_size_mb``), and ``roundup_power2_divisions``
rounds further. ``recorded_ooms``: one
``{"event", "size", "device_free"}`` per ``oom`` entry, ``event`` being the index in the new
trace of the first event after it (the failed allocation itself is not an event).

Known differences from the recorded run
---------------------------------------
* A trace recorded with ``max_entries`` smaller than the run starts mid-run: what was allocated
  then is recovered as above, but the allocator's cache at that moment (free blocks inside
  reserved segments) is not: the replay starts with an empty cache and packs the initial
  allocations in address order, so fragmentation early in the trace can differ.
* Recording turned off and on again, or ``clear_history``, drops the earlier entries the same
  way.
* A vramkit snapshot's trace sizes are block sizes: a large block handed out unsplit replays as
  a request of its whole size.
* CUDA-graph private pools (``pool_id``) are not modelled: their allocations replay in the
  ordinary pools.
* Blocks allocated between the trace's end and the segments' capture (another thread, the
  snapshot being taken device by device) are left out (``meta["untraced_end_blocks"]``).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._trace_format import ALLOC, CATEGORIES, FREE, Trace, TraceFormatError

__all__ = ["from_torch_snapshot"]

_KMIN_BLOCK = 512  # PyTorch's kMinBlockSize: every request is rounded up to a multiple of it
_ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
_FREE_ACTIONS = ("free_requested", "free", "free_completed")  # "free": pre-2.1 name of free_requested
_MEM_ACTIONS = ("alloc", *_FREE_ACTIONS)
_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_CPP_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")
_MASK64 = (1 << 64) - 1
_EXPECTED = ("a dict from torch.cuda.memory._snapshot() or vramkit.memory_snapshot() with keys 'segments' and "
             "'device_traces'")


def _round_up(n: int) -> int:
    return max(_KMIN_BLOCK, -(-n // _KMIN_BLOCK) * _KMIN_BLOCK)


def _is_internal(filename: str) -> bool:
    """Whether a frame is PyTorch's, vramkit's, a pseudo-file or C++ rather than the user's."""
    if not filename or filename == "??" or filename.startswith("<"):
        return True
    path = filename.replace("\\", "/")
    base = path.rsplit("/", 1)[-1]
    if base.endswith(_CPP_SUFFIXES) or ".so" in base:
        return True
    dirs = path.split("/")[:-1]
    for k, d in enumerate(dirs):
        if d == "torch":
            return True
        # vramkit's bundled examples are user code, even in a checkout named vramkit/
        if d == "vramkit" and not (k + 1 < len(dirs) and dirs[k + 1] == "examples"):
            return True
    return False


def _load(snapshot: Any) -> tuple[Mapping[str, Any], str]:
    """The snapshot dict and a name for messages."""
    if isinstance(snapshot, (str, os.PathLike)):
        path = os.fspath(snapshot)
        with open(path, "rb") as f:  # FileNotFoundError etc. as Python raises them
            data = f.read()
        try:
            obj = pickle.loads(data)
        except MemoryError:
            raise
        except Exception as exc:  # truncated (EOFError, UnpicklingError), garbage, unknown classes
            raise TraceFormatError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc}); expected a file "
                                   "written by torch.cuda.memory._dump_snapshot() or vramkit.dump_snapshot()") from None
        what = path
    elif isinstance(snapshot, Mapping):
        obj, what = snapshot, "snapshot"
    else:
        raise TypeError(f"snapshot must be {_EXPECTED}, or the path of a pickle of one; got "
                        f"{type(snapshot).__name__}")
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"{what}: holds a {type(obj).__name__}, expected {_EXPECTED}")
    missing = [k for k in ("segments", "device_traces") if k not in obj]
    if missing:
        raise TraceFormatError(f"{what}: missing {' and '.join(repr(k) for k in missing)}; expected {_EXPECTED} "
                               f"(it has {sorted(map(str, obj))[:8]})")
    if not isinstance(obj["device_traces"], (list, tuple)) or not all(
            isinstance(t, (list, tuple)) for t in obj["device_traces"]):
        raise TraceFormatError(f"{what}: 'device_traces' must be a list with one list of trace entries per device")
    if not isinstance(obj["segments"], (list, tuple)) or not all(isinstance(s, Mapping) for s in obj["segments"]):
        raise TraceFormatError(f"{what}: 'segments' must be a list of segment dicts")
    return obj, what


def _pick_device(snap: Mapping[str, Any], device: Any, what: str) -> int:
    traces = snap["device_traces"]
    n = len(traces)
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise ValueError(f"device must be an index into device_traces (an int) or None, got {device!r}")
        device = int(device)
        if not 0 <= device < n:
            valid = f"0..{n - 1}" if n else "none: it has no device traces"
            raise ValueError(f"device {device} is out of range for {what}: valid devices are {valid}")
        return device
    busy = [i for i, t in enumerate(traces) if len(t)]
    if len(busy) == 1:
        return busy[0]
    if len(busy) > 1:
        raise TraceFormatError(f"{what}: devices {busy} all have trace entries; pass device= one of them")
    if n == 0:
        raise TraceFormatError(f"{what}: 'device_traces' is empty (no device); record with "
                               "torch.cuda.memory._record_memory_history() before taking the snapshot")
    with_segments = sorted({int(s.get("device", 0)) for s in snap["segments"]})
    return with_segments[0] if len(with_segments) == 1 and with_segments[0] < n else 0


def _final_blocks(segments: list[Mapping[str, Any]],
                  what: str) -> tuple[dict[int, tuple[Any, ...]], int, int, int, int]:
    """address -> (size, requested_size, stream, frames) of the active blocks, and the totals:
    reserved, active bytes, allocated (not awaiting free) bytes, requested bytes."""
    active: dict[int, tuple[Any, ...]] = {}
    reserved = act = allocated = requested = 0
    for si, seg in enumerate(segments):
        try:
            reserved += int(seg["total_size"])
            addr = int(seg.get("address", 0))
            stream = int(seg.get("stream", 0) or 0) & _MASK64
            for b in seg.get("blocks") or ():
                size = int(b["size"])
                if "address" in b:
                    addr = int(b["address"])
                state = b.get("state")
                if state in _ACTIVE_STATES:
                    req = int(b.get("requested_size") or 0)
                    active[addr] = (size, req, stream, b.get("frames"))
                    act += size
                    requested += req
                    if state == "active_allocated":
                        allocated += size
                addr += size
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{what}: segment {si} at {seg.get('address')!r} is malformed "
                                   f"({type(exc).__name__}: {exc}); a segment needs total_size and blocks with "
                                   "size and state") from None
    return active, reserved, act, allocated, requested


def from_torch_snapshot(snapshot: Any, device: int | None = None) -> Trace:
    """One device's allocation trace from a PyTorch memory snapshot, as a ``Trace``.

    snapshot: the dict ``torch.cuda.memory._snapshot()`` (or ``vramkit.memory_snapshot()``)
    returns, or the path (str or PathLike) of a pickle of one, as written by
    ``torch.cuda.memory._dump_snapshot()`` or ``vramkit.dump_snapshot()``. Unpickling can run
    arbitrary code: pass only files you made or trust.

    device: the index into ``device_traces``; None picks the only device with trace entries.

    Raises FileNotFoundError (and other OSErrors) for a path that cannot be read;
    ``TraceFormatError`` for content that is not a snapshot (an unreadable or truncated pickle,
    not a dict, no 'segments'/'device_traces', malformed entries or entries that contradict each
    other), and for several devices with entries and device=None; ValueError for a device out of
    range; TypeError for an argument that is neither a dict nor a path. See the module docstring
    for what maps to what and for ``meta``.
    """
    snap, what = _load(snapshot)
    dev = _pick_device(snap, device, what)
    entries = snap["device_traces"][dev]
    try:
        segments = [s for s in snap["segments"] if int(s.get("device", dev)) == dev]
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{what}: a segment has a bad 'device' ({exc})") from None
    active_end, rec_reserved, rec_active, rec_allocated, rec_requested = _final_blocks(segments, what)
    block_sizes = "vramkit_device" in snap  # vramkit's entries carry block sizes, PyTorch's requests
    where = f"{what}: device_traces[{dev}]"

    # Pass 1: the first entry naming each address. An address first seen freed was allocated
    # before the trace began.
    first: dict[int, int] = {}
    i = -1
    try:
        for i, e in enumerate(entries):
            if e["action"] in _MEM_ACTIONS:
                first.setdefault(int(e["addr"]), i)
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}[{i}]: malformed entry ({type(exc).__name__}: {exc}); alloc and free "
                               "entries need 'action', 'addr' and 'size'") from None

    # Attribution tables.
    modules: list[str] = []
    ops: list[str] = []
    mod_index: dict[str, int] = {}
    op_index: dict[str, int] = {}
    internal: dict[str, bool] = {}
    by_frames: dict[int, tuple[int, int]] = {}  # id(frames list) -> (module, op); pickles share lists
    keep_alive: list[Any] = []

    def attribute(frames: Any) -> tuple[int, int]:
        if not frames:
            return -1, -1
        key = id(frames)
        hit = by_frames.get(key)
        if hit is not None:
            return hit
        result = (-1, -1)
        for f in frames:
            if not isinstance(f, Mapping):
                continue
            filename = str(f.get("filename", ""))
            inside = internal.get(filename)
            if inside is None:
                inside = internal[filename] = _is_internal(filename)
            if not inside:
                m = f"{filename}:{f.get('line', 0)}"
                o = str(f.get("name", "?"))
                mi = mod_index.get(m)
                if mi is None:
                    mi = mod_index[m] = len(modules)
                    modules.append(m)
                oi = op_index.get(o)
                if oi is None:
                    oi = op_index[o] = len(ops)
                    ops.append(o)
                result = (mi, oi)
                break
        by_frames[key] = result
        keep_alive.append(frames)  # the id stays unique while the list lives
        return result

    kinds: list[int] = []
    ids: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    a_size: list[int] = []  # per id: the trace size
    a_stream: list[int] = []
    a_addr: list[int] = []
    a_module: list[int] = []
    a_op: list[int] = []
    a_known: list[int] = []  # per id: block size if known for sure, else -1

    def add_alloc(addr: int, size: int, stream: int, mod: int, op: int, known: int) -> int:
        nid = len(a_size)
        a_size.append(size)
        a_stream.append(stream)
        a_addr.append(addr)
        a_module.append(mod)
        a_op.append(op)
        a_known.append(known)
        kinds.append(ALLOC)
        ids.append(nid)
        sizes.append(size)
        streams.append(stream)
        return nid

    # Allocations alive before the trace, in address order.
    initial: list[tuple[int, int, int, int, int, int]] = []  # addr, size, stream, module, op, known
    for addr, i in first.items():
        e = entries[i]
        if e["action"] != "alloc":
            try:
                size = int(e["size"])
                stream = int(e.get("stream") or 0) & _MASK64
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{where}[{i}]: malformed entry ({type(exc).__name__}: {exc})") from None
            initial.append((addr, size, stream, -1, -1, size if block_sizes else -1))
    for addr, (bsize, req, stream, frames) in active_end.items():
        if addr in first:
            continue
        size = bsize if block_sizes or req <= 0 else req
        mod, op = attribute(frames)
        initial.append((addr, size, stream, mod, op, bsize))
    initial.sort()
    live: dict[int, int] = {}
    for addr, size, stream, mod, op, known in initial:
        live[addr] = add_alloc(addr, size, stream, mod, op, known)
    num_initial = len(initial)

    # Pass 2: the events.
    pending: dict[int, int] = {}  # address -> entry index of a free_requested not yet completed
    reserved_delta = 0
    reserved_running: list[int] = [0]  # reserved bytes relative to the start, after each change
    ooms: list[dict[str, Any]] = []
    i = -1
    try:
        for i, e in enumerate(entries):
            action = e["action"]
            if action == "alloc":
                addr = int(e["addr"])
                if addr in live:
                    raise TraceFormatError(f"{where}[{i}]: alloc at address {addr:#x}, which holds a block not yet "
                                           "freed (no free_completed for it); entries contradict each other")
                size = int(e["size"])
                if size < 0:
                    raise ValueError(f"negative size {size}")
                mod, op = attribute(e.get("frames"))
                live[addr] = add_alloc(addr, size, int(e.get("stream") or 0) & _MASK64, mod, op,
                                       size if block_sizes else -1)
            elif action == "free_completed":
                addr = int(e["addr"])
                nid = live.pop(addr, None)
                if nid is None:
                    raise TraceFormatError(f"{where}[{i}]: free_completed at address {addr:#x}, where no block is "
                                           "allocated at that point; entries contradict each other")
                pending.pop(addr, None)
                kinds.append(FREE)
                ids.append(nid)
                sizes.append(a_size[nid])
                streams.append(a_stream[nid])
            elif action in _FREE_ACTIONS:  # free_requested
                addr = int(e["addr"])
                if addr not in live:
                    raise TraceFormatError(f"{where}[{i}]: {action} at address {addr:#x}, where no block is "
                                           "allocated at that point; entries contradict each other")
                pending[addr] = i
            elif action in _RESERVE:
                reserved_delta += _RESERVE[action] * int(e["size"])
                reserved_running.append(reserved_delta)
            elif action == "oom":
                ooms.append({"event": len(kinds), "size": int(e["size"]),
                             "device_free": int(e["device_free"]) if e.get("device_free") is not None else None})
            # "snapshot", annotations and actions of newer PyTorch versions make no events
    except TraceFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{where}[{i}]: malformed entry ({type(exc).__name__}: {exc}); entries are dicts with "
                               "'action', and 'addr', 'size', 'stream' for alloc, free and segment actions") from None

    # Block sizes for the allocated curve: exact for blocks still live at the end.
    untraced_end = sum(1 for addr in active_end if addr in first and addr not in live)
    for addr, nid in live.items():
        blk = active_end.get(addr)
        if blk is not None:
            a_known[nid] = blk[0]
    estimates = 0
    rounded: list[int] = []
    for nid, known in enumerate(a_known):
        if known < 0:
            estimates += 1
            known = _round_up(a_size[nid])
        rounded.append(known)
    kind_arr = np.asarray(kinds, dtype=np.uint8)
    id_arr = np.asarray(ids, dtype=np.int64)
    # Every event is an ALLOC or a FREE; the initial ALLOCs only add, so the running sum's
    # maximum is the peak from the trace's start on.
    deltas = np.where(kind_arr == ALLOC, 1, -1) * np.asarray(rounded, dtype=np.int64)[id_arr]
    peak_allocated = max(0, int(np.cumsum(deltas).max())) if deltas.size else 0

    start_reserved = rec_reserved - reserved_delta
    peak_reserved = start_reserved + max(reserved_running)

    meta: dict[str, Any] = {
        "source": "torch-snapshot",
        "device": dev,
        "num_trace_entries": len(entries),
        "initial_allocations": num_initial,
        "unfinished_frees": len(pending),
        "untraced_end_blocks": untraced_end,
        "trace_sizes": "block" if block_sizes else "requested",
        "recorded_reserved": rec_reserved,
        "recorded_allocated": rec_active,
        "recorded_memory_allocated": rec_allocated,
        "recorded_requested": rec_requested,
        "recorded_peak_reserved": peak_reserved,
        "recorded_peak_allocated": peak_allocated,
        "allocated_size_estimates": estimates,
        "recorded_ooms": ooms,
    }
    if estimates:
        meta["recorded_peak_allocated_note"] = (
            f"{estimates} allocation(s) freed before the snapshot are counted at their request rounded up to "
            "512 bytes, as PyTorch rounds it: the trace records requested sizes, not block sizes")
    if "vramkit_device" in snap:
        meta["recorded_on"] = str(snap["vramkit_device"])

    unknown = CATEGORIES.index("unknown")
    return Trace.from_columns(
        kind=kind_arr, id=id_arr, size=np.asarray(sizes, dtype=np.uint64),
        stream=np.asarray(streams, dtype=np.uint64),
        alloc_dtype=np.full(len(a_size), -1, np.int16), alloc_category=np.full(len(a_size), unknown, np.uint8),
        alloc_module=np.asarray(a_module, dtype=np.int32), alloc_op=np.asarray(a_op, dtype=np.int32),
        modules=modules, ops=ops, meta=meta)
