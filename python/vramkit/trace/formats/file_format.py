"""The allocation trace: columns in memory (``Trace``) and on disk (``.vktrace``).

A trace is the ordered list of a program's storage allocations and frees, with markers for
phases (forward, backward, optimizer) and steps. Events are parallel NumPy columns; what
belongs to an allocation (its dtype, category, module path, op) is a per-allocation table
indexed by the allocation's id, so each event costs 17 bytes.

File format, version 1 (little-endian)::

    offset 0   8 bytes   magic b"VKTRACE\\0"
    offset 8   uint32    format version (1)
    offset 12  uint32    H: length of the JSON header
    offset 16  H bytes   JSON header (UTF-8): {"meta", "strings", "columns", "payload_bytes",
                         "payload_crc32"}; each column is {"name", "dtype" (NumPy str),
                         "length", "offset"} with offsets relative to the payload start
    16 + H     payload   the columns' raw bytes, each starting on an 8-byte boundary

A reader checks the magic, the version, that the file is exactly 16 + H + payload_bytes long
and the payload's CRC-32, so a truncated or altered file is refused, never half read. Files
are written to a temporary name and renamed, so a failed write leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, NoReturn, Sequence

import numpy as np

from ..._core.files import write_atomically

__all__ = [
    "ALLOC", "CATEGORIES", "FREE", "FORMAT_VERSION", "PHASE", "PHASES", "STEP", "SYNC", "Trace", "TraceFormatError",
    "USE",
]

MAGIC = b"VKTRACE\0"
FORMAT_VERSION = 1

# Event kinds (the `kind` column). The C replay treats PHASE and STEP as markers.
# USE: the live allocation `id` is used on the event's `stream` (Tensor.record_stream), so its
# FREE returns the block to its own stream's pool only once that stream has been synchronized.
# SYNC: the event's `stream` is synchronized (`id` -1: every stream), completing those waits.
# (Added after the first files were written; a file without them reads the same.)
ALLOC, FREE, PHASE, STEP, USE, SYNC = 0, 1, 2, 3, 4, 5
KIND_NAMES = ("alloc", "free", "phase", "step", "use", "sync")
# Phase markers carry the phase's index in PHASES as their id; step markers the step number.
PHASES = ("setup", "forward", "backward", "optimizer", "other")
# What an allocation holds, as far as the capture can tell (the breakdown at the peak).
# "host": made on the capture device but kept in host memory on a GPU run (an Adam `step`
# counter); a GPU prediction leaves it out. "workspace": a GPU-only line item (cuBLAS).
# "deferred": made by the script itself on meta before `Module.to_empty` gave the model its real
# storage (FSDP2's shard-then-allocate recipe); a real run holds no memory for it, and a GPU
# prediction leaves it out. Appended last, so files written before it read the same.
# Sharded training (appended likewise): "unsharded_parameter", FSDP's gathered parameters (the
# all-gather outputs it frees and re-creates with UntypedStorage.resize_); "communication", the
# buffers FSDP allocates for its collectives (all-gather copy-in and outputs, reduce-scatter);
# "ddp_bucket", DDP's flat gradient buckets, a second copy of the gradients (unless
# gradient_as_bucket_view=True makes the gradients views of them: then they are "gradient").
CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "buffer",
              "workspace", "host", "unknown", "deferred", "unsharded_parameter", "communication", "ddp_bucket")

_EVENT_COLUMNS = {"kind": np.uint8, "id": np.int64, "size": np.uint64, "stream": np.uint64}
_ALLOC_COLUMNS = {"alloc_dtype": np.int16, "alloc_category": np.uint8, "alloc_module": np.int32,
                  "alloc_op": np.int32}
_STRING_TABLES = ("dtypes", "modules", "ops")
# The exact little-endian dtype of each column on disk (what save writes, all a reader accepts).
_COLUMN_DTYPES = {name: np.dtype(t).newbyteorder("<") for name, t in {**_EVENT_COLUMNS, **_ALLOC_COLUMNS}.items()}
_PREFIX = 16  # magic, version, header length
# Step markers carry the step number; phases their index in PHASES. A step number beyond this
# is not a count of training steps but a corrupt file (and would size arrays by it).
MAX_STEP = (1 << 31) - 1
# meta is free-form JSON, but the keys vramkit itself reads back must have the right type.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "source": (str,), "recorded_on": (str,), "form": (str,), "first_return": (str,), "trace_sizes": (str,),
    "checkpointed_blocks": (str,), "recorded_peak_allocated_note": (str,), "device": (int, str),
    **{k: (int,) for k in ("batch_size", "checkpointed_count", "recorded_reserved", "recorded_allocated",
                           "recorded_memory_allocated", "recorded_requested", "recorded_peak_reserved",
                           "recorded_peak_allocated", "allocated_size_estimates", "num_trace_entries",
                           "initial_allocations", "unfinished_frees", "untraced_end_blocks")},
}


class TraceFormatError(ValueError):
    """A trace (file or columns) that vramkit cannot read: wrong magic, another format version,
    truncated, corrupted, or columns that contradict each other."""


def describe_value(value: Any) -> str:
    """A short description of a value read from a file, for error messages: never the whole
    value (a string or list from a file can be huge, and str() of a large int can fail)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return f"{value}" if abs(value) < 10 ** 30 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value):,} characters"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value):,} entries"
    return f"a {type(value).__name__}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_header(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON header, checked field by field against the format (module docstring):
    ``TraceFormatError`` names the field and the header's place in the file."""
    at = f"{what}: header (file offset {_PREFIX}, {len(raw):,} bytes)"
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{at}: not UTF-8 at file offset {_PREFIX + exc.start:,}") from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{at}: not JSON: {exc.msg} at file offset {_PREFIX + exc.pos:,}") from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity, an integer of thousands of digits, deep nesting
        raise TraceFormatError(f"{at}: unreadable JSON ({type(exc).__name__}: {str(exc)[:120]})") from None

    def bad(field_: str, value: Any, wanted: str) -> NoReturn:
        raise TraceFormatError(f"{at}: {field_} is {describe_value(value)}; expected {wanted}")

    def integer(field_: str, value: Any, limit: int) -> int:
        if type(value) is not int or not 0 <= value < limit:
            bad(field_, value, f"an integer from 0 to {limit - 1:,}")
        return value

    if not isinstance(header, dict):
        bad("the header", header, "a JSON object")
    for key in ("payload_bytes", "payload_crc32", "columns", "strings"):
        if key not in header:
            raise TraceFormatError(f"{at}: missing field {key!r}")
    payload_bytes = integer("'payload_bytes'", header["payload_bytes"], 1 << 62)
    crc = integer("'payload_crc32'", header["payload_crc32"], 1 << 32)
    meta = header.get("meta")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        bad("'meta'", meta, "a JSON object")
    for key, types in _META_TYPES.items():
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            bad(f"meta[{key!r}]", value, " or ".join(t.__name__ for t in types))
    strings = header["strings"]
    if not isinstance(strings, dict):
        bad("'strings'", strings, "a JSON object with lists 'dtypes', 'modules' and 'ops'")
    tables: dict[str, list[str]] = {}
    for key in _STRING_TABLES:
        table = strings.get(key, [])
        if not isinstance(table, list):
            bad(f"strings[{key!r}]", table, "a list of strings")
        for i, item in enumerate(table):
            if not isinstance(item, str):
                bad(f"strings[{key!r}][{i}]", item, "a string")
        tables[key] = table
    columns = header["columns"]
    if not isinstance(columns, list):
        bad("'columns'", columns, "a list of column objects")
    seen: set[str] = set()
    for i, spec in enumerate(columns):
        where = f"columns[{i}]"
        if not isinstance(spec, dict):
            bad(where, spec, 'an object {"name", "dtype", "length", "offset"}')
        name = spec.get("name")
        if not isinstance(name, str):
            bad(f"{where}.name", name, "a string")
        where = f"column {describe_value(name)} ({where})"
        if name in seen:
            raise TraceFormatError(f"{at}: {where} appears twice")
        seen.add(name)
        dtype = spec.get("dtype")
        wanted = _COLUMN_DTYPES.get(name)
        if wanted is not None and dtype != wanted.str:
            bad(f"{where} dtype", dtype, repr(wanted.str))
        if wanted is None and not isinstance(dtype, str):
            bad(f"{where} dtype", dtype, "a NumPy dtype string")
        offset = integer(f"{where} offset", spec.get("offset"), payload_bytes + 1)
        if offset % 8:
            raise TraceFormatError(f"{at}: {where} offset {offset} is not a multiple of 8 (columns are 8-byte aligned)")
        itemsize = wanted.itemsize if wanted is not None else 1
        length = integer(f"{where} length", spec.get("length"), (payload_bytes - offset) // itemsize + 1)
        del length  # bounded by the payload above: offset + length * itemsize <= payload_bytes
    missing = [name for name in _COLUMN_DTYPES if name not in seen]
    if missing:
        raise TraceFormatError(f"{at}: missing columns {missing}")
    return {"payload_bytes": payload_bytes, "payload_crc32": crc, "meta": meta, "strings": tables,
            "columns": columns}


@dataclass
class Trace:
    """An allocation trace.

    Event columns (length ``num_events``): ``kind`` (ALLOC, FREE, PHASE, STEP, USE, SYNC),
    ``id`` (the allocation id, from 0, each allocated at most once; for PHASE the phase index,
    for STEP the step number, for USE the allocation used, for SYNC -1 for every stream or 0),
    ``size`` (requested bytes of the allocation, on its ALLOC and FREE events), ``stream`` (the
    allocation's stream on ALLOC and FREE, the stream using it on USE, the stream synchronized
    on SYNC; 0, the default stream, unless the source had several streams).

    Allocation columns (length ``num_allocations``, indexed by id): ``alloc_dtype``,
    ``alloc_module`` and ``alloc_op`` index the string tables ``dtypes``, ``modules`` and ``ops``
    (-1: unknown); ``alloc_category`` indexes CATEGORIES.

    ``meta`` is free-form JSON-able information: where the trace came from, the device it was
    captured on, batch size, torch version, and the GPU-only line items added to it.
    """

    kind: np.ndarray
    id: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    alloc_dtype: np.ndarray
    alloc_category: np.ndarray
    alloc_module: np.ndarray
    alloc_op: np.ndarray
    dtypes: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_columns(cls, *, kind: Any, id: Any, size: Any, stream: Any = None, alloc_dtype: Any = None,
                     alloc_category: Any = None, alloc_module: Any = None, alloc_op: Any = None,
                     dtypes: Sequence[str] = (), modules: Sequence[str] = (), ops: Sequence[str] = (),
                     meta: Mapping[str, Any] | None = None) -> "Trace":
        """Build a trace from array-likes, filling absent allocation columns with "unknown",
        and check it (``TraceFormatError`` naming the first bad event)."""
        kind = np.ascontiguousarray(kind, dtype=np.uint8)
        n = len(kind)
        ids = np.ascontiguousarray(id, dtype=np.int64)
        size = np.ascontiguousarray(size, dtype=np.uint64)
        stream = np.zeros(n, np.uint64) if stream is None else np.ascontiguousarray(stream, dtype=np.uint64)
        is_alloc = kind == ALLOC
        num = int(ids[is_alloc].max()) + 1 if is_alloc.any() else 0
        if num > int(is_alloc.sum()):  # checked before the tables below are sized by it
            raise TraceFormatError(f"allocation ids must be dense from 0: the largest is {num - 1}, but there are only "
                                   f"{int(is_alloc.sum())} ALLOC events")

        def table(values: Any, dtype: Any, fill: int) -> np.ndarray:
            if values is None:
                return np.full(num, fill, dtype=dtype)
            return np.ascontiguousarray(values, dtype=dtype)

        t = cls(kind=kind, id=ids, size=size, stream=stream,
                alloc_dtype=table(alloc_dtype, np.int16, -1),
                alloc_category=table(alloc_category, np.uint8, CATEGORIES.index("unknown")),
                alloc_module=table(alloc_module, np.int32, -1), alloc_op=table(alloc_op, np.int32, -1),
                dtypes=list(dtypes), modules=list(modules), ops=list(ops), meta=dict(meta or {}))
        t.validate()
        return t

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Check that the columns agree: equal lengths, known kinds, every allocation id used by
        exactly one ALLOC, every FREE after its ALLOC and at most once, table indexes in range.
        Raises ``TraceFormatError`` naming the first violation."""
        n = len(self.kind)
        for name in _EVENT_COLUMNS:
            col = getattr(self, name)
            if col.ndim != 1 or len(col) != n:
                raise TraceFormatError(f"column {name!r} has {len(col)} entries; the trace has {n} events")
        bad = np.flatnonzero(self.kind > SYNC)
        if bad.size:
            i = int(bad[0])
            raise TraceFormatError(f"event {i}: unknown kind {int(self.kind[i])} (allowed: 0 alloc, 1 free, "
                                   "2 phase, 3 step, 4 use, 5 sync)")
        num = self.num_allocations
        for name in _ALLOC_COLUMNS:
            col = getattr(self, name)
            if col.ndim != 1 or len(col) != num:
                raise TraceFormatError(f"column {name!r} has {len(col)} entries; the trace has {num} allocation "
                                       "ids (the largest allocated id + 1)")
        bad_phase = np.flatnonzero((self.kind == PHASE) & ((self.id < 0) | (self.id >= len(PHASES))))
        if bad_phase.size:
            i = int(bad_phase[0])
            raise TraceFormatError(f"event {i}: phase marker {int(self.id[i])} is not an index of PHASES "
                                   f"(0..{len(PHASES) - 1}: {', '.join(PHASES)})")
        bad_step = np.flatnonzero((self.kind == STEP) & ((self.id < 0) | (self.id > MAX_STEP)))
        if bad_step.size:
            i = int(bad_step[0])
            raise TraceFormatError(f"event {i}: step marker {int(self.id[i])} is not a step number (0..{MAX_STEP})")
        mem = self.kind <= FREE
        neg = np.flatnonzero(mem & (self.id < 0))
        if neg.size:
            i = int(neg[0])
            raise TraceFormatError(f"event {i}: negative allocation id {int(self.id[i])}")
        for which, mask in (("alloc", self.kind == ALLOC), ("free", self.kind == FREE)):
            idx = np.flatnonzero(mask)
            ids = self.id[idx]
            if which == "free" and ids.size and int(ids.max()) >= num:
                i = int(idx[np.argmax(ids >= num)])
                raise TraceFormatError(f"event {i}: free of id {int(self.id[i])}, which is never allocated")
            order = np.argsort(ids, kind="stable")
            dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
            if dup.size:
                i = int(idx[order[dup[0] + 1]])
                raise TraceFormatError(f"event {i}: second {which} of id {int(self.id[i])} (an id is allocated "
                                       "once and freed at most once)")
        bad_sync = np.flatnonzero((self.kind == SYNC) & ((self.id < -1) | (self.id > 0)))
        if bad_sync.size:
            i = int(bad_sync[0])
            raise TraceFormatError(f"event {i}: sync with id {int(self.id[i])} (allowed: -1, every stream; 0, the "
                                   "event's stream)")
        a, f = self.alloc_index, self.free_index
        uses = np.flatnonzero(self.kind == USE)
        if uses.size:  # a use names an allocation live at that event
            ids = self.id[uses]
            known = (ids >= 0) & (ids < num)
            safe = np.where(known, ids, 0)
            live = known & (a[safe] < uses) & ((f[safe] < 0) | (f[safe] > uses))
            if not live.all():
                i = int(uses[np.argmin(live)])
                raise TraceFormatError(f"event {i}: use of id {int(self.id[i])} on a stream, which is not a live "
                                       "allocation there")
        if num and (a < 0).any():
            i = int(np.flatnonzero(a < 0)[0])
            raise TraceFormatError(f"allocation id {i} is never allocated (ids must be dense from 0)")
        early = np.flatnonzero((f >= 0) & (f < a))
        if early.size:
            i = int(early[0])
            raise TraceFormatError(f"event {int(f[i])}: free of id {i} before its alloc at event {int(a[i])}")
        huge = np.flatnonzero(self.size >= np.uint64(1 << 62))
        if huge.size:
            i = int(huge[0])
            raise TraceFormatError(f"event {i}: size {int(self.size[i])} is not below 2**62")
        for name, table in (("alloc_dtype", self.dtypes), ("alloc_module", self.modules), ("alloc_op", self.ops)):
            col = getattr(self, name)
            if col.size and (int(col.min()) < -1 or int(col.max()) >= len(table)):
                raise TraceFormatError(f"column {name!r} indexes past its string table ({len(table)} entries)")
        if self.alloc_category.size and int(self.alloc_category.max()) >= len(CATEGORIES):
            raise TraceFormatError(f"column 'alloc_category' has a value past {len(CATEGORIES) - 1}")

    # ------------------------------------------------------------------ derived views

    @property
    def num_events(self) -> int:
        return len(self.kind)

    @property
    def num_allocations(self) -> int:
        mask = self.kind == ALLOC
        return int(self.id[mask].max()) + 1 if mask.any() else 0

    def live_at_end(self) -> np.ndarray:
        """Per allocation, whether it is still live after the last event (never freed)."""
        live = np.ones(self.num_allocations, bool)
        live[self.id[self.kind == FREE]] = False
        return live

    @property
    def alloc_index(self) -> np.ndarray:
        """Per allocation id, the index of its ALLOC event (-1 if none)."""
        out = np.full(self.num_allocations, -1, np.int64)
        idx = np.flatnonzero(self.kind == ALLOC)
        out[self.id[idx]] = idx
        return out

    @property
    def free_index(self) -> np.ndarray:
        """Per allocation id, the index of its FREE event (-1 if it is never freed)."""
        out = np.full(self.num_allocations, -1, np.int64)
        idx = np.flatnonzero(self.kind == FREE)
        ids = self.id[idx]
        ok = ids < len(out)
        out[ids[ok]] = idx[ok]
        return out

    @property
    def alloc_size(self) -> np.ndarray:
        """Per allocation id, its requested bytes."""
        out = np.zeros(self.num_allocations, np.uint64)
        idx = np.flatnonzero(self.kind == ALLOC)
        out[self.id[idx]] = self.size[idx]
        return out

    def live_after(self, event: int) -> np.ndarray:
        """Ids of the allocations live just after event index `event`."""
        a, f = self.alloc_index, self.free_index
        return np.flatnonzero((a <= event) & ((f < 0) | (f > event)))

    def phase_at(self) -> np.ndarray:
        """Per event, the index in PHASES of the phase it belongs to (setup before any marker)."""
        marks = self.kind == PHASE
        pos = np.where(marks, np.arange(self.num_events), -1)
        last = np.maximum.accumulate(pos) if self.num_events else pos
        return np.where(last >= 0, self.id[np.maximum(last, 0)], 0).astype(np.int64)

    def name_of(self, table: str, index: int) -> str:
        values = getattr(self, table)
        return values[index] if 0 <= index < len(values) else "?"

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the trace as a ``.vktrace`` file (see the module docstring); returns the path."""
        path = os.fspath(path)
        columns, chunks, offset = [], [], 0
        for name in (*_EVENT_COLUMNS, *_ALLOC_COLUMNS):
            dtype = _COLUMN_DTYPES[name]
            raw = np.ascontiguousarray(getattr(self, name)).astype(dtype, copy=False).tobytes()
            pad = (-offset) % 8
            chunks.append(b"\0" * pad)
            offset += pad
            columns.append({"name": name, "dtype": dtype.str, "length": len(raw) // dtype.itemsize, "offset": offset})
            chunks.append(raw)
            offset += len(raw)
        payload = b"".join(chunks)
        header = json.dumps({"meta": self.meta, "strings": {k: list(getattr(self, k)) for k in _STRING_TABLES},
                             "columns": columns, "payload_bytes": len(payload),
                             "payload_crc32": zlib.crc32(payload)}, separators=(",", ":"), allow_nan=False).encode()
        prefix = MAGIC + np.array([FORMAT_VERSION, len(header)], "<u4").tobytes()
        write_atomically(path, prefix + header + payload)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Trace":
        """Read a ``.vktrace`` file; ``TraceFormatError`` says what is wrong with a bad one."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()
        return cls.from_bytes(data, what=path)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "trace") -> "Trace":
        """Parse the bytes of a ``.vktrace`` file. Nothing in them is trusted: the prefix, every
        header field's type and range and every column's place in the payload are checked before
        anything is allocated for it (``TraceFormatError`` naming the field and where it is in the
        file), then ``validate`` checks that the columns agree, and the C replay checks again."""
        if len(data) < _PREFIX:
            raise TraceFormatError(f"{what}: {len(data)} bytes is too short for a .vktrace file (16-byte prefix)")
        if data[:8] != MAGIC:
            hint = " (it is a pickle: read a PyTorch snapshot with from_torch_snapshot)" if data[:1] == b"\x80" else ""
            raise TraceFormatError(f"{what}: not a .vktrace file (magic {bytes(data[:8])!r}, expected {MAGIC!r}){hint}")
        version, hlen = (int(v) for v in np.frombuffer(data[8:16], "<u4"))
        if version != FORMAT_VERSION:
            raise TraceFormatError(f"{what}: .vktrace format version {version} (file offset 8); this vramkit reads "
                                   f"version {FORMAT_VERSION}")
        if len(data) < _PREFIX + hlen:
            raise TraceFormatError(f"{what}: truncated: the header length at file offset 12 says {hlen:,} bytes, so "
                                   f"the file needs at least {_PREFIX + hlen:,}; it has {len(data):,}")
        header = _parse_header(bytes(data[_PREFIX:_PREFIX + hlen]), what)
        payload_bytes = header["payload_bytes"]
        expected = _PREFIX + hlen + payload_bytes
        if len(data) != expected:
            state = "truncated" if len(data) < expected else "has trailing bytes"
            raise TraceFormatError(f"{what}: {state}: the header says {payload_bytes:,} payload bytes after file "
                                   f"offset {_PREFIX + hlen:,}, so {expected:,} bytes in all; the file has {len(data):,}")
        payload = memoryview(data)[_PREFIX + hlen:]
        if zlib.crc32(payload) != header["payload_crc32"]:
            raise TraceFormatError(f"{what}: corrupted: the CRC-32 of the payload (file offset {_PREFIX + hlen:,}, "
                                   f"{payload_bytes:,} bytes) does not match the header")
        cols: dict[str, Any] = {}  # arrays, passed to the constructor by name with the string tables
        for spec in header["columns"]:
            name = spec["name"]
            wanted = _COLUMN_DTYPES.get(name)
            if wanted is None:
                continue  # a column this version does not know: its place was checked, its bytes are skipped
            start, end = spec["offset"], spec["offset"] + spec["length"] * wanted.itemsize
            cols[name] = np.frombuffer(payload[start:end], dtype=wanted).astype(wanted.newbyteorder("="))
        t = cls(**cols, **header["strings"], meta=header["meta"])
        t.validate()
        return t

    def __repr__(self) -> str:
        return (f"Trace({self.num_events:,} events, {self.num_allocations:,} allocations, "
                f"source={self.meta.get('source', '?')!r})")
