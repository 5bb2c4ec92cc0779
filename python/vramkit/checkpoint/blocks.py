"""``vramkit.checkpoint.apply``: budget-planned checkpointing of a model's repeated blocks.

The model's forward stays the user's (any loop, kwargs, residuals). ``apply``:

1. finds the blocks (``find_blocks``: the class whose runs of same-class siblings in
   ``nn.ModuleList``/``nn.Sequential`` containers hold the most parameters, or ``blocks=``);
2. runs ``sample_input`` once to capture each block's arguments, and once more (forward, loss,
   backward) under ``vramkit.torch.track`` for the measured peak of storing everything;
3. measures each block as a chain ``Stage`` (``profile``'s machinery, on its captured input);
4. evaluates, with the C simulator (``simulate``), the schedule that wrapping a set C of blocks
   in ``checkpoint`` runs: FC(i) for i in C and FA(i) otherwise in the forward, then LOSS, then
   FA(i) B(i) for i in C and B(i) otherwise. The rest of the model (embedding, head, loss) is
   the measured peak minus the simulated peak of storing everything, added to every
   prediction. A greedy search adds the block that lowers the predicted peak most per second
   of recomputation until the prediction fits, then drops blocks that are not needed;
5. wraps the chosen blocks' ``forward`` in ``checkpoint(...)`` (BatchNorm statistics are
   restored after each recomputation, so they are updated once per step as without it).

``CheckpointHandle.remove()`` undoes the wrapping.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from . import planner as _ck
from . import selective as _sel
from .choose import block_schedule, choose
from .function import checkpoint
from .profiling import _profile
from ..torch.meters import track

__all__ = ["CheckpointHandle", "apply", "find_blocks"]


# ----------------------------------------------------------------------------- finding blocks


def _param_count(mods: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in mods:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def find_blocks(model: nn.Module, blocks: Any = None) -> list[tuple[str, nn.Module]]:
    """The blocks to consider, as ``(name, module)`` pairs in forward order.

    ``blocks=None``: runs of at least two consecutive same-class children of ``nn.ModuleList``
    and ``nn.Sequential`` containers are grouped by class; the class whose runs hold the most
    parameters wins (a transformer's layers, a ResNet's residual blocks across its stages).
    ``blocks`` may also be a submodule name ("layers", "transformer.h": its children, or the
    module itself if it is no container), or a list of modules or names."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        runs: dict[type[nn.Module], list[nn.Module]] = {}
        for _, c in model.named_modules():
            if not isinstance(c, (nn.ModuleList, nn.Sequential)):
                continue
            kids = list(c.children())
            i = 0
            while i < len(kids):
                j = i
                while j + 1 < len(kids) and type(kids[j + 1]) is type(kids[i]):
                    j += 1
                if j > i:
                    runs.setdefault(type(kids[i]), []).extend(kids[i:j + 1])
                i = j + 1
        scored = [(_param_count(ms), len(ms), cls) for cls, ms in runs.items()]
        scored = [s for s in scored if s[0] > 0]
        if not scored:
            raise ValueError(f"{type(model).__name__}: no repeated blocks found (no run of two or more same-class "
                             "modules with parameters in an nn.ModuleList or nn.Sequential); name them with "
                             "blocks='layers' or blocks=[module, ...]")
        best = max(scored, key=lambda s: (s[0], s[1]))[2]
        chosen = runs[best]
    elif isinstance(blocks, str):
        try:
            sub = model.get_submodule(blocks)
        except AttributeError:
            raise ValueError(f"blocks={blocks!r}: no such submodule of {type(model).__name__} (allowed: a name "
                             "from model.named_modules(), or a list of modules)") from None
        chosen = list(sub.children()) if isinstance(sub, (nn.ModuleList, nn.Sequential)) else [sub]
    elif isinstance(blocks, (list, tuple, nn.ModuleList)):
        chosen = []
        for k, b in enumerate(blocks):
            if isinstance(b, str):
                b = find_blocks(model, b)
                chosen.extend(m for _, m in b)
            elif isinstance(b, nn.Module):
                chosen.append(b)
            else:
                raise TypeError(f"blocks[{k}] must be an nn.Module or a submodule name, got {type(b).__name__}")
    else:
        raise TypeError(f"blocks must be None, a submodule name or a list of modules, got {type(blocks).__name__}")
    out, ids = [], set()
    for m in chosen:
        if id(m) not in names:
            raise ValueError(f"blocks: a {type(m).__name__} that is not a submodule of the model")
        if id(m) in ids:
            continue
        if m is model:
            raise ValueError("blocks: the model itself cannot be one of its blocks")
        ids.add(id(m))
        out.append((names[id(m)], m))
    if not out:
        raise ValueError(f"blocks={blocks!r} names no modules")
    return out


# ----------------------------------------------------------------------------- wrapping


@contextlib.contextmanager
def _keep_norm_stats(module: nn.Module) -> Iterator[None]:
    """Put BatchNorm running statistics back after a recomputation updated them again."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.training]
    saved = [[b.detach().clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bs in zip(norms, saved):
                for b, v in zip(m.buffers(recurse=False), bs):
                    b.copy_(v)


class _Checkpointed:
    """The instance ``forward`` of a wrapped block: its own forward under ``checkpoint``; with
    ``saved_ops``, under torch's selective checkpointing saving the outputs of those ops."""

    def __init__(self, module: nn.Module, saved_ops: Sequence[Any] = ()):
        self.module = module
        self.saved_ops = tuple(saved_ops)
        self.inner = type(module).forward.__get__(module)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        if self.saved_ops:
            return _sel.selective_contexts(self.saved_ops, _keep_norm_stats(self.module))
        return contextlib.nullcontext(), _keep_norm_stats(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)


class CheckpointHandle:
    """What ``apply`` did: ``blocks`` (names, forward order), ``checkpointed`` (names of the
    wrapped ones), ``selective`` (for those checkpointed selectively: block name -> the ops whose
    outputs they save, e.g. ``["aten.mm.default", "aten.addmm.default"]``; the others recompute
    their whole forward), ``predicted_peak`` / ``full_peak`` / ``budget`` (bytes of activation
    memory: planned, measured storing everything, allowed), ``recompute_time`` (seconds of
    forward per step added), ``whole_block_recompute_time`` (what the best plan found with whole
    blocks only would add, for comparison; None with ``selective=False``), ``stages``.
    ``remove()`` (or leaving a ``with`` block) unwraps them."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], chosen: list[int], stages: list[_ck.Stage],
                 predicted_peak: int, full_peak: int, budget: int, recompute_time: float,
                 saved_ops: dict[int, tuple[Any, ...]] | None = None,
                 whole_block_recompute_time: float | None = None):
        saved_ops = saved_ops or {}
        self.blocks = [n for n, _ in blocks]
        self.checkpointed = [blocks[i][0] for i in chosen]
        self.selective = {blocks[i][0]: [str(op) for op in saved_ops[i]] for i in chosen if saved_ops.get(i)}
        self.stages = stages
        self.predicted_peak = predicted_peak
        self.full_peak = full_peak
        self.budget = budget
        self.recompute_time = recompute_time
        self.whole_block_recompute_time = whole_block_recompute_time
        self._modules = [blocks[i][1] for i in chosen]
        for i in chosen:
            m = blocks[i][1]
            m.forward = _Checkpointed(m, saved_ops.get(i, ()))

    def remove(self) -> None:
        for m in self._modules:
            if isinstance(m.__dict__.get("forward"), _Checkpointed):
                del m.forward
        self._modules = []

    def __enter__(self) -> "CheckpointHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "checkpointed": self.checkpointed, "selective": self.selective,
                "predicted_peak": self.predicted_peak, "full_peak": self.full_peak, "budget": self.budget,
                "recompute_time": self.recompute_time, "whole_block_recompute_time": self.whole_block_recompute_time}

    def __repr__(self) -> str:
        sel = f", {len(self.selective)} of them selectively" if self.selective else ""
        return (f"CheckpointHandle({len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed{sel} "
                f"{self.checkpointed}; predicted activation peak {self.predicted_peak:,} B within budget "
                f"{self.budget:,} B; storing everything measured {self.full_peak:,} B)")


# ----------------------------------------------------------------------------- apply


def _call(model: nn.Module, sample_input: Any) -> Any:
    if isinstance(sample_input, dict):
        return model(**sample_input)
    if isinstance(sample_input, (tuple, list)):
        return model(*sample_input)
    return model(sample_input)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    if isinstance(obj, dict):
        return _first_tensor(list(obj.values()))
    return None


def _default_loss(out: Any) -> torch.Tensor:
    t = _first_tensor(out)
    if t is None:
        raise TypeError(f"the model returned {type(out).__name__} with no Tensor in it; pass loss_fn=")
    return t.sum()


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """RNG state, buffers and parameter gradients as they were; gradients start at zero inside
    so the measured peak leaves them out (they are not activations)."""
    rng = torch.get_rng_state()
    cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else p.grad
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        for d, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, d)
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        for p, g in grads:
            p.grad = g


def _capture(model: nn.Module, blocks: list[tuple[str, nn.Module]],
             sample_input: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    got: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def hook(i: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            got.setdefault(i, (args, kwargs))
        return pre

    hs = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, (_, m) in enumerate(blocks)]
    try:
        with torch.no_grad(), _restored(model):
            _call(model, sample_input)
    finally:
        for h in hs:
            h.remove()
    missing = [blocks[i][0] for i in range(len(blocks)) if i not in got]
    if missing:
        raise ValueError(f"blocks {missing} did not run in the model's forward on sample_input")
    for i, (args, _) in got.items():
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"block {blocks[i][0]!r}: its first positional argument must be a Tensor (the "
                            "activation it transforms) for apply() to measure it")
    return [got[i] for i in range(len(blocks))]


class _BlockFn:
    """A block as a one-input stage for ``_profile``: the captured other arguments are fixed."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.module, self.rest, self.kwargs = module, args[1:], kwargs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _first_tensor(self.module(x, *self.rest, **self.kwargs))
        if out is None:
            raise TypeError(f"block {type(self.module).__name__} returned no Tensor")
        return out


def _measure_full(model: nn.Module, sample_input: Any, loss_fn: Callable[[Any], Any]) -> int:
    with _restored(model):
        gc.collect()
        with track() as m:
            loss = loss_fn(_call(model, sample_input))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar Tensor, got {type(loss).__name__}")
            loss.backward()
            del loss
    return int(m.peak)


def _output_once(stage: _ck.Stage, out_bytes: int, output_saved: bool) -> _ck.Stage:
    """A block whose backward needs its own output (a final ReLU saves it) has it in its saved
    bytes, and the simulator also counts it as the next block's input: count it once. It stays
    until the block's backward, which the backward transient then covers."""
    if not output_saved or stage.saved_bytes - out_bytes < stage.input_bytes:
        return stage
    return _ck.Stage(stage.fwd_time, stage.bwd_time, stage.input_bytes, stage.saved_bytes - out_bytes,
                     stage.fwd_tmp, stage.bwd_tmp + out_bytes, stage.fwd_all_tmp)


def apply(model: nn.Module, budget: Any = 0.5, *, blocks: Any = None, sample_input: Any = None,
          loss_fn: Callable[[Any], Any] | None = None, repeats: int = 2, selective: bool = True) -> CheckpointHandle:
    """Checkpoint the fewest (cheapest) of ``model``'s repeated blocks so that a training step on
    inputs like ``sample_input`` needs at most ``budget`` of activation memory: bytes (int) or a
    float in (0, 1], that fraction of the peak measured storing everything. ``loss_fn(output)``
    is the loss (default: the sum of the first Tensor of the output). Returns a
    ``CheckpointHandle`` (the plan, and ``remove()``). Raises ``BudgetTooSmallError`` when even
    checkpointing every block does not fit.

    ``selective=True`` (the default) also considers torch's selective activation checkpointing
    per block: saving the outputs of some operator types (matmuls, attention) and recomputing
    the rest (norms, activations, dropout), chosen when that fits the budget with less
    recomputation than checkpointing whole blocks; ``handle.selective`` lists what each such
    block saves. ``selective=False``: whole blocks only."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if sample_input is None:
        raise TypeError("apply: sample_input= is required (a Tensor, a tuple of positional arguments or a dict of "
                        "keyword arguments for model(...)); it is run to measure the blocks")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be bytes (int) or a fraction (float in (0, 1]), got {budget!r}")
    if isinstance(budget, float) and not (0.0 < budget <= 1.0 and math.isfinite(budget)):
        raise ValueError(f"a fractional budget must be in (0, 1], got {budget!r}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output -> scalar loss) or None, got {type(loss_fn).__name__}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(selective, bool):
        raise TypeError(f"selective must be True or False, got {selective!r}")
    found = find_blocks(model, blocks)
    for name, m in found:
        if isinstance(m.__dict__.get("forward"), _Checkpointed):
            raise ValueError(f"block {name!r} is already checkpointed by an earlier apply(); remove() that first")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("apply: no parameter of the model requires grad: nothing to train, nothing to checkpoint")
    loss_fn = loss_fn or _default_loss
    captured = _capture(model, found, sample_input)
    full = _measure_full(model, sample_input, loss_fn)
    stages, out_bytes = [], 0
    ladders: list[list[_sel.SelectiveLevel]] | None = [] if selective else None
    with _restored(model):  # _profile restores the buffers of modules it is given; a _BlockFn is none
        for (name, m), (args, kwargs) in zip(found, captured):
            fn = _BlockFn(m, args, kwargs)
            st, out_bytes, keep_out, _ = _profile([fn], args[0], repeats)
            stages.append(_output_once(st[0], out_bytes, keep_out[0]))
            if ladders is not None:
                ladders.append(_sel.ladder(_sel.profile_ops(fn, args[0], st[0].fwd_time, repeats)))
    del captured
    nbytes = max(1, int(math.floor(budget * full))) if isinstance(budget, float) else int(budget)
    chain_full = int(_ck.simulate(stages, block_schedule(len(stages), set()), output_bytes=out_bytes)[1])
    offset = max(0, full - chain_full)
    plan = choose(stages, ladders, out_bytes, offset, nbytes)
    return CheckpointHandle(found, plan.checkpointed, stages, plan.peak, full, nbytes, plan.recompute_time,
                            plan.saved_ops, plan.whole_block_recompute_time)
