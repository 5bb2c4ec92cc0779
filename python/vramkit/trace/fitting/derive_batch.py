"""Batch-affine traces: a step's trace at one batch size computed from captures at two others.

For most training steps the batch size changes only the sizes of the allocations, never which
allocations happen, in what order, from which module and op: the same ops run on tensors with
a longer batch dimension. Then every event's size is affine in the batch size,
``size(b) = c0 + c1 * b`` with integer ``c0`` and ``c1`` (an activation of ``b x L x D``
floats is ``4 L D b`` bytes; a parameter ``c1 = 0``), and two captures determine the trace at
every other batch size exactly. ``BatchModel.from_traces`` checks that two captures differ in
nothing but sizes and that each size is affine with integer coefficients (``None`` otherwise;
``mismatch`` says why), and ``BatchModel.at(b)`` builds the trace a capture at ``b`` would.

Two captures always fit a line, so a model is only trusted after a third capture agrees with
it event for event (``first_difference``); ``fit`` does that, and captures again if not.
Batch size 1 is left out on both sides: a size-1 dimension can change the op path (a
``(1, L, D)`` tensor can be contiguous where ``(2, L, D)`` is not, so a copy disappears).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..formats.file_format import CATEGORIES, KIND_NAMES, Trace

__all__ = ["MIN_BATCH_SIZE", "BatchModel", "first_difference", "mismatch"]

# The smallest batch size a model is built from or derives (see the module docstring).
MIN_BATCH_SIZE = 2
_SIZE_LIMIT = 1 << 62  # a trace's sizes are below this (Trace.validate)
# Per-allocation columns: (column, what it holds, its string table or None for CATEGORIES).
_ALLOC_TABLES: tuple[tuple[str, str, str | None], ...] = (
    ("alloc_dtype", "dtype", "dtypes"), ("alloc_category", "category", None), ("alloc_module", "module", "modules"),
    ("alloc_op", "op", "ops"))
_EVENT_COLUMNS = ("kind", "id", "stream")


def _check_batch_size(name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < MIN_BATCH_SIZE:
        raise ValueError(f"{name} must be an integer >= {MIN_BATCH_SIZE}, got {value!r}: a batch of 1 can take "
                         "another op path (size-1 dimensions make some copies unnecessary), so it is never derived "
                         "nor used to derive")
    return int(value)


def _name(trace: Trace, table: str | None, value: int) -> str:
    if table is None:
        return CATEGORIES[value] if 0 <= value < len(CATEGORIES) else str(value)
    return repr(trace.name_of(table, value)) if value >= 0 else "unknown"


def _comparable_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` less what tells one capture from another of the same step: how many graphs
    ``torch.compile`` compiled during it (the first capture of a compiled step compiles, the
    next reuse its graphs)."""
    regions = meta.get("compiled_regions")
    if not isinstance(regions, list):
        return meta
    return {**meta, "compiled_regions": [{k: v for k, v in r.items() if k != "graphs"} if isinstance(r, dict) else r
                                         for r in regions]}


def _structure_difference(x: Trace, y: Trace, what_x: str, what_y: str) -> str | None:
    """The first difference between two traces other than their sizes and meta['batch_size'],
    in words, or None: event columns, per-allocation tables, string tables, meta."""
    if x.num_events != y.num_events:
        return f"{x.num_events:,} events {what_x}, {y.num_events:,} {what_y}"
    for column in _EVENT_COLUMNS:
        a, b = getattr(x, column), getattr(y, column)
        diff = np.flatnonzero(a != b)
        if diff.size:
            i = int(diff[0])
            if column == "kind":
                return (f"event {i}: {KIND_NAMES[int(a[i])]} {what_x}, {KIND_NAMES[int(b[i])]} {what_y} "
                        "(another allocation sequence)")
            return f"event {i}: {column} {int(a[i])} {what_x}, {int(b[i])} {what_y}"
    for table in ("dtypes", "modules", "ops"):
        if list(getattr(x, table)) != list(getattr(y, table)):
            return f"the string table {table!r} differs (another {table[:-1]} appears, or in another order)"
    for column, what, strings in _ALLOC_TABLES:
        a, b = getattr(x, column), getattr(y, column)
        if len(a) != len(b):
            return f"{len(a):,} allocations {what_x}, {len(b):,} {what_y}"
        diff = np.flatnonzero(a != b)
        if diff.size:
            i = int(diff[0])
            return (f"allocation {i}: {what} {_name(x, strings, int(a[i]))} {what_x}, "
                    f"{_name(y, strings, int(b[i]))} {what_y}")
    mx, my = _comparable_meta(x.meta), _comparable_meta(y.meta)
    for key in sorted((set(mx) | set(my)) - {"batch_size"}):
        if mx.get(key, ...) != my.get(key, ...):
            absent = "(absent)"
            return f"meta[{key!r}] is {mx.get(key, absent)!r} {what_x}, {my.get(key, absent)!r} {what_y}"
    if ("batch_size" in x.meta) != ("batch_size" in y.meta):
        return f"meta['batch_size'] is set {what_x if 'batch_size' in x.meta else what_y} only"
    return None


def _solve(trace_a: Trace, batch_a: int, trace_b: Trace, batch_b: int) -> tuple[np.ndarray, np.ndarray] | str:
    """(c0, c1) per event, or why there are none (see ``mismatch``)."""
    batch_a, batch_b = _check_batch_size("batch_a", batch_a), _check_batch_size("batch_b", batch_b)
    if batch_a == batch_b:
        raise ValueError(f"batch_a and batch_b must differ (both are {batch_a}): one batch size fixes no slope")
    for trace, batch, name in ((trace_a, batch_a, "trace_a"), (trace_b, batch_b, "trace_b")):
        if not isinstance(trace, Trace):
            raise TypeError(f"{name} must be a vramkit.trace.Trace, got {type(trace).__name__}")
        said = trace.meta.get("batch_size", batch)
        if said != batch:
            raise ValueError(f"{name}'s meta says batch size {said!r}, but it was given as batch size {batch}")
    at_a, at_b = f"at batch size {batch_a}", f"at batch size {batch_b}"
    why = _structure_difference(trace_a, trace_b, at_a, at_b)
    if why is not None:
        return why
    sa, sb = trace_a.size.astype(np.int64), trace_b.size.astype(np.int64)  # sizes < 2**62: exact
    step = batch_b - batch_a
    change = sb - sa
    # numpy's % takes the divisor's sign: 0 exactly when the change is a multiple of the step.
    off = np.flatnonzero(change % step)
    if off.size:
        i = int(off[0])
        return (f"event {i}: size {int(sa[i]):,} {at_a}, {int(sb[i]):,} {at_b}: a change of {abs(int(change[i])):,} "
                f"bytes over {abs(step)} samples is not a whole number of bytes per sample, so the size is not affine "
                "in the batch size")
    slope = change // step
    return sa - slope * batch_a, slope


def mismatch(trace_a: Trace, batch_a: int, trace_b: Trace, batch_b: int) -> str | None:
    """Why the two captures do not make a ``BatchModel``, in words (the first difference found:
    event kinds, ids or streams, per-allocation dtype/category/module/op, string tables, meta
    other than batch_size, or a size whose change is not a whole number of bytes per sample), or
    None when they do. ``ValueError`` for batch sizes below 2 or equal, or that contradict the
    traces' meta."""
    solved = _solve(trace_a, batch_a, trace_b, batch_b)
    return solved if isinstance(solved, str) else None


class BatchModel:
    """A trace whose sizes are ``c0 + c1 * batch_size``, from two captures (``from_traces``)."""

    def __init__(self, template: Trace, base: np.ndarray, slope: np.ndarray, batch_sizes: tuple[int, int]) -> None:
        if base.shape != (template.num_events,) or slope.shape != base.shape:
            raise ValueError(f"base and slope must have one entry per event ({template.num_events:,}), got "
                             f"{base.shape} and {slope.shape}")
        self._template = template
        self.base = base.astype(np.int64)  # c0 per event
        self.slope = slope.astype(np.int64)  # c1 per event: bytes per sample
        self.batch_sizes = batch_sizes  # the two captures it was made from

    @classmethod
    def from_traces(cls, trace_a: Trace, batch_a: int, trace_b: Trace, batch_b: int) -> BatchModel | None:
        """The model through two captures of the same step at batch sizes `batch_a` and
        `batch_b` (both >= 2), or None when they differ in anything but sizes, or a size is not
        affine with integer coefficients (``mismatch`` says which). Two captures always fit a
        line: check the model against a third capture before trusting it. The model keeps
        `trace_a` (not a copy) for the columns that do not change."""
        solved = _solve(trace_a, batch_a, trace_b, batch_b)
        if isinstance(solved, str):
            return None
        base, slope = solved
        return cls(trace_a, base, slope, (batch_a, batch_b))

    def sizes_at(self, batch_size: int) -> np.ndarray:
        """The size column (uint64) at `batch_size`. ``ValueError`` when a size would be negative
        or reach 2**62 there (no capture makes such a trace)."""
        b = _check_batch_size("batch_size", batch_size)
        # Bounds in Python integers first: within them the int64 arithmetic below cannot overflow.
        high = int(self.base.max(initial=0)) + max(int(self.slope.max(initial=0)) * b, 0)
        low = int(self.base.min(initial=0)) + min(int(self.slope.min(initial=0)) * b, 0)
        sizes = self.base + self.slope * b if high < _SIZE_LIMIT and low > -_SIZE_LIMIT else None
        if sizes is None or int(sizes.max(initial=0)) >= _SIZE_LIMIT:
            raise ValueError(f"at batch size {b} an allocation of the trace derived from batch sizes "
                             f"{self.batch_sizes[0]} and {self.batch_sizes[1]} would reach 2**62 bytes; no trace "
                             "holds such a size")
        negative = np.flatnonzero(sizes < 0)
        if negative.size:
            i = int(negative[0])
            raise ValueError(f"at batch size {b} event {i} of the trace derived from batch sizes "
                             f"{self.batch_sizes[0]} and {self.batch_sizes[1]} would have size {int(sizes[i]):,} "
                             f"(it shrinks by {-int(self.slope[i]):,} bytes per sample): the model does not hold there")
        return sizes.astype(np.uint64)

    def at(self, batch_size: int) -> Trace:
        """The trace a capture at `batch_size` (>= 2) would give: every column, string table and
        meta entry of the captures, the sizes computed, meta['batch_size'] set (when the captures
        have one). Its arrays are its own."""
        sizes = self.sizes_at(batch_size)
        t = self._template
        meta = copy.deepcopy(t.meta)
        if "batch_size" in meta:
            meta["batch_size"] = int(batch_size)
        for region in meta.get("compiled_regions") or ():
            if isinstance(region, dict) and "graphs" in region:
                region["graphs"] = 0  # nothing was compiled for a derived trace
        return Trace(kind=t.kind.copy(), id=t.id.copy(), size=sizes, stream=t.stream.copy(),
                     alloc_dtype=t.alloc_dtype.copy(), alloc_category=t.alloc_category.copy(),
                     alloc_module=t.alloc_module.copy(), alloc_op=t.alloc_op.copy(), dtypes=list(t.dtypes),
                     modules=list(t.modules), ops=list(t.ops), meta=meta)

    def __repr__(self) -> str:
        a, b = self.batch_sizes
        return (f"BatchModel({self._template.num_events:,} events from batch sizes {a} and {b}, "
                f"{int(np.count_nonzero(self.slope)):,} of them growing with the batch)")


def first_difference(x: Trace, y: Trace, what_x: str = "derived", what_y: str = "captured") -> str | None:
    """The first difference between two traces in any column, string table or meta entry (the
    batch size included), in words; None when they are identical event for event."""
    for trace, name in ((x, "x"), (y, "y")):
        if not isinstance(trace, Trace):
            raise TypeError(f"{name} must be a vramkit.trace.Trace, got {type(trace).__name__}")
    why = _structure_difference(x, y, what_x, what_y)
    if why is not None:
        return why
    if x.meta.get("batch_size") != y.meta.get("batch_size"):
        return f"meta['batch_size'] is {x.meta.get('batch_size')!r} {what_x}, {y.meta.get('batch_size')!r} {what_y}"
    diff = np.flatnonzero(x.size != y.size)
    if diff.size:
        i = int(diff[0])
        return f"event {i}: size {int(x.size[i]):,} {what_x}, {int(y.size[i]):,} {what_y}"
    return None
