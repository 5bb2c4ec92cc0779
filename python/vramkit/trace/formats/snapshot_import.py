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
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from ..._core.plain_pickle import UnsafePickleError, loads_plain
from .file_format import ALLOC, CATEGORIES, FREE, MAGIC, Trace, TraceFormatError, describe_value

__all__ = ["from_torch_snapshot", "read_snapshot_file"]

_KMIN_BLOCK = 512  # PyTorch's kMinBlockSize: every request is rounded up to a multiple of it
_ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
_FREE_ACTIONS = ("free_requested", "free", "free_completed")  # "free": pre-2.1 name of free_requested
_MEM_ACTIONS = ("alloc", *_FREE_ACTIONS)
_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_CPP_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")
_MASK64 = (1 << 64) - 1
_SIZE_LIMIT = 1 << 62  # as Trace.validate: no size reaches 2**62 bytes
_EXPECTED = ("a dict from torch.cuda.memory._snapshot() or vramkit.memory_snapshot() with keys 'segments' and "
             "'device_traces'")
_FROM_FILE = ("expected a file written by torch.cuda.memory._dump_snapshot() or vramkit.dump_snapshot()")


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


# ---------------------------------------------------------------------------------- strict fields
# A snapshot from a file is anyone's data: every field is checked for its type and range before
# it is used, so a malformed one is a TraceFormatError naming where it is, never a TypeError or
# OverflowError from deep inside (and never str() of an arbitrary object, which a pickle of
# shared references can make enormous).


def _bad(where: str, key: str, value: Any, wanted: str) -> NoReturn:
    raise TraceFormatError(f"{where}: {key!r} is {describe_value(value)}; expected {wanted}")


def _uint(d: Mapping[str, Any], key: str, where: str, default: Any = None, *, limit: int = _SIZE_LIMIT) -> int:
    """d[key] as an int in [0, limit); `default` when absent or None (required if default is None)."""
    v = d.get(key)
    if v is None:
        if default is None:
            raise TraceFormatError(f"{where}: missing {key!r}")
        return int(default)
    if type(v) is not int or not 0 <= v < limit:
        _bad(where, key, v, f"an integer from 0 to {limit - 1:,}")
    return v


def _stream(d: Mapping[str, Any], where: str) -> int:
    """A cudaStream_t as an unsigned 64-bit value (0, the default stream, when absent)."""
    v = d.get("stream")
    if v is None:
        return 0
    if type(v) is not int or not -(1 << 63) <= v <= _MASK64:
        _bad(where, "stream", v, "a 64-bit integer (a cudaStream_t)")
    return v & _MASK64


def _mapping(v: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise TraceFormatError(f"{where}: {what} is {describe_value(v)}; expected a dict")
    return v


def _sequence(v: Any, where: str, what: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, (list, tuple)):
        raise TraceFormatError(f"{where}: {what} is {describe_value(v)}; expected a list")
    return v


# ---------------------------------------------------------------------------------- reading


def read_snapshot_file(path: str | os.PathLike[str]) -> tuple[Mapping[str, Any], int]:
    """The snapshot dict in the pickle at `path`, read without running code from it, and the
    file's size. Raises OSError as Python does for a path that cannot be read, and
    ``TraceFormatError`` for anything but a plain-data pickle."""
    path = os.fspath(path)
    with open(path, "rb") as f:  # FileNotFoundError, IsADirectoryError, ... as Python raises them
        data = f.read()
    if data[:len(MAGIC)] == MAGIC:
        raise TraceFormatError(f"{path}: is a .vktrace file, not a snapshot pickle; read it with "
                               "vramkit.trace.load() (or `vramkit replay` without --device)")
    try:
        obj = loads_plain(data)
    except UnsafePickleError as exc:
        raise TraceFormatError(f"{path}: {exc}") from None
    except MemoryError:
        # CPython's unpickler allocates a bytes object of the length an opcode declares before
        # reading it, so 10 bytes can ask for an exabyte: malformed, or truly too large here.
        raise TraceFormatError(f"{path}: unpickling these {len(data):,} bytes asks for more memory than this "
                               "machine can give: a malformed pickle (an object declared far larger than the "
                               "file), or a snapshot too large to read here") from None
    except Exception as exc:  # truncated (EOFError, UnpicklingError), garbage, persistent ids, ...
        raise TraceFormatError(f"{path}: not a readable pickle ({type(exc).__name__}: {_short(exc)}); "
                               f"{_FROM_FILE}") from None
    return obj, len(data)


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def _load(snapshot: Any) -> tuple[Mapping[str, Any], str, int | None]:
    """The snapshot dict, a name for messages, and the work budget: for a file, its size in
    bytes bounds how many blocks and entries it can hold (each costs at least a byte), so a
    small file of shared references cannot make the import walk billions of them."""
    budget = None
    if isinstance(snapshot, (str, os.PathLike)):
        what = os.fspath(snapshot)
        obj, budget = read_snapshot_file(what)
    elif isinstance(snapshot, Mapping):
        obj, what = snapshot, "snapshot"
    else:
        raise TypeError(f"snapshot must be {_EXPECTED}, or the path of a pickle of one; got "
                        f"{type(snapshot).__name__}")
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"{what}: holds {describe_value(obj)}, expected {_EXPECTED}")
    missing = [k for k in ("segments", "device_traces") if k not in obj]
    if missing:
        keys = sorted(k if len(k) <= 40 else k[:40] + "..." for k in obj if isinstance(k, str))[:8]
        raise TraceFormatError(f"{what}: missing {' and '.join(repr(k) for k in missing)}; expected {_EXPECTED} "
                               f"(it has {keys})")
    if not isinstance(obj["device_traces"], (list, tuple)) or not all(
            isinstance(t, (list, tuple)) for t in obj["device_traces"]):
        raise TraceFormatError(f"{what}: 'device_traces' must be a list with one list of trace entries per device")
    if not isinstance(obj["segments"], (list, tuple)) or not all(isinstance(s, Mapping) for s in obj["segments"]):
        raise TraceFormatError(f"{what}: 'segments' must be a list of segment dicts")
    recorded_on = obj.get("vramkit_device")
    if recorded_on is not None and (not isinstance(recorded_on, str) or len(recorded_on) > 64):
        _bad(what, "vramkit_device", recorded_on, "a device name such as 'cpu' or 'cuda:0'")
    return obj, what, budget


def _pick_device(snap: Mapping[str, Any], device: Any, what: str) -> int:
    traces = snap["device_traces"]
    n = len(traces)
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise ValueError(f"device must be an index into device_traces (an int) or None, got {device!r}")
        index = int(device)
        if not 0 <= index < n:
            valid = f"0..{n - 1}" if n else "none: it has no device traces"
            raise ValueError(f"device {index} is out of range for {what}: valid devices are {valid}")
        return index
    busy = [i for i, t in enumerate(traces) if len(t)]
    if len(busy) == 1:
        return busy[0]
    if len(busy) > 1:
        raise TraceFormatError(f"{what}: devices {busy} all have trace entries; pass device= one of them")
    if n == 0:
        raise TraceFormatError(f"{what}: 'device_traces' is empty (no device); record with "
                               "torch.cuda.memory._record_memory_history() before taking the snapshot")
    with_segments = sorted({_uint(s, "device", f"{what}: segment {i}", 0, limit=1 << 31)
                            for i, s in enumerate(snap["segments"])})
    return with_segments[0] if len(with_segments) == 1 and with_segments[0] < n else 0


def _final_blocks(segments: list[Mapping[str, Any]], what: str,
                  budget: int | None) -> tuple[dict[int, tuple[Any, ...]], int, int, int, int]:
    """address -> (size, requested_size, stream, frames) of the active blocks, and the totals:
    reserved, active bytes, allocated (not awaiting free) bytes, requested bytes."""
    active: dict[int, tuple[Any, ...]] = {}
    reserved = act = allocated = requested = 0
    visited = 0
    for si, seg in enumerate(segments):
        where = f"{what}: segment {si}"
        reserved += _uint(seg, "total_size", where)
        addr = _uint(seg, "address", where, 0, limit=1 << 64)
        stream = _stream(seg, where)
        blocks = _sequence(seg.get("blocks") or (), where, "'blocks'")
        visited += len(blocks)
        if budget is not None and visited > budget:
            raise TraceFormatError(f"{what}: its segments list more blocks than a file of {budget:,} bytes can hold "
                                   "(the same objects referenced over and over); refusing")
        for bi, b in enumerate(blocks):
            bwhere = f"{where}, block {bi}"
            b = _mapping(b, bwhere, "the block")
            size = _uint(b, "size", bwhere)
            if "address" in b:
                addr = _uint(b, "address", bwhere, limit=1 << 64)
            state = b.get("state")
            if not isinstance(state, str):
                _bad(bwhere, "state", state, "a string such as 'active_allocated' or 'inactive'")
            if state in _ACTIVE_STATES:
                req = _uint(b, "requested_size", bwhere, 0)
                active[addr] = (size, req, stream, b.get("frames"))
                act += size
                requested += req
                if state == "active_allocated":
                    allocated += size
            addr += size
    return active, reserved, act, allocated, requested


def from_torch_snapshot(snapshot: Any, device: int | None = None) -> Trace:
    """One device's allocation trace from a PyTorch memory snapshot, as a ``Trace``.

    snapshot: the dict ``torch.cuda.memory._snapshot()`` (or ``vramkit.memory_snapshot()``)
    returns, or the path (str or PathLike) of a pickle of one, as written by
    ``torch.cuda.memory._dump_snapshot()`` or ``vramkit.dump_snapshot()``. A file is read as
    plain data only: a pickle that names any class or function (the way a pickle runs code)
    is refused, nothing in it is called.

    device: the index into ``device_traces``; None picks the only device with trace entries.

    Raises FileNotFoundError (and other OSErrors) for a path that cannot be read;
    ``TraceFormatError`` for content that is not a snapshot (an unreadable, truncated or unsafe
    pickle, a .vktrace file, not a dict, no 'segments'/'device_traces', malformed entries or
    entries that contradict each other), and for several devices with entries and
    device=None; ValueError for a device out of range; TypeError for an argument that is
    neither a dict nor a path. See the module docstring for what maps to what and for ``meta``.
    """
    snap, what, budget = _load(snapshot)
    dev = _pick_device(snap, device, what)
    entries = snap["device_traces"][dev]
    segments = [s for i, s in enumerate(snap["segments"])
                if _uint(s, "device", f"{what}: segment {i}", dev, limit=1 << 31) == dev]
    active_end, rec_reserved, rec_active, rec_allocated, rec_requested = _final_blocks(segments, what, budget)
    block_sizes = "vramkit_device" in snap  # vramkit's entries carry block sizes, PyTorch's requests
    where = f"{what}: device_traces[{dev}]"

    # Pass 1: check every entry's shape and take the first entry naming each address. An
    # address first seen freed was allocated before the trace began.
    first: dict[int, int] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            raise TraceFormatError(f"{where}[{i}]: malformed entry ({describe_value(e)}); entries are dicts with "
                                   "'action', and 'addr', 'size', 'stream' for alloc, free and segment actions")
        action = e.get("action")
        if not isinstance(action, str):
            raise TraceFormatError(f"{where}[{i}]: malformed entry ('action' is {describe_value(action)}); alloc and "
                                   "free entries need 'action', 'addr' and 'size'")
        if action in _MEM_ACTIONS:
            ewhere = f"{where}[{i}]: malformed entry"
            _uint(e, "size", ewhere)
            _stream(e, ewhere)
            first.setdefault(_uint(e, "addr", ewhere, limit=1 << 64), i)
        elif action in _RESERVE:
            _uint(e, "size", f"{where}[{i}]: malformed entry")
        elif action == "oom":
            _uint(e, "size", f"{where}[{i}]: malformed entry")
            if e.get("device_free") is not None:
                _uint(e, "device_free", f"{where}[{i}]: malformed entry", limit=1 << 64)

    # Attribution tables.
    modules: list[str] = []
    ops: list[str] = []
    mod_index: dict[str, int] = {}
    op_index: dict[str, int] = {}
    internal: dict[str, bool] = {}
    by_frames: dict[int, tuple[int, int]] = {}  # id(frames list) -> (module, op); pickles share lists
    keep_alive: list[Any] = []

    def attribute(frames: Any, at: str) -> tuple[int, int]:
        if not frames:
            return -1, -1
        key = id(frames)
        hit = by_frames.get(key)
        if hit is not None:
            return hit
        result = (-1, -1)
        for f in _sequence(frames, at, "'frames'"):
            if not isinstance(f, Mapping):
                continue
            filename = f.get("filename", "")
            if not isinstance(filename, str):
                _bad(at, "filename", filename, "a string")
            inside = internal.get(filename)
            if inside is None:
                inside = internal[filename] = _is_internal(filename)
            if not inside:
                name = f.get("name", "?")
                if not isinstance(name, str):
                    _bad(at, "name", name, "a string (the function's name)")
                m = f"{filename}:{_uint(f, 'line', at, 0, limit=1 << 31)}"
                mi = mod_index.get(m)
                if mi is None:
                    mi = mod_index[m] = len(modules)
                    modules.append(m)
                oi = op_index.get(name)
                if oi is None:
                    oi = op_index[name] = len(ops)
                    ops.append(name)
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
            size, stream = e["size"], e.get("stream") or 0
            initial.append((addr, size, stream & _MASK64, -1, -1, size if block_sizes else -1))
    for addr, (bsize, req, stream, frames) in active_end.items():
        if addr in first:
            continue
        size = bsize if block_sizes or req <= 0 else req
        mod, op = attribute(frames, f"{what}: the frames of the block at {addr:#x}")
        initial.append((addr, size, stream, mod, op, bsize))
    initial.sort()
    live: dict[int, int] = {}
    for addr, size, stream, mod, op, known in initial:
        live[addr] = add_alloc(addr, size, stream, mod, op, known)
    num_initial = len(initial)

    # Pass 2: the events (every field used here was checked in pass 1).
    pending: dict[int, int] = {}  # address -> entry index of a free_requested not yet completed
    reserved_delta = 0
    reserved_running: list[int] = [0]  # reserved bytes relative to the start, after each change
    ooms: list[dict[str, Any]] = []
    for i, e in enumerate(entries):
        action = e["action"]
        if action == "alloc":
            addr = e["addr"]
            if addr in live:
                raise TraceFormatError(f"{where}[{i}]: alloc at address {addr:#x}, which holds a block not yet "
                                       "freed (no free_completed for it); entries contradict each other")
            size = e["size"]
            mod, op = attribute(e.get("frames"), f"{where}[{i}]: malformed entry")
            live[addr] = add_alloc(addr, size, (e.get("stream") or 0) & _MASK64, mod, op,
                                   size if block_sizes else -1)
        elif action == "free_completed":
            addr = e["addr"]
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
            addr = e["addr"]
            if addr not in live:
                raise TraceFormatError(f"{where}[{i}]: {action} at address {addr:#x}, where no block is "
                                       "allocated at that point; entries contradict each other")
            pending[addr] = i
        elif action in _RESERVE:
            reserved_delta += _RESERVE[action] * e["size"]
            reserved_running.append(reserved_delta)
        elif action == "oom":
            ooms.append({"event": len(kinds), "size": e["size"], "device_free": e.get("device_free")})
        # "snapshot", annotations and actions of newer PyTorch versions make no events

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
