"""Replay a trace on a simulated GPU and say whether it fits (``vramkit.trace.replay``).

The replay loop is C (``_C.trace_replay``): a private ``sim`` pool with vramkit's PyTorch
policy, of the target's capacity less the GPU memory that no CPU or meta trace can see. Those
are explicit line items of the ``Target`` (``GpuOverheads``, in ``target/gpu_profiles.py``; a
GPU profile sets them for its GPU), never a hidden factor:

* the CUDA context (driver, kernels, cuBLAS/cuDNN handles): outside PyTorch's allocator, so it
  shrinks the memory the allocator can reserve. nvidia-smi shows it next to "reserved";
  300-600 MiB is usual with lazy module loading (CUDA 11.7+), more without; default 512 MiB.
* the cuBLAS workspace: allocated through PyTorch's caching allocator at the first matmul on a
  stream, so it counts in ``memory_allocated``. PyTorch's default is 4096 KiB x 2 + 16 KiB x 8
  (8.125 MiB), 32 MiB on Hopper (``CUBLAS_WORKSPACE_CONFIG`` overrides it); default 32 MiB
  (one); a GPU profile counts two, the forward's thread's and autograd's device thread's.
* cuDNN workspaces (convolutions; depend on the algorithm chosen at run time) and NCCL
  buffers (distributed training): 0 unless given.

A PyTorch snapshot recorded on a GPU already holds the workspaces (they come from the caching
allocator), so its replay adds none the caller did not set (``Target.for_trace``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ... import _C
from ..._core.text_html import TextAsHtml
from ..formats.file_format import ALLOC, CATEGORIES, FREE, PHASES, STEP, SYNC, USE, Trace
from ..._core.sizes import format_size
from ..target.gpu_profiles import AllocConf, GpuOverheads, GpuSpec, Target, resolve_target

__all__ = ["ON_DEVICE", "Prediction", "peak_live_bytes", "region_list", "replay"]

# The categories a replay puts on the GPU: not "deferred" (meta storages made before
# Module.to_empty, which a real run never allocates) nor "host" (CPU memory).
ON_DEVICE = [c for c in CATEGORIES if c not in ("deferred", "host")]

@dataclass
class Prediction(TextAsHtml):
    """What a replay found. Sizes in bytes; ``allocated`` counts blocks as PyTorch's
    ``memory_allocated`` does (rounded up to 512 B)."""

    gpu: Target  # the GPU replayed on: capacity, line items, allocator options
    fits: bool
    peak_allocated: int
    peak_reserved: int
    peak_requested: int
    reserved_at_peak_allocated: int
    peak_event: int
    where_peak: dict[str, Any]
    by_category: dict[str, int]
    by_module: list[tuple[str, int]]
    oom: dict[str, Any] | None
    events: int
    replay_seconds: float
    source: str = ""
    curves: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    checkpointed_blocks: str = ""  # set by fit for a capture with checkpoint_blocks
    checkpointed_count: int = 0
    communication_sent: int | None = None  # set by fit for a sharded trace: bytes this rank sends per step
    host_bytes: int | None = None  # set by fit: host memory the trace holds at its end (FSDP2's CPU offload)
    streams: dict[str, str] = field(default_factory=dict)  # the trace's side streams: number -> name
    # The step's torch.compile'd regions (the capture's meta["compiled_regions"]): name, how
    # ("compiled", or "eager upper bound": its figure is what eager holds), why, backend.
    compiled_regions: list[dict[str, Any]] = field(default_factory=list)
    # Sizes the capture modelled rather than saw (trace.meta["estimated_bytes"]: what, and how),
    # and the bytes of such allocations live at the peak (or the OOM): their op's name ends in
    # "(estimated)", as cuDNN's workspaces' do.
    estimates: dict[str, str] = field(default_factory=dict)
    estimated_at_peak: int = 0

    @property
    def eager_bound_regions(self) -> list[str]:
        """The compiled regions predicted as eager: the figures are upper bounds for them."""
        return [r["name"] for r in self.compiled_regions if r.get("how") == "eager upper bound"]

    @property
    def lower_bound_regions(self) -> list[str]:
        """The compiled regions predicted without what they hold beyond the compiled graphs (their
        CUDA graphs' pools): the figures are lower bounds for them."""
        return [r["name"] for r in self.compiled_regions if r.get("how") not in ("compiled", "eager upper bound")]

    @property
    def capacity(self) -> int:
        """The GPU's memory (``Target.capacity``)."""
        return self.gpu.capacity

    @property
    def usable(self) -> int:
        """What the allocator could reserve: the capacity less the line items outside it."""
        return self.gpu.usable

    @property
    def overheads(self) -> GpuOverheads:
        """The line items replayed (``Target.overheads``)."""
        return self.gpu.overheads

    @property
    def alloc_conf(self) -> str | None:
        """The allocator options replayed (``Target.alloc_conf``)."""
        return self.gpu.alloc_conf

    @property
    def fragmentation(self) -> float:
        """Peak reserved over peak allocated (1.0 is perfect packing)."""
        return self.peak_reserved / self.peak_allocated if self.peak_allocated else 1.0

    @property
    def headroom(self) -> int:
        """Usable bytes left at the reserved peak (negative when it does not fit)."""
        return self.usable - self.peak_reserved if self.fits else -1

    def verdict(self) -> str:
        bound, low = self.eager_bound_regions, self.lower_bound_regions
        upper = f"; an upper bound: compiled {region_list(bound)} predicted as eager" if bound else ""
        upper += f"; a lower bound: the CUDA graphs of compiled {region_list(low)} left out" if low else ""
        if self.fits:
            return (f"fits: peak reserved {format_size(self.peak_reserved)} of {format_size(self.capacity)} "
                    f"(peak allocated {format_size(self.peak_allocated)}){upper}")
        o = self.oom or {}
        where = o.get("module") or "(outside any module)"
        return (f"OOM at {where} ({o.get('op', '?')}), step {o.get('step', '?')} {o.get('phase', '?')}: "
                f"tried to allocate {format_size(o.get('size', 0))} with {format_size(o.get('allocated', 0))} live, "
                f"{format_size(o.get('reserved', 0))} reserved of {format_size(self.usable)} usable{upper}")

    def table(self, top: int = 5) -> str:
        """The verdict, then the figures a person reads in ten seconds."""
        lines = [self.verdict(), ""]
        label = "at the peak" if self.fits else "at the OOM"
        rows = [("device memory", format_size(self.capacity))]
        for name, value, where in self.overheads.items():
            rows.append((f"  {name.replace('_', ' ')}", f"{format_size(value)} "
                         f"({'outside the allocator' if where == 'outside' else 'allocated at the first step'})"))
        rows.append(("usable by the allocator", format_size(self.usable)))
        if self.fits:
            rows += [("peak allocated", format_size(self.peak_allocated)),
                     ("peak reserved", f"{format_size(self.peak_reserved)} ({self.fragmentation:.3f}x allocated)")]
        else:
            o = self.oom or {}
            rows += [("allocated at the OOM", format_size(o.get("allocated", 0))),
                     ("reserved at the OOM", format_size(o.get("reserved", 0))),
                     ("request that failed", format_size(o.get("size", 0)))]
        if self.streams:
            rows.append(("side streams", ", ".join(self.streams.values()) + " (own free blocks)"))
        for region in self.compiled_regions:
            how = {"compiled": "as compiled", "eager upper bound": "as EAGER: an upper bound"}.get(
                region.get("how", ""), "without its CUDA graphs: a lower bound")
            rows.append((f"compiled {region.get('name', '?')}", f"predicted {how} ({region.get('why', '')})"))
        if self.estimates:
            share = f"{format_size(self.estimated_at_peak)} of what is allocated {label}"
            rows.append(("estimated sizes", f"{share}; {', '.join(k.replace('_', ' ') for k in self.estimates)} "
                                            "modelled, not seen (trace.meta['estimated_bytes'])"))
        w = self.where_peak
        if w:
            rows.append((f"{label}", f"step {w.get('step')}, {w.get('phase')}, {w.get('module') or '(outside modules)'}"
                         f" ({w.get('op')})"))
        for cat, value in sorted(self.by_category.items(), key=lambda kv: -kv[1]):
            if value:
                rows.append((f"  {cat.replace('_', ' ')}", format_size(value)))
        if self.by_module:
            rows.append(("largest modules " + label, ""))
            for name, value in self.by_module[:top]:
                rows.append((f"  {name or '(outside modules)'}", format_size(value)))
        width = max(len(r[0]) for r in rows) + 2
        lines += [f"{name:<{width}}{value}".rstrip() for name, value in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _with_overheads(trace: Trace, overheads: GpuOverheads, include_host: bool) -> tuple[np.ndarray, ...]:
    """The event columns to replay: host-side allocations dropped (unless asked), workspace
    line items inserted as allocations before the first step's first event. Returns
    (kind, id, size, stream, source_index) where source_index maps back to the trace's events
    (-1 for an inserted line item)."""
    kind, ids, size, stream = trace.kind, trace.id, trace.size, trace.stream
    keep = np.ones(len(kind), bool)
    if trace.num_allocations:
        # deferred: meta storage the script made before to_empty, no memory in a real run
        left_out = trace.alloc_category == CATEGORIES.index("deferred")
        if not include_host:
            left_out |= trace.alloc_category == CATEGORIES.index("host")
        mem = (kind <= FREE) | (kind == USE)
        keep[mem] = ~left_out[ids[mem]]
    src = np.flatnonzero(keep)
    kind, ids, size, stream = kind[src], ids[src], size[src], stream[src]
    kind, ids, size, stream, src = _synchronize_at_step_ends(kind, ids, size, stream, src)
    extra = [(name, value) for name, value, where in overheads.items() if where == "allocator"]
    if not extra:
        return kind, ids, size, stream, src
    steps = np.flatnonzero(kind == STEP)
    at = int(steps[0]) if steps.size else 0
    first_id = trace.num_allocations
    add_kind = np.zeros(len(extra), np.uint8)
    add_id = np.arange(first_id, first_id + len(extra), dtype=np.int64)
    add_size = np.array([v for _, v in extra], np.uint64)
    return (np.concatenate([kind[:at], add_kind, kind[at:]]), np.concatenate([ids[:at], add_id, ids[at:]]),
            np.concatenate([size[:at], add_size, size[at:]]),
            np.concatenate([stream[:at], np.zeros(len(extra), np.uint64), stream[at:]]),
            np.concatenate([src[:at], np.full(len(extra), -1, np.int64), src[at:]]))


def _synchronize_at_step_ends(kind: np.ndarray, ids: np.ndarray, size: np.ndarray, stream: np.ndarray,
                              src: np.ndarray) -> tuple[np.ndarray, ...]:
    """A SYNC of every stream before each step marker, when the trace records stream uses: a
    training loop waits for its step at the step's end (``loss.item()``, logging, the next
    batch's copy), so by then a GPU has finished the side streams' work and ``record_stream``'s
    waiting blocks are back in their pools. Between step ends they wait for the trace's own
    SYNC events (or, as PyTorch does, for a synchronize before an out-of-memory error)."""
    if not (kind == USE).any():
        return kind, ids, size, stream, src
    at = np.flatnonzero(kind == STEP)
    n = len(at)
    return (np.insert(kind, at, np.full(n, SYNC, np.uint8)), np.insert(ids, at, np.full(n, -1, np.int64)),
            np.insert(size, at, np.zeros(n, np.uint64)), np.insert(stream, at, np.zeros(n, np.uint64)),
            np.insert(src, at, np.full(n, -1, np.int64)))


def _describe_event(trace: Trace, event: int, phases: np.ndarray, steps: np.ndarray) -> dict[str, Any]:
    if event < 0 or event >= trace.num_events:
        return {}
    out: dict[str, Any] = {"event": int(event), "phase": PHASES[int(phases[event])], "step": int(steps[event])}
    if trace.kind[event] in (ALLOC, FREE):
        i = int(trace.id[event])
        out.update(module=trace.name_of("modules", int(trace.alloc_module[i])).replace("?", ""),
                   op=trace.name_of("ops", int(trace.alloc_op[i])), size=int(trace.size[event]),
                   category=CATEGORIES[int(trace.alloc_category[i])])
    return out


def _step_at(trace: Trace) -> np.ndarray:
    marks = trace.kind == STEP
    pos = np.where(marks, np.arange(trace.num_events), -1)
    last = np.maximum.accumulate(pos) if trace.num_events else pos
    return np.where(last >= 0, trace.id[np.maximum(last, 0)], -1)


def replay(trace: Trace, gpu: GpuSpec, alloc_conf: AllocConf = None, *,
           overheads: GpuOverheads | Mapping[str, int] | None = None, include_host: bool = False, top: int = 10,
           curves: bool = False) -> Prediction:
    """Replay `trace` on a simulated GPU with PyTorch's allocator policy and return a
    ``Prediction``: peaks, whether and where it runs out of memory, the fragmentation, and what
    was live at the peak (or at the OOM) by category and by module.

    `gpu`: the GPU, as ``resolve_target`` takes it: a profile name (``"H100-80GB"``),
    ``"current"``, a ``GpuProfile``, its memory (bytes or ``"24GiB"``) or a ``Target``.
    `alloc_conf`: PYTORCH_CUDA_ALLOC_CONF-style options, a string or dict. `overheads`: the
    GPU-only line items, a ``GpuOverheads`` or some of its fields (by default the profile's,
    else ``GpuOverheads()``'s; ``NO_OVERHEADS`` to replay the trace alone). For a PyTorch
    snapshot recorded on a GPU the cuBLAS/cuDNN workspaces are left out unless set here: it holds
    them already. `include_host`: also replay allocations that a GPU run keeps in host memory
    (Adam's step counters). `curves`: keep per-event allocated/reserved arrays.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a vramkit.trace.Trace, got {type(trace).__name__}")
    target = resolve_target(gpu, overheads=overheads, alloc_conf=alloc_conf).for_trace(trace)
    ov, usable, conf = target.overheads, target.usable, target.alloc_conf
    kind, ids, size, stream, src = _with_overheads(trace, ov, include_host)
    n = len(kind)
    allocated = np.zeros(n, np.uint64)
    reserved = np.zeros(n, np.uint64)
    addresses = np.zeros(n, np.uint64) if curves else None
    t0 = time.perf_counter()
    res = _C.trace_replay(kind, ids, size, stream, usable, conf, reserved, allocated, addresses)
    seconds = time.perf_counter() - t0

    phases, steps = trace.phase_at(), _step_at(trace)
    oom = None
    done = n if res["oom_event"] < 0 else int(res["oom_event"])
    if res["oom_event"] >= 0:
        e = int(res["oom_event"])
        info = res.get("oom_info") or {}
        oom = {"event": int(src[e]), "size": int(size[e]), "allocated": int(info.get("allocated", 0)),
               "reserved": int(info.get("reserved", 0)),
               "message": res.get("oom_message", "").replace("sim:-1", "the simulated GPU")}
        if src[e] >= 0:
            d = _describe_event(trace, int(src[e]), phases, steps)
            oom.update({k: v for k, v in d.items() if k in ("module", "op", "phase", "step", "category")})
        else:
            oom.update(module="", op="(GPU line item)", phase="setup", step=0)
        focus = e - 1  # what was live when the failing request came
    else:
        focus = int(res["peak_allocated_event"])

    # Block bytes per allocation from the per-event allocated column (exact under any rounding).
    block = np.zeros(n, np.int64)
    if n:
        prev = np.concatenate([[0], allocated[:-1].astype(np.int64)])
        block = allocated.astype(np.int64) - prev
    by_category: dict[str, int] = {}
    by_module: list[tuple[str, int]] = []
    estimated_at_peak = 0
    where: dict[str, Any] = {}
    if focus >= 0 and n:
        upto = slice(0, focus + 1)
        is_alloc = kind[upto] == ALLOC
        alloc_pos = np.flatnonzero(is_alloc)
        mem_ids = ids[kind <= FREE]  # marker ids are phase and step numbers, not allocation ids
        freed = np.zeros(int(mem_ids.max()) + 1 if mem_ids.size else 0, bool)
        fpos = np.flatnonzero(kind[upto] == FREE)
        freed[ids[fpos]] = True
        live_pos = alloc_pos[~freed[ids[alloc_pos]]]
        live_ids = ids[live_pos]
        live_bytes = block[live_pos]
        num = trace.num_allocations
        in_trace = live_ids < num
        cat_names = np.array(CATEGORIES + ("workspace",))
        cats = np.full(len(live_ids), len(CATEGORIES), np.int64)
        cats[in_trace] = trace.alloc_category[live_ids[in_trace]]
        for c in np.unique(cats):
            by_category[str(cat_names[c])] = int(live_bytes[cats == c].sum())
        estimated_ops = [i for i, name in enumerate(trace.ops) if name.endswith(_ESTIMATED)]
        if estimated_ops:
            ops = np.full(len(live_ids), -1, np.int64)
            ops[in_trace] = trace.alloc_op[live_ids[in_trace]]
            estimated_at_peak = int(live_bytes[np.isin(ops, estimated_ops)].sum())
        mods = np.full(len(live_ids), -2, np.int64)
        mods[in_trace] = trace.alloc_module[live_ids[in_trace]]
        totals: dict[str, int] = {}
        for m in np.unique(mods):
            name = "(GPU line items)" if m == -2 else (trace.modules[m] if m >= 0 else "")
            totals[name] = totals.get(name, 0) + int(live_bytes[mods == m].sum())
        by_module = sorted(totals.items(), key=lambda kv: -kv[1])[:max(top, 0)]
        if oom is None and src[focus] >= 0:
            where = _describe_event(trace, int(src[focus]), phases, steps)

    out_curves = {}
    if curves and addresses is not None:  # (addresses is an array exactly when curves is set)
        # Up to the last event replayed: all of them, or those before the OOM.
        out_curves = {"kind": kind[:done], "id": ids[:done], "allocated": allocated[:done],
                      "reserved": reserved[:done], "address": addresses[:done], "source_event": src[:done]}
    return Prediction(gpu=target, fits=oom is None, peak_allocated=int(res["peak_allocated"]),
                      peak_reserved=int(res["peak_reserved"]), peak_requested=int(res["peak_requested"]),
                      reserved_at_peak_allocated=int(res["reserved_at_peak_allocated"]),
                      peak_event=int(src[focus]) if oom is None and focus >= 0 else -1, where_peak=where,
                      by_category=by_category, by_module=by_module, oom=oom, events=int(res["events"]), replay_seconds=seconds, source=str(trace.meta.get("source", "")),
                      curves=out_curves, streams=_stream_names(trace),
                      compiled_regions=_compiled_regions(trace), estimates=_estimates(trace),
                      estimated_at_peak=estimated_at_peak)


_ESTIMATED = "(estimated)"  # the end of the op name of an allocation whose size was modelled


def _estimates(trace: Trace) -> dict[str, str]:
    """The capture's ``meta["estimated_bytes"]`` (what was modelled: how), kept only if
    well-formed: meta may come from a file."""
    found = trace.meta.get("estimated_bytes")
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def _stream_names(trace: Trace) -> dict[str, str]:
    """The capture's names of its side streams (``meta["streams"]``), kept only if well-formed:
    meta may come from a file."""
    names = trace.meta.get("streams")
    if not isinstance(names, dict):
        return {}
    return {str(k): str(v)[:80] for k, v in list(names.items())[:64]}


def region_list(names: Sequence[str]) -> str:
    """Compiled regions' names for a line of text: the first three, then "..."."""
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _compiled_regions(trace: Trace) -> list[dict[str, Any]]:
    """The capture's ``meta["compiled_regions"]``, kept only where well-formed (meta may come from
    a file): name, how, why and backend as short strings."""
    regions = trace.meta.get("compiled_regions")
    if not isinstance(regions, list):
        return []
    return [{k: str(r.get(k, ""))[:200] for k in ("name", "how", "why", "backend")}
            for r in regions[:64] if isinstance(r, dict)]


def peak_live_bytes(trace: Trace, *, rounded: bool = False, categories: Sequence[str] | None = None) -> int:
    """Peak of the sum of live allocations' sizes (requested bytes, or rounded up to 512 B as
    PyTorch's blocks are), over the whole trace, in pure NumPy: the reference the tests
    compare the C replay and live measurements against."""
    mem = trace.kind <= FREE
    kind, ids = trace.kind[mem], trace.id[mem]
    sizes = trace.alloc_size.astype(np.int64)
    if rounded:
        sizes = np.where(sizes > 0, np.maximum(512, (sizes + 511) // 512 * 512), 0)
    if categories is not None:
        wanted = np.isin(trace.alloc_category, [CATEGORIES.index(c) for c in categories])
        sizes = np.where(wanted, sizes, 0)
    delta = np.where(kind == ALLOC, sizes[ids], -sizes[ids])
    return int(np.cumsum(delta).max(initial=0))
