"""``vramkit.trace.fit``: the largest batch size that fits a GPU, and what to change when the
batch size you want does not.

Every answer is a replay: the builder is captured on ``meta`` at the batch size in question
(nothing is allocated, so a 7B model costs only the capture's Python time) and replayed on a
simulated device of the capacity asked for. The search doubles the batch size from 1 until a
replay runs out of memory, then bisects between the last size that fit and the first that did
not, so it needs about 2 log2(B) probes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .capture_step import capture
from .replay_sim import GpuOverheads, Prediction, _conf_text, format_size, parse_size, replay

__all__ = ["FitReport", "Probe", "Suggestion", "fit"]


@dataclass
class Probe:
    """One capture and replay at one batch size."""

    batch_size: int
    prediction: Prediction
    seconds: float

    @property
    def fits(self) -> bool:
        return self.prediction.fits


@dataclass
class Suggestion:
    """A change that makes the target batch size fit, with its predicted peak and its cost."""

    change: str
    settings: dict[str, Any]
    prediction: Prediction
    cost: str


@dataclass
class FitReport:
    capacity: int
    target_batch_size: int | None
    max_batch_size: int  # the largest batch size that fits; 0 if even 1 does not
    probes: list[Probe] = field(default_factory=list)
    target: Prediction | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    searched_up_to: int = 0  # the search's cap; 0 when no search ran

    @property
    def fits(self) -> bool:
        return self.target.fits if self.target is not None else self.max_batch_size > 0

    def table(self, top: int = 5) -> str:
        lines = []
        if self.target is not None:
            lines += [f"batch size {self.target_batch_size}: " + self.target.table(top), ""]
        if self.searched_up_to:
            if self.max_batch_size:
                cap = " (the search's cap)" if self.max_batch_size >= self.searched_up_to else ""
                lines.append(f"largest batch size that fits: {self.max_batch_size}{cap}")
            else:
                lines.append("no batch size fits: even batch size 1 runs out of memory")
        if self.probes and (self.searched_up_to or len(self.probes) > 1):
            lines.append(f"{'batch':>7}  {'fits':<4}  {'peak allocated':>15}  {'peak reserved':>14}")
            for p in sorted(self.probes, key=lambda p: p.batch_size):
                pr = p.prediction
                alloc = format_size(pr.peak_allocated) if pr.fits else "-"
                res = format_size(pr.peak_reserved) if pr.fits else "OOM"
                lines.append(f"{p.batch_size:>7}  {'yes' if pr.fits else 'no':<4}  {alloc:>15}  {res:>14}")
        if self.suggestions:
            lines += ["", f"to train batch size {self.target_batch_size} in {format_size(self.capacity)}:"]
            for s in self.suggestions:
                pr = s.prediction
                lines.append(f"  - {s.change}: peak reserved {format_size(pr.peak_reserved)} "
                             f"(allocated {format_size(pr.peak_allocated)}); cost: {s.cost}")
        elif self.target is not None and not self.target.fits:
            lines += ["", f"nothing tried makes batch size {self.target_batch_size} fit "
                          "(gradient accumulation down to micro-batch 1, allocator options)"]
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        return self.table()


def _probe(build: Callable[..., Any], batch_size: int, cap: int, steps: int, alloc_conf: Any,
           overheads: GpuOverheads | None, checkpoint_blocks: bool | int = False, autocast: Any = None) -> Probe:
    t0 = time.perf_counter()
    trace = capture(build, batch_size, device="meta", steps=steps, meta={"batch_size": batch_size},
                    checkpoint_blocks=checkpoint_blocks, autocast=autocast)
    if trace.meta.get("form") != "builder":
        name = getattr(build, "__qualname__", type(build).__name__)
        what = trace.meta.get("first_return", "no function")
        raise TypeError(f"{name}({batch_size}) returned {'None' if what == 'NoneType' else 'a ' + what}: the builder "
                        "must build the model, optimizer and batch and return the step function (`return step`)")
    pred = replay(trace, cap, alloc_conf, overheads=overheads)
    pred.checkpointed_blocks = trace.meta.get("checkpointed_blocks", "")
    pred.checkpointed_count = int(trace.meta.get("checkpointed_count", 0))
    return Probe(batch_size, pred, time.perf_counter() - t0)


def fit(build: Callable[..., Any], capacity: Any = "24GiB", *, batch_size: int | None = None,
        max_batch_size: int = 1 << 16, steps: int = 2, alloc_conf: Any = None,
        overheads: GpuOverheads | None = None, search: bool = True,
        progress: Callable[[str], None] | None = None) -> FitReport:
    """Answer "does it fit, and if not what do I change" for a training step.

    `build(batch_size)` builds the model, optimizer and a batch (on the current default
    device: it runs under ``torch.device("meta")``) and returns the step function, as for
    ``capture``'s builder form. `steps` steps are captured (2 by default: optimizer state is
    created in the first step's ``optimizer.step()``, so the second step is the steady state).

    With `search`, the largest batch size up to `max_batch_size` that fits is found. With
    `batch_size`, that size is predicted and, if it does not fit, the cheapest changes that make
    it fit are searched: allocator options (when the live bytes would fit), then each of bf16
    autocast around the model's forward, gradient accumulation (micro-batches that divide it)
    and activation checkpointing of the model's repeated blocks, then pairs of them, then all
    three. Each suggestion carries its predicted peak and its cost. `progress` receives a line per probe.
    """
    if not callable(build):
        raise TypeError(f"build must be callable (batch_size -> step function), got {type(build).__name__}")
    cap = parse_size(capacity)
    for name, value in (("max_batch_size", max_batch_size), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    if batch_size is not None and search and batch_size > max_batch_size:
        raise ValueError(f"batch_size ({batch_size}) is above max_batch_size ({max_batch_size}): the search for the "
                         "largest batch that fits would start above its cap; raise max_batch_size or pass search=False")
    say = progress or (lambda line: None)
    cache: dict[tuple[int, str, str, str], Probe] = {}

    def probe(bs: int, conf: Any = alloc_conf, checkpoint_blocks: bool | int = False, autocast: Any = None) -> Probe:
        key = (bs, str(conf), str(checkpoint_blocks), str(autocast))
        if key not in cache:
            p = _probe(build, bs, cap, steps, conf, overheads, checkpoint_blocks, autocast)
            cache[key] = p
            verdict = f"fits, peak reserved {format_size(p.prediction.peak_reserved)}" if p.fits else "OOM"
            how = ((f" with {conf}" if conf != alloc_conf else "") + (" with bf16 autocast" if autocast else "")
                   + ("" if not checkpoint_blocks else " checkpointing every block" if checkpoint_blocks is True
                      else f" checkpointing {checkpoint_blocks} blocks"))
            say(f"batch size {bs}{how}: {verdict} ({p.seconds:.1f} s)")
        return cache[key]

    report = FitReport(capacity=cap, target_batch_size=batch_size, max_batch_size=0)
    if batch_size is not None:
        report.target = probe(batch_size).prediction
    if search:
        report.max_batch_size, report.searched_up_to = _largest(probe, max_batch_size, batch_size,
                                                                report.target)
    if batch_size is not None and report.target is not None and not report.target.fits:  # (target: batch_size set)
        report.suggestions = _suggest(probe, batch_size, report.target, alloc_conf)
    report.probes = [p for (bs, conf, ckpt, amp), p in sorted(cache.items(), key=lambda kv: kv[0][0])
                     if conf == str(alloc_conf) and ckpt == "False" and amp == "None"]
    return report


def _largest(probe: Callable[..., Probe], limit: int, target: int | None, target_pred: Prediction | None) -> tuple[int, int]:
    """Largest batch size <= limit that fits: double from 1 (or from a target that fits) until a
    size does not fit, then bisect. Returns (size, limit); size 0 when batch size 1 does not fit."""
    lo, hi = 0, None  # lo fits (0: none known), hi does not
    if target is not None and target_pred is not None:
        if target_pred.fits:
            lo = target
        else:
            hi = target
    bs = max(1, 2 * lo)
    while hi is None:
        if lo >= limit:
            return lo, limit
        bs = min(bs, limit)
        if probe(bs).fits:
            lo, bs = bs, 2 * bs
        else:
            hi = bs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo, limit


# Tried in this order, each replayed with PyTorch's policy for it (expandable segments with
# PyTorch's 20 MiB pages); the first that fits is suggested, with what it costs.
_ALLOCATOR_OPTIONS = (
    ("expandable_segments:True", "none in memory; new pages are mapped as segments grow (the first steps are a "
                                 "little slower) and tensors cannot be shared with other processes over CUDA IPC"),
    ("max_split_size_mb:512", "none in memory; the allocator splits or frees cached blocks more often"),
    ("max_split_size_mb:128", "none in memory; the allocator splits or frees cached blocks more often"),
    ("garbage_collection_threshold:0.6", "none in memory; the allocator splits or frees cached blocks more often"),
)


def _suggest(probe: Callable[..., Probe], target: int, pred: Prediction, alloc_conf: Any) -> list[Suggestion]:
    """The cheapest changes that make `target` fit: every single change that does, else every
    pair, else all three (allocator options are tried alone, when only fragmentation fails)."""
    out: list[Suggestion] = []
    # Fragmentation: the live bytes would fit but the reserved segments do not.
    if pred.oom and pred.oom.get("allocated", 0) + pred.oom.get("size", 0) <= pred.usable:
        for option, cost in _ALLOCATOR_OPTIONS:
            base = _conf_text(alloc_conf)
            if base and option.split(":")[0] in base:
                continue  # the user's own setting stays
            conf = option if not base else f"{base},{option}"
            p = probe(target, conf)
            if p.fits:
                out.append(Suggestion(f"PYTORCH_CUDA_ALLOC_CONF={conf}", {"alloc_conf": conf}, p.prediction, cost))
                break
    blocks = probe(target, alloc_conf, True).prediction.checkpointed_blocks
    found: dict[frozenset[str], int] = {}  # techniques (without accumulation) -> micro-batches needed
    for combo in [("amp",), ("accumulate",), ("checkpoint",), ("amp", "accumulate"), ("amp", "checkpoint"),
                  ("checkpoint", "accumulate"), ("amp", "checkpoint", "accumulate")]:
        if "checkpoint" in combo and not blocks:
            continue  # no stack of repeated blocks to checkpoint
        techniques = frozenset(c for c in combo if c != "accumulate")
        # A combination is worth reporting only if every smaller one needs more micro-batches.
        if any(t <= techniques and t != techniques for t in found if found[t] == 1):
            continue
        s = _try(probe, target, alloc_conf, combo, blocks)
        if s is None:
            continue
        k = s.settings.get("accumulation_steps", 1)
        if any(t <= techniques and found[t] <= k for t in found):
            continue
        found[techniques] = k
        out.append(s)
    return out


_AMP_COST = ("the forward under torch.autocast(\"cuda\", dtype=torch.bfloat16) (float16 takes the same memory and "
             "needs a GradScaler); weights, gradients and optimizer state stay float32; usually faster on tensor cores")


def _try(probe: Callable[..., Probe], target: int, alloc_conf: Any, combo: tuple[str, ...],
         blocks: str) -> Suggestion | None:
    """Probe one combination; with "accumulate", the fewest micro-batches (dividing the target)
    that fit."""
    import torch

    amp = torch.bfloat16 if "amp" in combo else None
    ckpt = "checkpoint" in combo
    if "accumulate" in combo:
        sizes = [(target // k, k) for k in range(2, target + 1) if target % k == 0]
    else:
        sizes = [(target, 1)]
    for micro, k in sizes:
        p = probe(micro, alloc_conf, ckpt, amp)
        if not p.fits:
            continue
        count = total = p.prediction.checkpointed_count
        if ckpt and k == 1:
            # The fewest blocks that suffice, first ones first: fewer recomputed forwards.
            lo, hi = 0, total  # checkpointing lo blocks does not fit (0: nothing known), hi does
            while hi - lo > 1:
                mid = (lo + hi) // 2
                q = probe(micro, alloc_conf, mid, amp)
                if q.fits:
                    hi, p = mid, q
                else:
                    lo = mid
            count = hi
        settings: dict[str, Any]
        parts, costs, settings = [], [], {}
        if amp is not None:
            parts.append("bf16 autocast")
            costs.append(_AMP_COST)
            settings["autocast"] = "bfloat16"
        if ckpt:
            which = "every block" if count == total else f"the first {count} of the {total} blocks"
            parts.append(f"activation checkpointing of {which} in {blocks}")
            costs.append(f"the backward recomputes those blocks' forwards: {count} block forward(s) more per step, "
                         f"{count / total:.0%} of a forward pass of {blocks} "
                         "(torch.utils.checkpoint(block, x, use_reentrant=False) around each)")
            settings["checkpoint_blocks"] = blocks
            settings["checkpointed_count"] = count
        if k > 1:
            parts.append(f"gradient accumulation: {k} micro-batches of {micro}")
            costs.append(f"{k} forward/backward passes per optimizer step (same samples, smaller kernels; gradients "
                         "stay allocated between micro-batches, as in this step)")
            settings.update(micro_batch_size=micro, accumulation_steps=k)
        return Suggestion(" + ".join(parts), settings, p.prediction, "; ".join(costs))
    return None
