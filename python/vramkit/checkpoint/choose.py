"""Which blocks ``apply`` checkpoints, and how: each plan is priced by the C simulator.

A block is stored (autograd keeps what it saves), checkpointed whole (only its input is kept,
its forward reruns in the backward), or checkpointed selectively at a level of its ``ladder``
(its input and the outputs of the saved op types are kept; the rest reruns). The schedule of a
plan is the one torch runs: the forwards in order, the loss, then the backwards in reverse, each
whole-checkpointed block recomputed just before its backward (FC(i) ... FA(i) B(i)); a selective
block is FA(i) ... B(i) of its ``selective_stage``.

Both searches are greedy on the predicted peak lowered per second of recomputation added, then
undo what the budget does not need; ``choose`` keeps the selective plan only when it recomputes
less than the best whole-block plan, so allowing selective checkpointing never makes a plan
worse by the model's own count.
"""

from __future__ import annotations

from typing import Any, Sequence

from . import planner as _ck
from .selective import SelectiveLevel, selective_stage

__all__ = ["Plan", "block_schedule", "choose", "select_whole"]

STORED = -1  # a block's option: stored; 0 is whole-block checkpointing, k >= 1 a ladder level


def block_schedule(n: int, whole: set[int]) -> list[tuple[str, int]]:
    """The ops torch runs for ``n`` blocks of which ``whole`` are checkpointed whole."""
    ops = [("forward_check" if i in whole else "forward_all", i) for i in range(n)] + [("loss", n)]
    for i in reversed(range(n)):
        if i in whole:
            ops.append(("forward_all", i))
        ops.append(("backward", i))
    return ops


def _too_small(least: int, budget: int, n: int) -> _ck.BudgetTooSmallError:
    return _ck.BudgetTooSmallError(
        f"budget {budget:,} bytes is below what checkpointing every block needs: {least:,} bytes are predicted "
        f"with all {n} blocks checkpointed", least, budget)


def select_whole(stages: Sequence[_ck.Stage], out_bytes: int, offset: int, budget: int,
                 loss: _ck.Stage | None = None) -> tuple[list[int], int]:
    """Whole blocks only: (the blocks to checkpoint, predicted peak). Raises BudgetTooSmallError."""
    n = len(stages)

    def peak(c: set[int]) -> int:
        return offset + int(_ck.simulate(stages, block_schedule(n, c), output_bytes=None if loss else out_bytes,
                                         loss=loss)[1])

    chosen: set[int] = set()
    current = peak(chosen)
    least = peak(set(range(n)))
    if least > budget:
        raise _too_small(least, budget, n)
    while current > budget:
        best: tuple[Any, int, int] | None = None  # (sort key, or None for the fallback; block; peak)
        for i in range(n):
            if i in chosen:
                continue
            p = peak(chosen | {i})
            gain = (current - p) / max(stages[i].fwd_time, 1e-9)
            key = (gain, current - p, i)
            if best is None or key > best[0]:
                best = (key, i, p)
        assert best is not None  # current > budget >= least: some block is not chosen yet
        if best[0][1] <= 0:  # nothing lowers it on its own: take the block keeping the most
            i = max((k for k in range(n) if k not in chosen), key=lambda k: stages[k].saved_bytes)
            best = (None, i, peak(chosen | {i}))
        chosen.add(best[1])
        current = best[2]
    for i in sorted(chosen, key=lambda k: -stages[k].fwd_time):  # drop what is not needed
        p = peak(chosen - {i})
        if p <= budget:
            chosen.discard(i)
            current = p
    return sorted(chosen), current


class Plan:
    """``options[i]``: STORED, 0 (whole) or a level of block i's ladder; ``peak`` predicted
    (bytes), ``recompute_time`` (seconds per step), ``saved_ops`` (block -> ops saved, for the
    selective ones), ``whole_block_recompute_time`` (the whole-block plan's, for comparison)."""

    def __init__(self, options: list[int], ladders: Sequence[Sequence[SelectiveLevel]], peak: int,
                 recompute_time: float, whole_block_recompute_time: float | None):
        self.options = options
        self.peak = peak
        self.recompute_time = recompute_time
        self.whole_block_recompute_time = whole_block_recompute_time
        self.checkpointed = [i for i, o in enumerate(options) if o != STORED]
        self.saved_ops = {i: ladders[i][o].ops for i, o in enumerate(options) if o > 0}


def choose(stages: Sequence[_ck.Stage], ladders: Sequence[Sequence[SelectiveLevel]] | None, out_bytes: int,
           offset: int, budget: int, loss: _ck.Stage | None = None) -> Plan:
    """The plan for ``budget`` (bytes; ``offset`` is the memory of the rest of the model that
    lives through the whole step, ``loss`` the head and loss as one more stage). With
    ``ladders`` None, whole blocks only. Raises BudgetTooSmallError."""
    n = len(stages)
    whole, whole_peak = select_whole(stages, out_bytes, offset, budget, loss)
    whole_time = float(sum(stages[i].fwd_time for i in whole))
    whole_plan = Plan([0 if i in whole else STORED for i in range(n)], ladders or [[]] * n, whole_peak,
                      whole_time, None)
    if ladders is None or all(len(lad) <= 1 for lad in ladders):
        return whole_plan
    next_in = [stages[i + 1].input_bytes for i in range(n - 1)] + [out_bytes]
    cache: dict[tuple[int, ...], int] = {}

    def peak(cfg: tuple[int, ...]) -> int:
        if cfg not in cache:
            st = [selective_stage(stages[i], ladders[i][o], next_in[i]) if o > 0 else stages[i]
                  for i, o in enumerate(cfg)]
            sched = block_schedule(n, {i for i, o in enumerate(cfg) if o == 0})
            cache[cfg] = offset + int(_ck.simulate(st, sched, output_bytes=None if loss else out_bytes, loss=loss)[1])
        return cache[cfg]

    def cost(i: int, o: int) -> float:
        if o == STORED:
            return 0.0
        return max(0.0, stages[i].fwd_time - ladders[i][o].saved_time)

    def options(i: int) -> list[int]:
        return [STORED, *range(len(ladders[i]))]

    cfg = tuple([STORED] * n)
    current = peak(cfg)
    while current > budget:
        best: tuple[float, int, int, int] | None = None  # (gain per second, peak lowered, block, option)
        for i in range(n):
            for o in options(i):
                extra = cost(i, o) - cost(i, cfg[i])
                if extra <= 0:
                    continue
                p = peak(cfg[:i] + (o,) + cfg[i + 1:])
                if p >= current:
                    continue
                key = ((current - p) / max(extra, 1e-12), current - p, -i, -o)
                if best is None or key > best:
                    best = key
        if best is None:  # no single move lowers the peak: checkpoint whole the block keeping the most
            rest = [i for i in range(n) if cfg[i] != 0]
            if not rest:
                break
            i = max(rest, key=lambda k: stages[k].saved_bytes)
            cfg = cfg[:i] + (0,) + cfg[i + 1:]
        else:
            i, o = -best[2], -best[3]
            cfg = cfg[:i] + (o,) + cfg[i + 1:]
        current = peak(cfg)
    if current > budget:
        return whole_plan
    improved = True
    while improved:  # undo recomputation the budget does not need, the largest saving first
        improved = False
        moves = [(cost(i, cfg[i]) - cost(i, o), i, o) for i in range(n) for o in options(i)
                 if cost(i, o) < cost(i, cfg[i])]
        for _, i, o in sorted(moves, reverse=True):
            trial = cfg[:i] + (o,) + cfg[i + 1:]
            if peak(trial) <= budget:
                cfg, current, improved = trial, peak(trial), True
                break
    total = float(sum(cost(i, o) for i, o in enumerate(cfg)))
    if total >= whole_time:
        whole_plan.whole_block_recompute_time = whole_time
        return whole_plan
    return Plan(list(cfg), ladders, current, total, whole_time)
