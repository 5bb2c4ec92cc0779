"""Read a snapshot pickle or a ``.vktrace`` into a ``History``, and keep its summary in a cache.

A snapshot pickle is read by C (csrc/view/): checked opcode by opcode as plain data (no class,
no call: vram_plain_pickle_check), run into a compact tree, then into columns; no Python object
is made per event. The file is mapped, not read. The summary (the columns, the running total,
each grouping's checkpoints) is written beside the file as ``FILE.vkview`` (or under
``~/.cache/vramkit/view/`` when that directory is not writable) and used again while the file's
size and modification time are unchanged, so opening it again takes a mapping, not a replay.

The cache is read as untrusted too: a fixed header, a JSON table of arrays with their dtype,
offset and length, each checked against the file's size and against each other before use.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from typing import Any

import numpy as np

from .. import _C
from ..trace.formats.file_format import CATEGORIES, MAGIC, TraceFormatError
from ..trace.formats.snapshot_import import _is_internal
from .history import EVERY, NO_TIME, TOP_GROUPS, Grouping, History

__all__ = ["load_history", "cache_path", "CACHE_VERSION"]

CACHE_MAGIC = b"VKVIEW\x00\x01"
CACHE_VERSION = 1
_HEADER_LIMIT = 64 << 20
_COLUMNS = ("ev_kind", "ev_id", "ev_time", "a_size", "a_addr", "a_stream", "a_stack", "stack_start", "stack_frames",
            "f_file", "f_name", "f_line", "se_event", "se_addr", "se_size", "se_stream", "se_sign", "oom_event",
            "oom_size", "oom_free", "oom_time", "fs_addr", "fs_size", "fs_stream", "live")
_DTYPES = {"B": np.uint8, "b": np.int8, "I": np.uint32, "i": np.int32, "q": np.int64, "Q": np.uint64}
_CHAR = {np.dtype(t): c for c, t in _DTYPES.items()}  # NumPy's own char for uint64 is 'L' on Linux


def load_history(path: str | os.PathLike[str], device: int | None = None, cache: bool = True) -> History:
    """The history in `path` (a snapshot pickle of any protocol, or a ``.vktrace``), its summary
    taken from the cache when it is current. device: an index into the snapshot's
    ``device_traces`` (None: the only one with entries). Raises OSError for a file that cannot
    be read and ``TraceFormatError`` for one that is not a snapshot or trace."""
    path = os.fspath(path)
    st = os.stat(path)
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "device": device, "version": CACHE_VERSION}
    where = cache_path(path) if cache else None
    if where and os.path.exists(where):
        try:
            return _read_cache(where, key, path)
        except (TraceFormatError, OSError, ValueError):
            pass  # stale, damaged or from another version: summarize again
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
        if head == MAGIC:
            hist = _from_trace(path)
        else:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else _Empty() as data:
                hist = _from_snapshot(path, data, device)
    hist.derive()
    if where:
        try:
            _write_cache(where, key, hist)
        except OSError:
            pass  # a cache is a convenience: a read-only disk still gets its view
    return hist


class _Empty(bytes):
    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: Any) -> None:
        return None


def cache_path(path: str) -> str:
    """FILE.vkview beside the file when its directory is writable, else under ~/.cache/vramkit/view."""
    full = os.path.abspath(path)
    directory = os.path.dirname(full)
    if os.access(directory, os.W_OK):
        return full + ".vkview"
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(full.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(home, "vramkit", "view", f"{digest}.vkview")


# ---------------------------------------------------------------------------------- sources


def _from_snapshot(path: str, data: Any, device: int | None) -> History:
    try:
        got = _C.view_read_snapshot(data, -1 if device is None else int(device))
    except ValueError as exc:
        text = str(exc)
        if text.startswith("device "):
            raise
        raise TraceFormatError(f"{path}: {text.replace('snapshot: ', '', 1)}") from None
    cols = {name: np.frombuffer(raw, _DTYPES[t]) for name, (t, raw) in got["columns"].items()}
    start, blob = cols.pop("str_start"), cols.pop("str_data").tobytes()
    strings = [blob[int(a):int(b)].decode("utf-8", "replace") for a, b in zip(start[:-1], start[1:])]
    hist = History(file=path, device=f"device {got['device']}", strings=strings, groupings={},
                   segments_known=bool(len(cols["se_event"]) or len(cols["fs_addr"])), **cols)  # type: ignore[arg-type]
    hist.derive()  # the running total and each allocation's events, which the groupings rank by
    hist.groupings["site"] = _site_grouping(hist)
    return hist


def _from_trace(path: str) -> History:
    from ..trace.formats.reading import load

    trace = load(path)
    mem = np.isin(trace.kind, (0, 1))  # ALLOC, FREE; markers make no memory event
    kind, ids = trace.kind[mem].astype(np.uint8), trace.id[mem].astype(np.uint32)
    n_alloc = len(trace.alloc_category)
    empty64 = np.zeros(0, np.uint64)
    a_size = np.zeros(n_alloc, np.uint64)
    a_size[ids[kind == 0]] = trace.size[mem][kind == 0]
    a_stream = np.zeros(n_alloc, np.uint64)
    a_stream[ids[kind == 0]] = trace.stream[mem][kind == 0]
    hist = History(
        file=path, device=str(trace.meta.get("device", "trace")), ev_kind=kind, ev_id=ids,
        ev_time=np.full(len(kind), NO_TIME, np.int64), a_size=a_size, a_addr=np.zeros(n_alloc, np.uint64),
        a_stream=a_stream, a_stack=np.full(n_alloc, -1, np.int32), stack_start=np.zeros(1, np.uint64),
        stack_frames=np.zeros(0, np.uint32), f_file=np.zeros(0, np.uint32), f_name=np.zeros(0, np.uint32),
        f_line=np.zeros(0, np.int64), strings=[], se_event=empty64, se_addr=empty64, se_size=empty64,
        se_stream=empty64, se_sign=np.zeros(0, np.int8), oom_event=empty64, oom_size=empty64,
        oom_free=np.zeros(0, np.int64), oom_time=np.zeros(0, np.int64), fs_addr=empty64, fs_size=empty64,
        fs_stream=empty64, groupings={}, segments_known=False)
    hist.derive()  # the running total and each allocation's events, which the groupings rank by
    hist.groupings["category"] = _top_grouping(hist, "category", list(CATEGORIES),
                                               trace.alloc_category.astype(np.int64))
    hist.groupings["module"] = _top_grouping(hist, "module", list(trace.modules), trace.alloc_module.astype(np.int64))
    return hist


def _site_grouping(hist: History) -> Grouping:
    """Each stack's innermost frame that is the user's, as 'file:line name'."""
    labels: list[str] = []
    index: dict[str, int] = {}
    internal = [_is_internal(s) for s in hist.strings]
    per_stack = np.full(max(len(hist.stack_start) - 1, 0), -1, np.int64)
    for s in range(len(per_stack)):
        for f in hist.stack_frames[int(hist.stack_start[s]):int(hist.stack_start[s + 1])]:
            if not internal[hist.f_file[f]]:
                label = f"{hist.strings[hist.f_file[f]]}:{hist.f_line[f]} {hist.strings[hist.f_name[f]]}"
                per_stack[s] = index.setdefault(label, len(index))
                if per_stack[s] == len(labels):
                    labels.append(label)
                break
    site = np.where(hist.a_stack >= 0, per_stack[np.maximum(hist.a_stack, 0)] if len(per_stack) else -1, -1)
    return _top_grouping(hist, "site", labels, site)


def _top_grouping(hist: History, name: str, labels: list[str], per_alloc: np.ndarray) -> Grouping:
    """The TOP_GROUPS labels holding the most at the peak (then the most bytes allocated); the rest 'other'."""
    n_labels = len(labels)
    known = np.where((per_alloc >= 0) & (per_alloc < n_labels), per_alloc, n_labels)
    score_total = np.bincount(known, weights=hist.a_size.astype(np.float64), minlength=n_labels + 1)[:n_labels]
    score_peak: np.ndarray = np.zeros(n_labels)
    if len(hist.ev_kind) and n_labels:
        peak_event = int(np.argmax(hist.live))
        alive = (hist.a_alloc_ev <= peak_event) & (hist.a_free_ev > peak_event)
        score_peak = np.bincount(known[alive], weights=hist.a_size[alive].astype(np.float64),
                                 minlength=n_labels + 1)[:n_labels]
    order = np.lexsort((-score_total, -score_peak))[:TOP_GROUPS]
    order = order[(score_total[order] > 0)]
    remap = np.full(n_labels + 1, len(order), np.int32)
    remap[order] = np.arange(len(order), dtype=np.int32)
    return Grouping(name, [labels[k] for k in order], remap[known].astype(np.int32))


# ---------------------------------------------------------------------------------- the cache


def _write_cache(where: str, key: dict[str, Any], hist: History) -> None:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    arrays: list[tuple[str, np.ndarray]] = [(name, np.ascontiguousarray(getattr(hist, name))) for name in _COLUMNS]
    groupings = []
    for g in hist.groupings.values():
        arrays += [(f"group:{g.name}", g.group), (f"ckpt:{g.name}", g.ckpt)]
        groupings.append({"name": g.name, "labels": g.labels})
    table: list[dict[str, Any]] = []
    offset = 0
    for name, arr in arrays:
        offset = -(-offset // 64) * 64
        table.append({"name": name, "dtype": _CHAR[arr.dtype],
                      "offset": offset, "count": len(arr)})
        offset += arr.nbytes
    header = json.dumps({"key": key, "file": hist.file, "device": hist.device, "strings": hist.strings,
                         "groupings": groupings, "segments_known": hist.segments_known,
                         "arrays": table}).encode()
    header += b" " * (-(len(CACHE_MAGIC) + 8 + len(header)) % 64)  # arrays start 64-byte aligned in the file
    tmp = f"{where}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(CACHE_MAGIC + struct.pack("<Q", len(header)) + header)
        base = f.tell()
        for (name, arr), entry in zip(arrays, table):
            f.seek(base + entry["offset"])
            f.write(arr.tobytes())
    os.replace(tmp, where)


def _read_cache(where: str, key: dict[str, Any], source: str) -> History:
    with open(where, "rb") as f:
        head = f.read(len(CACHE_MAGIC) + 8)
        if len(head) < len(CACHE_MAGIC) + 8 or head[:len(CACHE_MAGIC)] != CACHE_MAGIC:
            raise TraceFormatError(f"{where}: not a vramkit view cache")
        (length,) = struct.unpack("<Q", head[len(CACHE_MAGIC):])
        if length > _HEADER_LIMIT:
            raise TraceFormatError(f"{where}: header of {length:,} bytes is over the limit")
        header = json.loads(f.read(length))
        base = f.tell()
        size = os.fstat(f.fileno()).st_size
        if not isinstance(header, dict) or header.get("key") != key:
            raise TraceFormatError(f"{where}: summarizes another version of the file")
        data = np.memmap(f, dtype=np.uint8, mode="r") if size > base else np.zeros(0, np.uint8)
    arrays: dict[str, np.ndarray] = {}
    for entry in header["arrays"]:
        dtype = _DTYPES.get(entry.get("dtype"))
        offset, count, name = entry.get("offset"), entry.get("count"), entry.get("name")
        if dtype is None or type(offset) is not int or type(count) is not int or not isinstance(name, str) \
                or offset < 0 or count < 0 or base + offset + count * np.dtype(dtype).itemsize > size \
                or (base + offset) % np.dtype(dtype).itemsize:
            raise TraceFormatError(f"{where}: array entry {entry!r:.100} does not fit the file")
        start = base + offset
        arrays[name] = data[start:start + count * np.dtype(dtype).itemsize].view(dtype)
    strings = header["strings"]
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise TraceFormatError(f"{where}: strings must be a list of strings")
    groupings = {}
    for g in header["groupings"]:
        groupings[g["name"]] = Grouping(g["name"], [str(x) for x in g["labels"]], arrays[f"group:{g['name']}"],
                                        arrays[f"ckpt:{g['name']}"])
    hist = History(file=source, device=str(header["device"]), strings=strings, groupings=groupings,
                   segments_known=bool(header["segments_known"]),
                   **{n: arrays[n] for n in _COLUMNS})  # type: ignore[arg-type]
    _check(hist, where)
    return hist.derive()


def _check(h: History, where: str) -> None:
    """The invariants the queries rely on, so that a damaged cache is an error here, not later."""
    n, m = len(h.ev_kind), len(h.a_size)
    ns, nf, nstr = len(h.stack_start) - 1, len(h.f_file), len(h.strings)
    ok = (len(h.ev_id) == n == len(h.ev_time) == len(h.live) and len(h.a_addr) == m == len(h.a_stream) == len(h.a_stack)
          and (not n or (h.ev_kind.max() <= 1 and h.ev_id.max() < m)) and ns >= 0
          and (not m or (h.a_stack.min() >= -1 and h.a_stack.max() < ns))
          and (not len(h.stack_start) or (np.all(np.diff(h.stack_start.astype(np.int64)) >= 0)
                                          and h.stack_start[-1] == len(h.stack_frames)))
          and (not len(h.stack_frames) or h.stack_frames.max() < nf)
          and len(h.f_name) == nf == len(h.f_line) and (not nf or max(h.f_file.max(), h.f_name.max()) < nstr))
    for g in h.groupings.values():
        ok = ok and len(g.group) == m and (not m or (g.group.min() >= 0 and g.group.max() <= len(g.labels)))
        ok = ok and len(g.ckpt) == (n // EVERY + 1) * g.groups
    if not ok:
        raise TraceFormatError(f"{where}: the cached summary's columns do not agree with each other")
