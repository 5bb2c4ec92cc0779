"""Per-rank predictions for sharded training: ``predict_ranks(build, batch_size, world_size=8, ...)``.

Each captured rank is a meta capture under ``fake_dist`` (``capture(world_size=, rank=)``),
replayed on the GPU with the line items of a distributed job: the profile's, plus NCCL's memory
outside the allocator (``GpuOverheads.nccl``; 650 MiB by default, measured on an H200).

**Which ranks are captured.**
- Under DDP every rank holds the same storages.
- Under FSDP2 every rank's parameter storage is padded to the same chunk, but the last ranks'
  local tensors (and so their optimizer states) can be shorter.
- ZeroRedundancyOptimizer gives whole parameters to ranks, so ranks differ.

So rank 0 is captured first. Where that capture's strategy gives every rank shards of the
same shapes (no ZeroRedundancyOptimizer, every sharded dimension divisible by its mesh
dimension: Llama 3 70B's on 64 ranks are), the others are taken to match it. Otherwise the last
rank is captured too; if their parameters, gradients or optimizer
states differ by more than 1 %, every rank is captured, up to `max_ranks`; a larger job then
captures an evenly spread sample and says so. Per-rank batch sizes are what the builder is given: the global batch is world size x batch
size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._core.sizes import format_size
from ..._core.text_html import TextAsHtml
from ..capturing.capture_step import capture
from ..formats.file_format import CATEGORIES, Trace
from ..replaying.replay_sim import ON_DEVICE, Prediction, peak_live_bytes, replay
from ..target.gpu_profiles import AllocConf, GpuOverheads, GpuSpec, Target, resolve_target
from .probes import middle_half

__all__ = ["RankReport", "WorldSizeAnswer", "predict_ranks", "smallest_world_size", "world_sizes"]


@dataclass
class RankReport(TextAsHtml):
    """Per-rank predictions of one sharded step at one per-rank batch size."""

    world_size: int
    batch_size: int
    gpu: Target  # the GPU every rank is replayed on (NCCL's line item included)
    predictions: dict[int, Prediction]  # rank -> its replay
    traces: dict[int, Trace] = field(repr=False, default_factory=dict)
    note: str = ""  # which ranks were captured, and why

    @property
    def capacity(self) -> int:
        """Each GPU's memory (``Target.capacity``)."""
        return self.gpu.capacity

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.predictions.values())

    @property
    def worst_rank(self) -> int:
        """The rank with the highest peak reserved (the first to run out of memory)."""
        return max(self.predictions, key=lambda r: (self.predictions[r].peak_reserved, -r))

    def imbalance(self) -> str:
        """What the highest rank holds more of than the lowest, at their peaks, in words."""
        if len(self.predictions) < 2:
            return ""
        hi = self.worst_rank
        lo = min(self.predictions, key=lambda r: (self.predictions[r].peak_reserved, r))
        a, b = self.predictions[hi], self.predictions[lo]
        if a.peak_reserved - b.peak_reserved <= 0.01 * max(b.peak_reserved, 1):
            return "the ranks are within 1 % of each other"
        if abs(a.peak_allocated - b.peak_allocated) <= 0.01 * max(b.peak_allocated, 1):
            return (f"rank {hi} reserves {format_size(a.peak_reserved - b.peak_reserved)} more than rank {lo} for "
                    "about the same allocations: the allocator's segments round differently")
        diffs = sorted(((a.by_category.get(c, 0) - b.by_category.get(c, 0), c)
                        for c in set(a.by_category) | set(b.by_category)), reverse=True)
        amount, category = diffs[0]
        why = ""
        if category == "optimizer_state" and self.traces:
            module, size = _largest_state(self.traces[hi])
            strategy = self.traces[hi].meta.get("strategy", {})
            if strategy.get("zero") and module:
                why = (f" (ZeroRedundancyOptimizer gives whole parameters to ranks: rank {hi} holds the state of "
                       f"{module}, {format_size(size)})")
            else:
                why = " (the last ranks' shards are shorter)"
        return (f"rank {hi} peaks {format_size(a.peak_reserved - b.peak_reserved)} above rank {lo}: it holds "
                f"{format_size(amount)} more {category.replace('_', ' ')} at its peak{why}")

    def collectives(self) -> dict[str, dict[str, int]]:
        """The last captured step's collectives on the worst rank (count, bytes, bytes sent)."""
        info = self.traces[self.worst_rank].meta.get("distributed", {}) if self.traces else {}
        steps = info.get("steps") or [{}]
        return dict(steps[-1])

    def table(self) -> str:
        worst = self.predictions[self.worst_rank]
        verdict = "fits on every rank" if self.fits else f"does NOT fit: rank {self.worst_rank} runs out of memory"
        lines = [f"world size {self.world_size}, batch size {self.batch_size} per rank "
                 f"({self.world_size * self.batch_size} in all), {format_size(self.capacity)} per GPU: {verdict}",
                 f"  {worst.verdict()}" if not self.fits else "", "",
                 f"{'rank':>6}  {'peak allocated':>15}  {'peak reserved':>14}  live at the peak"]
        for rank in sorted(self.predictions):
            p = self.predictions[rank]
            cats = ", ".join(f"{c.replace('_', ' ')} {format_size(b)}" for c, b in
                             sorted(p.by_category.items(), key=lambda kv: -kv[1]) if b >= (1 << 20))
            mark = " <- highest" if rank == self.worst_rank and len(self.predictions) > 1 else ""
            lines.append(f"{rank:>6}  {format_size(p.peak_allocated):>15}  {format_size(p.peak_reserved):>14}  "
                         f"{cats}{mark}")
        lines += ["", self.note] if self.note else []
        imbalance = self.imbalance()
        if imbalance:
            lines.append(imbalance)
        comm = self.collectives()
        if comm:
            parts = [f"{op.replace('_', '-')} {v['count']}x, {format_size(v['sent'])} sent"
                     for op, v in sorted(comm.items()) if v["count"]]
            lines.append("collectives per step (rank %d): %s" % (self.worst_rank, "; ".join(parts)))
        ov = worst.overheads
        lines.append(f"outside the allocator per GPU: CUDA context {format_size(ov.cuda_context)}, NCCL "
                     f"{format_size(ov.nccl)} (measured on an H200 with one rank; more with more peers)")
        return "\n".join(line for line in lines if line is not None).replace("\n\n\n", "\n\n")

    def __str__(self) -> str:
        return self.table()


def _model_state(trace: Trace) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state the trace holds at its end, each: what
    a rank's shards decide (activations follow the per-rank batch, the same on every rank)."""
    live = trace.live_at_end()
    return {c: int(trace.alloc_size[live & (trace.alloc_category == CATEGORIES.index(c))].sum())
            for c in ("parameter", "gradient", "optimizer_state")}


def _largest_state(trace: Trace) -> tuple[str, int]:
    """The module whose optimizer state the trace holds most of at its end, and those bytes."""
    import numpy as np

    state = trace.alloc_category == CATEGORIES.index("optimizer_state")
    mine = trace.live_at_end() & state & (trace.alloc_module >= 0)
    if not mine.any():
        return "", 0
    per_module = np.bincount(trace.alloc_module[mine], weights=trace.alloc_size[mine])
    top = int(per_module.argmax())
    return trace.modules[top], int(per_module[top])


def _spread(world_size: int, count: int) -> list[int]:
    if count >= world_size:
        return list(range(world_size))
    return sorted({round(i * (world_size - 1) / (count - 1)) for i in range(count)})


def predict_ranks(build: Callable[..., Any], batch_size: int, *, world_size: int, gpu: GpuSpec,
                  ranks: list[int] | None = None, steps: int = 2, alloc_conf: AllocConf = None,
                  overheads: GpuOverheads | Mapping[str, int] | None = None, max_ranks: int = 64,
                  progress: Callable[[str], None] | None = None) -> RankReport:
    """Capture `build(batch_size)` as ranks of a `world_size`-rank job and replay each on the
    GPU (`gpu`, `alloc_conf` and `overheads` as for ``fit``; NCCL's 650 MiB is a line item
    unless `overheads` sets ``nccl``). `ranks`: which ranks (default: those whose shards differ,
    see the module docstring)."""
    say = progress or (lambda line: None)
    target = resolve_target(gpu, overheads=overheads, alloc_conf=alloc_conf, world_size=world_size)
    options: dict[str, Any] = {"cuda": target.cuda_choices()}
    traces: dict[int, Trace] = {}
    preds: dict[int, Prediction] = {}

    def one(rank: int) -> None:
        if rank in traces:
            return
        say(f"capturing rank {rank} of {world_size} at batch size {batch_size} ...")
        traces[rank] = capture(build, batch_size, device="meta", steps=steps, world_size=world_size, rank=rank,
                               meta={"batch_size": batch_size}, progress=say, **options)
        preds[rank] = replay(traces[rank], target)

    if ranks is not None:
        for r in ranks:
            one(r)
        note = f"ranks captured: {', '.join(map(str, sorted(ranks)))} (as asked)"
    elif _same_shapes_on_every_rank(traces, one, world_size):
        note = (f"rank 0 captured: every sharded parameter divides evenly among the {world_size} ranks and no "
                "ZeroRedundancyOptimizer assigns parameters to ranks, so every rank holds tensors of the same shapes "
                "and the others, running the same step, are taken to match")
    else:
        one(world_size - 1)
        a, b = _model_state(traces[0]), _model_state(traces[world_size - 1])
        if all(abs(a[c] - b[c]) <= 0.01 * max(a[c], b[c], 1) for c in a):
            note = (f"ranks captured: 0 and {world_size - 1}; their parameters, gradients and optimizer states are "
                    "each within 1 %, as with replicated (DDP) or evenly padded (FSDP2) shards, so the others are taken to "
                    "match")
            if world_size == 1:
                note = "one rank"
        else:
            chosen = _spread(world_size, max_ranks)
            for r in chosen:
                one(r)
            note = (f"the shards of ranks 0 and {world_size - 1} differ by more than 1 %, so "
                    + (f"every rank was captured" if len(chosen) == world_size
                       else f"{len(chosen)} evenly spread ranks were captured (of {world_size})"))
    return RankReport(world_size, batch_size, target, preds, traces, note)


def _same_shapes_on_every_rank(traces: dict[int, Trace], one: Callable[[int], None], world_size: int) -> bool:
    """Captures rank 0, and says whether the strategy it recorded gives every rank shards of
    the same shapes (DDP, no sharding, or FSDP2 with every sharded dimension divisible)."""
    one(0)
    strategy = traces[0].meta.get("strategy", {})
    return world_size > 1 and not strategy.get("zero", True) and strategy.get("uneven_shards", 1) == 0


def world_sizes(limit: int) -> list[int]:
    """The world sizes a search tries: 1, 2, 4, 8, then whole nodes of 8 GPUs, up to `limit`."""
    return [n for n in (1, 2, 4) if n <= limit] + list(range(8, limit + 1, 8))


@dataclass
class WorldSizeAnswer:
    """The smallest world size at which one per-rank batch size fits (0: none up to the limit)."""

    batch_size: int
    world_size: int
    gpu: Target  # the GPU each world size was replayed on
    tried: dict[int, Prediction]  # world size -> the prediction of its highest rank captured
    why_not: str = ""  # why more ranks do not help, when they do not
    replicated: bool = False  # nothing sharded: every world size holds the same per GPU

    @property
    def capacity(self) -> int:
        """Each GPU's memory (``Target.capacity``)."""
        return self.gpu.capacity

    def line(self) -> str:
        size = format_size(self.capacity)
        if self.replicated and self.world_size:
            return (f"batch size {self.batch_size} per rank fits with any number of GPUs: the script replicates the "
                    "model (DDP or no sharding), so a GPU holds the same at every world size")
        if self.why_not:
            return f"more GPUs do not make batch size {self.batch_size} per rank fit: {self.why_not}"
        if not self.world_size:
            return (f"batch size {self.batch_size} per rank does not fit in {size} per GPU at any world size up to "
                    f"{max(self.tried)}")
        p = self.tried[self.world_size]
        return (f"batch size {self.batch_size} per rank needs at least {self.world_size} x {size} (world size "
                f"{self.world_size}: peak reserved {format_size(p.peak_reserved)} per GPU)")


def smallest_world_size(build: Callable[..., Any], batch_size: int, *, gpu: GpuSpec, known: RankReport | None = None,
                        limit: int = 1024, steps: int = 2, alloc_conf: AllocConf = None,
                        overheads: GpuOverheads | Mapping[str, int] | None = None,
                        progress: Callable[[str], None] | None = None) -> WorldSizeAnswer:
    """The fewest ranks (from ``world_sizes(limit)``) at which `build(batch_size)` fits every
    rank of a job on GPUs `gpu` (with `alloc_conf` and `overheads`, as for ``fit``). `known`:
    a ``predict_ranks`` report at this batch size (its world size is a known
    point, and its highest rank, first or last, is the one captured at the others).

    Memory per rank falls as ranks are added only where something is sharded (FSDP2's
    parameters, gradients and optimizer state; ZeroRedundancyOptimizer's state): under DDP
    alone the answer is that more GPUs do not help. The search doubles (or halves) from the
    known world size until the answer changes, then bisects among the world sizes between."""
    say = progress or (lambda line: None)
    sizes = world_sizes(limit)
    tried: dict[int, Prediction] = {}
    live: dict[int, int] = {}  # world size -> peak of live bytes on the GPU, whatever the capacity
    strategy: dict[str, Any] = {}
    # (every world size tried is a distributed job: NCCL's line item, unless the caller set it)
    target = resolve_target(gpu, overheads=overheads, alloc_conf=alloc_conf, world_size=limit)
    last = bool(known is not None and known.worst_rank == known.world_size - 1 and known.world_size > 1)

    def fits(n: int) -> bool:
        if n not in tried:
            if known is not None and n == known.world_size:
                tried[n] = known.predictions[known.worst_rank]
                trace = known.traces[known.worst_rank]
            else:
                say(f"world size {n}: capturing rank {n - 1 if last else 0} at batch size {batch_size} ...")
                r = predict_ranks(build, batch_size, world_size=n, gpu=target, ranks=[n - 1 if last else 0], steps=steps)
                tried[n] = r.predictions[r.worst_rank]
                trace = r.traces[r.worst_rank]
            strategy.update(trace.meta.get("strategy", {}))
            live[n] = peak_live_bytes(trace, rounded=True, categories=ON_DEVICE)
        return tried[n].fits

    start = known.world_size if known is not None else 8
    i = min(range(len(sizes)), key=lambda k: abs(sizes[k] - start))
    ok = fits(sizes[i])
    if not (strategy.get("fsdp2") or strategy.get("zero")):
        if ok:  # replicated and fitting: fits at any world size
            return WorldSizeAnswer(batch_size, 1, target, tried, replicated=True)
        why = ("the script replicates the model on every GPU (DDP or no sharding), so a GPU holds the same at any "
               "world size; shard it (FSDP2: fully_shard) to spread parameters, gradients and optimizer state")
        return WorldSizeAnswer(batch_size, 0, target, tried, why_not=why, replicated=True)
    # sizes[lo] does not fit (-1: none known), sizes[hi] does (len(sizes): none known)
    if ok:  # halve the world size until it does not fit
        lo, hi = -1, i
        while hi > 0:
            j = max(k for k in range(hi) if sizes[k] <= max(1, sizes[hi] // 2))
            if not fits(sizes[j]):
                lo = j
                break
            hi = j
    else:  # double it until it fits
        lo, hi = i, len(sizes)
        while lo < len(sizes) - 1:
            j = min([k for k in range(lo + 1, len(sizes)) if sizes[k] >= 2 * sizes[lo]] or [len(sizes) - 1])
            if fits(sizes[j]):
                hi = j
                break
            lo = j
    raw = True  # the first interpolated probe as the line says; then kept to the middle half
    while hi - lo > 1:  # as fit's search for the fewest checkpointed blocks
        guess = _interpolated(sizes, lo, hi, live, tried)
        mid = (lo + hi) // 2 if guess is None else guess if raw else middle_half(lo, hi, guess)
        raw = False
        if fits(sizes[mid]):
            hi = mid
        else:
            lo = mid
    return WorldSizeAnswer(batch_size, sizes[hi] if hi < len(sizes) else 0, target, tried)


def _interpolated(sizes: list[int], lo: int, hi: int, live: dict[int, int], tried: dict[int, Prediction]) -> int | None:
    """The index between lo and hi where a rank's live peak, taken as a + b / world size through
    the bracket's ends (the sharded part shrinks as 1/N, the rest stays), falls to what the
    fitting end leaves room for; None when that line says nothing (an end unknown, no slope)."""
    if lo < 0 or hi >= len(sizes):
        return None
    n_lo, n_hi = sizes[lo], sizes[hi]
    b = (live[n_lo] - live[n_hi]) / (1 / n_lo - 1 / n_hi)
    a = live[n_hi] - b / n_hi
    goal = live[n_hi] + tried[n_hi].usable - tried[n_hi].peak_reserved
    if b <= 0 or goal <= a:
        return None
    need = b / (goal - a)
    k = next((k for k in range(lo + 1, hi) if sizes[k] >= need), hi - 1)
    return min(max(k, lo + 1), hi - 1)
