"""Selective activation checkpointing for ``apply``: which operator types a checkpointed block
saves, what that keeps and what it still recomputes.

A block under torch's selective checkpointing (``create_selective_checkpoint_contexts`` with a
list of ops) keeps, from its forward to its backward, its input and the outputs of every call of
the listed ops; everything else is recomputed in the backward. So saving the matmuls of a
transformer block and recomputing its pointwise ops (norms, activations, dropout) costs the
matmul outputs in memory and the cheap ops in time.

``profile_ops`` runs a block once per repeat under a dispatch mode and prices each operator type
(an ``OpOverload``): the bytes its outputs would keep and the forward time it would spare. Some
types are never saved, because torch's cache would then be wrong or useless:

- ops whose output aliases an input (views, in-place ops): they keep nothing new;
- random ops (dropout): checkpoint restores the RNG state before recomputing, so the random ops
  must all be recomputed together to draw the same numbers again;
- ops any of whose outputs a later op of the block changes in place: torch refuses a cached
  tensor that was mutated;
- ops returning something other than fresh tensors.

``ladder`` orders the other types by forward seconds spared per byte kept and returns the
levels "save the first k types"; level 0 is whole-block checkpointing. ``selective_stage`` turns
a block's ``Stage`` and a level into the ``Stage`` that the C simulator replays as FA(i) then
B(i): the forward keeps ``input + kept`` bytes, and the backward first recomputes the rest (its
transient then covers the recomputed tape), which at level 0 gives exactly the peaks of
FC(i) ... FA(i) B(i) (tests/unit/test_checkpoint_selective.py checks this).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from . import planner as _ck

__all__ = ["OpCost", "SelectiveLevel", "ladder", "profile_ops", "selective_contexts", "selective_stage"]

# What torch's selective checkpointing itself lets through uncached (it sees a different number
# of them in the forward and in the recomputation), so they are not priced either.
_PASS_THROUGH = {torch.ops.aten.detach.default, torch.ops.prim.device.default}


@dataclass(frozen=True)
class OpCost:
    """One operator type of a block: ``calls`` per forward, ``kept_bytes`` its outputs would keep
    if saved, ``time`` the forward seconds of all its calls (scaled so the types of a block add up
    to the block's measured forward time), ``never_saved`` why it cannot be saved ("" if it can)."""

    op: Any  # torch._ops.OpOverload
    calls: int
    kept_bytes: int
    time: float
    never_saved: str = ""

    @property
    def name(self) -> str:
        return str(self.op)


@dataclass(frozen=True)
class SelectiveLevel:
    """Save the outputs of ``ops`` (recompute the rest): keeps ``kept_bytes`` more than whole-block
    checkpointing and spares ``saved_time`` seconds of its recomputation."""

    ops: tuple[Any, ...]
    kept_bytes: int
    saved_time: float

    @property
    def names(self) -> list[str]:
        return [str(op) for op in self.ops]


def _storages(obj: Any) -> list[torch.UntypedStorage] | None:
    """The storages of the tensors in ``obj`` (None if it holds anything that is not a tensor)."""
    flat, _ = tree_flatten(obj)
    out = []
    for t in flat:
        if not isinstance(t, torch.Tensor):
            return None
        out.append(t.untyped_storage())
    return out


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes to (in-place and out= ops), from its schema."""
    written: list[torch.Tensor] = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        flat, _ = tree_flatten(value)
        written.extend(t for t in flat if isinstance(t, torch.Tensor))
    return written


class _OpRecorder(TorchDispatchMode):
    """Times every op of one forward and notes what it creates and what it overwrites."""

    def __init__(self, sync: Callable[[], None], inputs: set[int]):
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.sync = sync
        self.seen: set[int] = set(inputs)  # storages that exist: the block's inputs, then outputs
        self.keep: list[torch.UntypedStorage] = []  # alive until the end, so no address is reused
        self.maker: dict[int, Any] = {}  # storage address -> the op type that created it
        self.made_bytes: dict[int, int] = {}  # storage address -> its bytes
        self.calls: list[tuple[Any, float, int, str]] = []  # (op, seconds, new bytes, never_saved)
        self.mutated_makers: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PASS_THROUGH:
            return func(*args, **kwargs)
        for t in _written_args(func, args, kwargs):
            maker = self.maker.get(t.untyped_storage().data_ptr())
            if maker is not None:
                self.mutated_makers.add(maker)
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        seconds = time.perf_counter() - t0
        why = ""
        new = 0
        storages = _storages(out)
        if torch.Tag.nondeterministic_seeded in func.tags:
            why = "random: recomputed with the restored RNG state"
        elif storages is None or not storages:
            why = "returns something other than tensors"
        else:
            flat_in, _ = tree_flatten((args, kwargs))
            inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
            for st in storages:
                ptr = st.data_ptr()
                if ptr in self.seen or ptr in inputs:
                    why = "its output aliases an input (a view or an in-place op)"
                    continue
                self.seen.add(ptr)
                self.keep.append(st)
                self.maker[ptr] = func
                self.made_bytes[ptr] = int(st.nbytes())
                new += int(st.nbytes())
        self.calls.append((func, seconds, new, why))
        return out


def profile_ops(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, forward_time: float,
                repeats: int = 2) -> list[OpCost]:
    """Price each operator type of ``fn(x)`` (a block with its other arguments fixed), run with
    autograd on as under checkpoint. Times are the fastest of ``repeats`` runs, scaled to sum to
    ``forward_time`` (the block's forward as ``profile`` measured it without a dispatch mode).
    The block's output is not counted as kept: it exists anyway, as the next block's input."""
    sync: Callable[[], None] = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best: dict[Any, float] = {}
    last: _OpRecorder | None = None
    for _ in range(max(1, repeats)):
        inp = x.detach().requires_grad_(x.is_floating_point() or x.is_complex())
        rec = _OpRecorder(sync, {inp.untyped_storage().data_ptr()})
        with torch.enable_grad(), rec:
            out = fn(inp)
        per_type: dict[Any, float] = {}
        for op, s, _, _ in rec.calls:
            per_type[op] = per_type.get(op, 0.0) + s
        for op, s in per_type.items():
            best[op] = min(best.get(op, s), s)
        out_ptrs = {st.data_ptr() for st in (_storages(out) or [])}
        last = rec
        del out, inp
    assert last is not None
    total = sum(best.values()) or 1.0
    scale = forward_time / total if forward_time > 0 else 1.0
    costs: dict[Any, list[Any]] = {}  # op -> [calls, bytes, why]
    for op, _, new, why in last.calls:
        entry = costs.setdefault(op, [0, 0, ""])
        entry[0] += 1
        entry[1] += new
        entry[2] = entry[2] or why
    # the block's output exists anyway (it is the next block's input): not counted as kept
    for ptr in out_ptrs:
        if ptr in last.maker:
            costs[last.maker[ptr]][1] -= last.made_bytes[ptr]
    result = []
    for op, (calls, nbytes, why) in costs.items():
        if not why and op in last.mutated_makers:
            why = "a later op changes its output in place"
        result.append(OpCost(op, calls, nbytes, best[op] * scale, why))
    last.keep.clear()
    return result


def ladder(costs: Sequence[OpCost], max_levels: int = 12) -> list[SelectiveLevel]:
    """The levels "save the first k types" for k = 0 (whole-block checkpointing) up to
    ``max_levels`` types, in order of forward seconds spared per byte kept. Types that take no
    time are left out (saving them spares nothing)."""
    ok = [c for c in costs if not c.never_saved and c.time > 0]
    ok.sort(key=lambda c: (-(c.time / max(c.kept_bytes, 1)), c.name))
    levels = [SelectiveLevel((), 0, 0.0)]
    ops: list[Any] = []
    kept, spared = 0, 0.0
    for c in ok[:max_levels]:
        ops.append(c.op)
        kept += c.kept_bytes
        spared += c.time
        levels.append(SelectiveLevel(tuple(ops), kept, spared))
    return levels


def selective_stage(stage: _ck.Stage, level: SelectiveLevel, next_input_bytes: int) -> _ck.Stage:
    """The ``Stage`` whose FA(i) then B(i) in the simulator is the block under ``level``: its
    forward keeps the input and ``level.kept_bytes`` (transient as a forward that saves nothing);
    its backward recomputes the rest first (the time not spared, and a transient covering the
    recomputed tape and the recomputation's own transient) and then runs as before.
    ``next_input_bytes`` is the size of the block's output (the next stage's input)."""
    a = stage.input_bytes
    tape = stage.saved_bytes - a
    fat = stage.fwd_all_tmp if stage.fwd_all_tmp is not None else stage.fwd_tmp
    recompute = max(0.0, stage.fwd_time - level.saved_time)
    bwd_tmp = max(0, tape - level.kept_bytes) + max(stage.bwd_tmp, next_input_bytes + fat - a)
    return _ck.Stage(stage.fwd_time, stage.bwd_time + recompute, a, a + level.kept_bytes, stage.fwd_tmp,
                     bwd_tmp, stage.fwd_tmp)


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager[Any],
          second: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


def selective_contexts(ops: Sequence[Any], recompute_extra: contextlib.AbstractContextManager[Any] | None = None
                       ) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """torch's selective-checkpoint context pair for saving ``ops`` (fresh for each call, as
    torch requires), with ``recompute_extra`` entered around the recomputation, outside torch's
    context (whose dispatch mode would otherwise see the extra context's own ops)."""
    fwd, rec = create_selective_checkpoint_contexts(list(ops))
    if recompute_extra is None:
        return fwd, rec
    return fwd, _both(recompute_extra, rec)
