"""The checkpoint planner: a chain of ``Stage``s and a budget go to the C planner, which
returns the ``Schedule`` with the least compute that fits (``plan``); ``simulate`` and
``min_budget`` price a schedule and a chain. The execution model is in docs/checkpoint_model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .. import _C

__all__ = ["ALGORITHMS", "BudgetTooSmallError", "Op", "Schedule", "Stage", "min_budget", "plan", "simulate"]

ALGORITHMS = {"optimal": 0, "revolve": 1, "sqrt": 2, "segments": 3, "none": 4}
OP_NAMES = ("forward_nosave", "forward_check", "forward_all", "loss", "backward")
_SHORT = ("Fn", "Fck", "Fall", "Loss", "B")
# A Stage as the C planner takes it: Stage.as_tuple()
_StageTuple = tuple[float, float, int, int, int, int, int]


class BudgetTooSmallError(ValueError):
    """No schedule of the chosen algorithm fits the budget; ``min_budget`` is the least that does."""

    def __init__(self, message: str, min_budget: int, budget: int):
        super().__init__(message)
        self.min_budget = min_budget
        self.budget = budget


@dataclass(frozen=True)
class Stage:
    """One stage of a sequential chain. Times in any unit (seconds from ``profile``), sizes in bytes.

    ``saved_bytes`` is what the stage's backward needs, its input included (so it is at least
    ``input_bytes``); ``fwd_tmp``/``bwd_tmp`` are transient bytes during a forward that saves
    nothing (a recomputation under no_grad) and during the backward; ``fwd_all_tmp`` is the
    transient of a forward that saves, beyond what it saves (default: ``fwd_tmp``; usually less,
    since what a no-grad forward frees as it goes is kept then).
    """

    fwd_time: float
    bwd_time: float
    input_bytes: int
    saved_bytes: int
    fwd_tmp: int = 0
    bwd_tmp: int = 0
    fwd_all_tmp: int | None = None

    def __post_init__(self) -> None:
        if self.fwd_all_tmp is None:
            object.__setattr__(self, "fwd_all_tmp", self.fwd_tmp)
        for name in ("fwd_time", "bwd_time"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Stage.{name} must be a finite number >= 0, got {v!r}")
        for name in ("input_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp", "fwd_all_tmp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Stage.{name} must be an int >= 0 (bytes), got {v!r}")
        if self.saved_bytes < self.input_bytes:
            raise ValueError(f"Stage.saved_bytes ({self.saved_bytes}) must include the input "
                             f"(input_bytes {self.input_bytes})")

    def as_tuple(self) -> _StageTuple:
        assert self.fwd_all_tmp is not None  # set by __post_init__
        return (float(self.fwd_time), float(self.bwd_time), self.input_bytes, self.saved_bytes, self.fwd_tmp,
                self.bwd_tmp, self.fwd_all_tmp)


@dataclass(frozen=True)
class Op:
    kind: str   # one of OP_NAMES
    stage: int  # the stage index; len(stages) for "loss"

    def __repr__(self) -> str:
        short = _SHORT[OP_NAMES.index(self.kind)]
        return short if self.kind == "loss" else f"{short}{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """A planned schedule: ``ops`` in order, with the simulator's ``predicted_time`` (sum of
    stage times) and ``predicted_peak`` (bytes, the chain input included)."""

    ops: tuple[Op, ...]
    predicted_time: float
    predicted_peak: int
    algorithm: str
    budget: int
    num_stages: int

    def __repr__(self) -> str:
        shown = " ".join(map(repr, self.ops[:40])) + (" ..." if len(self.ops) > 40 else "")
        return (f"Schedule({self.algorithm}, {self.num_stages} stages, budget {self.budget:,} B: predicted time "
                f"{self.predicted_time:.6g}, peak {self.predicted_peak:,} B, {len(self.ops)} ops: {shown})")

    def count(self, kind: str) -> int:
        return sum(op.kind == kind for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "budget": self.budget, "num_stages": self.num_stages,
                "predicted_time": self.predicted_time, "predicted_peak": self.predicted_peak,
                "ops": [[op.kind, op.stage] for op in self.ops]}


def _as_stage(s: Any, what: str) -> Stage:
    """A Stage from a Stage, a tuple/list of its fields or a dict of them; errors name ``what``."""
    if isinstance(s, Stage):
        return s
    try:
        return Stage(*s) if isinstance(s, (tuple, list)) else Stage(**s)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None


def _stage_tuples(stages: Iterable[Any]) -> list[_StageTuple]:
    if isinstance(stages, (str, bytes)) or not hasattr(stages, "__iter__"):
        raise TypeError(f"stages must be a list of Stage, got {type(stages).__name__}")
    out = [_as_stage(s, f"stage {i}").as_tuple() for i, s in enumerate(stages)]
    if not out:
        raise ValueError("stages is empty: a chain needs at least one stage")
    return out


def _loss_tuple(tuples: Sequence[_StageTuple], output_bytes: int | None, loss: Any) -> _StageTuple:
    """The loss as one more stage. Without ``loss`` it costs nothing and keeps nothing, and
    reads an output of ``output_bytes`` (default: the size of the last stage's input)."""
    if output_bytes is not None and (isinstance(output_bytes, bool) or not isinstance(output_bytes, int)
                                     or output_bytes < 0):
        raise ValueError(f"output_bytes must be an int >= 0, got {output_bytes!r}")
    if loss is None:
        out = tuples[-1][2] if output_bytes is None else output_bytes
        return (0.0, 0.0, out, out, 0, 0, 0)
    loss_stage = _as_stage(loss, "loss")
    if output_bytes is not None and output_bytes != loss_stage.input_bytes:
        raise ValueError(f"output_bytes ({output_bytes}) and loss.input_bytes ({loss_stage.input_bytes}) disagree: "
                         "both are the size of the chain's output; give one")
    return loss_stage.as_tuple()


def plan(stages: Sequence[Stage], budget: int | None, algorithm: str = "optimal", slots: int = 500,
         segments: int | None = None, output_bytes: int | None = None, loss: Stage | None = None) -> Schedule:
    """The schedule of ``algorithm`` for ``stages`` within ``budget`` bytes (chain input included).

    ``loss`` is the loss function as one more ``Stage`` (``input_bytes`` the chain's output,
    ``saved_bytes`` what it keeps for its backward, e.g. cross-entropy's softmax; see
    ``profile_loss``), so the budget covers its memory too; without it the loss is free and
    reads ``output_bytes`` (default: the last stage's ``input_bytes``).

    ``budget=None`` is allowed for the fixed algorithms ("none", "sqrt", "segments", and
    "revolve" with a snapshot per stage). ``slots`` discretises memory for "optimal" (sizes round
    up, so the plan never exceeds the budget). Raises ``BudgetTooSmallError`` (a ValueError
    carrying ``min_budget``) when nothing fits.
    """
    tuples = _stage_tuples(stages)
    loss_t = _loss_tuple(tuples, output_bytes, loss)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r} (allowed: {', '.join(ALGORITHMS)})")
    if budget is None:
        if algorithm == "optimal":
            raise ValueError("the optimal planner needs a budget in bytes")
        budget = 0
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int (bytes), got {budget!r}")
    if algorithm == "segments":
        if segments is None:
            raise ValueError("algorithm='segments' needs segments=k")
        if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(tuples):
            raise ValueError(f"segments must be an int in 1..{len(tuples)}, got {segments!r}")
    elif segments is not None:
        raise ValueError("segments= only applies to algorithm='segments'")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 100_000:
        raise ValueError(f"slots must be an int in 1..100000, got {slots!r}")
    result = _C.ckpt_plan(tuples, loss_t, budget, ALGORITHMS[algorithm], segments or 0, slots)
    if result[0] is None:
        _, least, why = result
        raise BudgetTooSmallError(f"{algorithm}: {why}; the least budget that works is {least:,} bytes", least,
                                  budget)
    ops, time, peak = result
    return Schedule(tuple(Op(OP_NAMES[k], s) for k, s in ops), time, peak, algorithm, budget, len(tuples))


def simulate(stages: Sequence[Stage], ops: Iterable[Any], output_bytes: int | None = None,
             loss: Stage | None = None) -> tuple[float, int]:
    """Replay ops ((kind, stage) pairs or Op) through the C simulator: (time, peak bytes)."""
    tuples = _stage_tuples(stages)
    pairs = []
    for op in ops:
        kind, stage = (op.kind, op.stage) if isinstance(op, Op) else op
        pairs.append((OP_NAMES.index(kind) if isinstance(kind, str) else int(kind), int(stage)))
    return _C.ckpt_simulate(tuples, _loss_tuple(tuples, output_bytes, loss), pairs)


def min_budget(stages: Sequence[Stage], output_bytes: int | None = None, loss: Stage | None = None) -> int:
    """The least budget (bytes) any schedule needs; ``plan`` succeeds at exactly this budget."""
    tuples = _stage_tuples(stages)
    return _C.ckpt_min_budget(tuples, _loss_tuple(tuples, output_bytes, loss))
