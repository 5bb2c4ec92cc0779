"""The planner's schedules run with torch: ``checkpoint_sequential`` and ``Sequential``.

The chain is measured by ``profile`` (``profiling.py``); the executor runs a planned
``Schedule`` with torch autograd (see docs/checkpoint_model.md):

- forward_nosave / forward_check: the stage under ``torch.no_grad()``;
- forward_all: the stage with grad enabled on a detached copy of its input, keeping that
  stage's graph only;
- loss: the boundary with the user's graph: everything before it runs in the forward of a
  ``torch.autograd.Function``, everything after it in that Function's backward;
- backward: ``torch.autograd.backward(output, grad)`` for the stage, whose input's ``.grad``
  is passed to the stage below.

The RNG state (CPU, and CUDA when the input is on CUDA) is saved before the first forward of
each stage and restored for its recomputations, so dropout matches the un-checkpointed run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import planner as _ck
from .function import TORCH_ORIGINAL, _order_error, resolve_use_reentrant, torch_own_checkpoint_sequential
from .profiling import _as_functions, _check_output, _differentiable, _profile, _RngState

__all__ = ["Sequential", "checkpoint_sequential"]

_ENGINE = torch.autograd.Variable._execution_engine


# ----------------------------------------------------------------------------- executor


def _params(fns: Sequence[Any]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for f in fns:
        if isinstance(f, nn.Module):
            for p in f.parameters():
                seen.setdefault(id(p), p)
    return list(seen.values())


class _Runner:
    """Runs one Schedule for one input; the state of one forward/backward pass."""

    def __init__(self, fns: list[Callable[..., Any]], schedule: _ck.Schedule, keep_out: Sequence[bool] = ()):
        self.fns = fns
        self.keep_out = list(keep_out) or [True] * len(fns)
        self.ops = schedule.ops
        self.L = len(fns)
        self.pos = 0
        self.x: dict[int, torch.Tensor] = {}
        self.ckpt: set[int] = set()
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor, torch.autograd.graph.GradientEdge | None]] = {}
        self.delta: dict[int, Any] = {}
        self.rng: dict[int, _RngState] = {}
        self.backward_done: set[int] = set()
        self.output_grad: torch.Tensor | None = None  # taken by the hook on the chain's output
        self.used = False
        self.device = torch.device("cpu")

    def _call(self, i: int) -> Callable[..., Any]:
        fn = self.fns[i]
        return fn

    def _run_stage(self, i: int, x: torch.Tensor) -> torch.Tensor:
        fn = self.fns[i]
        state = self.rng.get(i)
        if state is None:
            self.rng[i] = _RngState(self.device)
            return _check_output(i, fn, fn(x))
        now = _RngState(self.device)
        state.restore()
        try:
            return _check_output(i, fn, fn(x))
        finally:
            now.restore()

    def _forward(self, kind: str, i: int) -> None:
        xi = self.x[i]
        if kind == "forward_all":
            inp = xi.detach()
            if _differentiable(inp):
                inp.requires_grad_(True)
            with torch.enable_grad():
                y = self._run_stage(i, inp)
            # The gradient edge is taken now: releasing a view's storage later bumps its version,
            # after which autograd would rebuild y.grad_fn for the new (empty) shape.
            edge = torch.autograd.graph.get_gradient_edge(y) if y.requires_grad else None
            self.held[i] = (inp, y, edge)
            if (i + 1) in self.backward_done:
                self._release_output(i)
        else:
            with torch.no_grad():
                y = self._run_stage(i, xi)
            if kind == "forward_check":
                self.ckpt.add(i)
            elif i not in self.ckpt and i not in self.held and i != 0:
                del self.x[i]
        if (i + 1) not in self.backward_done:
            self.x[i + 1] = y

    def _backward(self, i: int) -> None:
        inp, y, edge = self.held.pop(i)
        d = self.delta.pop(i + 1)
        grad = None
        if d is not None and edge is not None:
            # the engine directly, from the edge: y's data may have been released (_release_output)
            _ENGINE.run_backward((edge,), (d,), False, False, (), allow_unreachable=True, accumulate_grad=True)
            grad = inp.grad
        del y, edge
        if grad is None and inp.requires_grad:
            grad = torch.zeros_like(inp)
        self.x.pop(i, None)
        self.ckpt.discard(i)
        self.backward_done.add(i)
        self.delta[i] = grad
        if i >= 1 and (i - 1) in self.held:
            self._release_output(i - 1)

    def _release_output(self, i: int) -> None:
        """The model drops x_{i+1} once B(i+1) has run, but the graph root of stage i (held for
        B(i)) still references it: free its storage unless autograd saved it (the stage's profile
        says so) or it aliases the stage input. ``set_()`` only detaches this tensor from the
        storage, so a storage someone else still references (the chain output handed to the user,
        when a stage returns its input) stays alive and intact.

        No test here may compare against the address of a tensor that is already dead: the host
        allocator reuses addresses, and a stale match once kept one activation alive at random."""
        if self.keep_out[i]:
            return
        inp, y, _ = self.held[i]
        ptr = y.untyped_storage().data_ptr()
        if ptr == 0 or ptr == inp.untyped_storage().data_ptr():
            return
        # y's gradient edge is kept (recorded shapes are in the graph), its storage goes. A view
        # (a Linear on 3-d input returns one) keeps its base alive, so the base lets go too: it is
        # an intermediate of this stage on the same storage, which autograd did not save.
        with torch.no_grad():
            base = y._base
            # (set_() without arguments, valid at runtime, is missing from torch's overloads)
            y.set_()  # type: ignore[call-overload]
            if base is not None and base.untyped_storage().data_ptr() == ptr:
                base.set_()  # type: ignore[call-overload]

    def run_forward(self, x0: torch.Tensor) -> torch.Tensor:
        self.device = x0.device
        self.x[0] = x0.detach()
        while True:
            op = self.ops[self.pos]
            self.pos += 1
            if op.kind == "loss":
                out = self.x.pop(self.L)
                self.backward_done.add(self.L)
                # From here on the chain's output belongs to the user and the loss: B(L-1) needs
                # only its gradient, so the last stage's held output lets go of the storage (it
                # lives while the user's tensor or the loss's saved tensors refer to it).
                result = out.detach()  # first: releasing empties the stage's tensor, not this alias
                del out
                if (self.L - 1) in self.held:
                    self._release_output(self.L - 1)
                return result
            if op.kind == "backward":
                raise RuntimeError("vramkit.checkpoint: a backward op before the loss in the schedule")
            self._forward(op.kind, op.stage)

    def take_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Hook on the chain's output: keep its gradient here and hand the engine a stand-in of
        the same shape on a one-element storage. The engine holds the arguments of a Function's
        backward until it returns, so a gradient passed that way would stay allocated through
        the whole schedule; kept here, it is freed once the last stage's backward has used it,
        as the model says."""
        self.output_grad = grad
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

    def run_backward(self, grad_out: torch.Tensor) -> Any:
        if self.used:
            raise RuntimeError("vramkit.checkpoint: trying to backward through the checkpointed chain a second "
                               "time; its schedule has already run (retain_graph is not supported)")
        self.used = True
        self.delta[self.L] = self.output_grad if self.output_grad is not None else grad_out
        self.output_grad = None
        del grad_out
        with torch.enable_grad():
            while self.pos < len(self.ops):
                op = self.ops[self.pos]
                self.pos += 1
                if op.kind == "backward":
                    self._backward(op.stage)
                else:
                    self._forward(op.kind, op.stage)
        d0 = self.delta.pop(0, None)
        self.x.clear()
        self.held.clear()
        self.delta.clear()
        self.rng.clear()
        return d0


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, dummy: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        ctx.runner = runner
        return runner.run_forward(x0)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, Any]:
        runner = ctx.runner
        d0 = runner.run_backward(grad_out)
        ctx.runner = None
        return None, None, (d0 if ctx.needs_input_grad[2] else None)


def _plain_forward(fns: list[Callable[..., Any]], x: torch.Tensor) -> torch.Tensor:
    for i, fn in enumerate(fns):
        x = _check_output(i, fn, fn(x))
    return x


def _execute(fns: list[Callable[..., Any]], planned: tuple[_ck.Schedule, list[bool]], x0: torch.Tensor) -> torch.Tensor:
    schedule, keep_out = planned
    runner = _Runner(fns, schedule, keep_out)
    dummy = torch.empty((0,), device=x0.device, requires_grad=True)
    out: torch.Tensor = _CheckpointFunction.apply(runner, dummy, x0)  # type: ignore[no-untyped-call]  # torch's
    out.register_hook(runner.take_output_grad)
    return out


def _resolve_budget(budget: Any, stages: list[_ck.Stage], out_bytes: int, loss: _ck.Stage | None = None) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be bytes (int) or a fraction (float in (0, 1]), got {budget!r}")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or not math.isfinite(budget):
            raise ValueError(f"a fractional budget must be in (0, 1], got {budget!r}")
        full = _ck.plan(stages, None, "none", output_bytes=out_bytes, loss=loss).predicted_peak
        return max(1, int(math.floor(budget * full)))
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    return int(budget)


def _plan(fns: list[Callable[..., Any]], x: torch.Tensor, budget: Any, algorithm: str,
          loss_fn: Callable[..., Any] | None = None, repeats: int = 3) -> tuple[_ck.Schedule, list[bool]]:
    stages, out_bytes, keep_out, loss = _profile(fns, x, repeats, loss_fn)
    nbytes = _resolve_budget(budget, stages, out_bytes, loss)
    try:
        return _ck.plan(stages, nbytes, algorithm, output_bytes=out_bytes, loss=loss), keep_out
    except _ck.BudgetTooSmallError as e:
        full = _ck.plan(stages, None, "none", output_bytes=out_bytes, loss=loss).predicted_peak
        least = e.min_budget
        raise _ck.BudgetTooSmallError(
            f"budget {nbytes:,} bytes is below the minimum for this model and input: the least budget that works "
            f"is {least:,} bytes ({least / full:.3f} of the {full:,} bytes storing everything needs)",
            least, nbytes) from None


def _check_trainable(fns: list[Callable[..., Any]], x: torch.Tensor) -> None:
    if not any(p.requires_grad for p in _params(fns)) and not x.requires_grad:
        raise ValueError("vramkit.checkpoint: no parameter of the model requires grad and the input does not "
                         "either: there is nothing to backpropagate, so checkpointing has no use (run the model "
                         "under torch.no_grad())")


def checkpoint_sequential(functions: Any, segments: int | None = None, input: torch.Tensor | None = None,
                          use_reentrant: bool | None = None, *, budget: Any = None, algorithm: str = "optimal",
                          loss_fn: Callable[..., Any] | None = None, preserve_rng_state: bool = True) -> torch.Tensor:
    """Run a sequential chain with activation checkpointing; torch's argument order.

    ``checkpoint_sequential(model, k, x)``: as ``torch.utils.checkpoint.checkpoint_sequential``
    (``k`` equal segments, all but the last checkpointed, run by torch's
    ``checkpoint_sequential``; ``use_reentrant`` None is torch's default, with torch's warning).
    ``checkpoint_sequential(model, None, x, budget=b)``: ``b`` is bytes (int), or a float in
    (0, 1] meaning that fraction of the activation memory of storing everything (as
    ``plan(..., "none")`` predicts); the chain is profiled once, planned with ``algorithm`` and
    executed; ``out.backward()`` (through any loss) runs the rest of the schedule. Raises
    ``BudgetTooSmallError`` when the budget is below the minimum. ``loss_fn`` (output ->
    scalar), when given, is measured too, so the budget covers the memory the loss keeps
    (cross-entropy's softmax); without it that memory comes on top of the budget.
    """
    if isinstance(segments, torch.Tensor):
        raise _order_error(functions, segments, input, budget)
    if budget is not None and segments is not None:
        raise ValueError("give either segments (torch's equal segments) or budget=, not both")
    if budget is None and segments is None:
        raise ValueError("give segments (an int, torch's equal segments) or segments=None with budget= (bytes, "
                         "or a fraction in (0, 1])")
    fns = _as_functions(functions)
    if input is None:
        raise TypeError("checkpoint_sequential: input (the chain's input Tensor, third argument) is missing")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a Tensor, got {type(input).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"checkpoint_sequential: preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if segments is not None:
        if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(fns):
            raise ValueError(f"segments must be an int in 1..{len(fns)}, got {segments!r}")
        if loss_fn is not None:
            raise ValueError("loss_fn= only applies with budget= (segments plans nothing)")
        # torch's equal segments, on torch's engine (its default and warning when use_reentrant is None)
        reentrant = resolve_use_reentrant(use_reentrant, "checkpoint_sequential")
        out: torch.Tensor = torch_own_checkpoint_sequential(fns, segments, input, use_reentrant=reentrant,
                                                            preserve_rng_state=preserve_rng_state)
        return out
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"checkpoint_sequential: use_reentrant must be True, False or None, got {use_reentrant!r}")
    if use_reentrant:
        raise ValueError("use_reentrant=True only applies to segments; with budget= the planned schedule runs "
                         "its own executor (allowed: None or False)")
    if not preserve_rng_state:
        raise ValueError("preserve_rng_state=False only applies to segments; the planned executor always "
                         "restores the RNG state for recomputation")
    _check_loss_fn(loss_fn)
    if algorithm not in _ck.ALGORITHMS or algorithm in ("segments",):
        raise ValueError(f"algorithm must be one of optimal, revolve, sqrt, none with budget=, got {algorithm!r}")
    if not torch.is_grad_enabled():
        return _plain_forward(fns, input)
    _check_trainable(fns, input)
    return _execute(fns, _plan(fns, input, budget, algorithm, loss_fn), input)


setattr(checkpoint_sequential, TORCH_ORIGINAL, torch_own_checkpoint_sequential)  # see function._torch_own


def _check_loss_fn(loss_fn: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output -> scalar loss) or None, got {type(loss_fn).__name__}")


class Sequential(nn.Sequential):
    """A drop-in for ``nn.Sequential`` that trains within ``budget`` (bytes, or a fraction in
    (0, 1] of the store-everything activation memory). It profiles and plans once per input
    (shape, dtype, device) and reuses the schedule; in eval/no-grad use it is a plain forward.
    Parameter names are those of ``nn.Sequential`` ("0.weight", ...).

    ``loss_fn`` (output -> scalar), used only when planning, makes the budget cover the memory
    the loss keeps too (cross-entropy keeps a softmax the size of the logits); it is called on
    the output of the first input of each shape, so a loss reading a batch's targets must
    accept that output."""

    def __init__(self, modules: Any, budget: Any, algorithm: str = "optimal",
                 loss_fn: Callable[..., Any] | None = None):
        if isinstance(modules, nn.Sequential):
            mods = list(modules.children())
        elif isinstance(modules, (list, tuple, nn.ModuleList)):
            mods = list(modules)
        else:
            raise TypeError(f"modules must be an nn.Sequential or a list of modules, got {type(modules).__name__}")
        for i, m in enumerate(mods):
            if not isinstance(m, nn.Module):
                raise TypeError(f"stage {i} is not an nn.Module (got {type(m).__name__})")
        if not mods:
            raise ValueError("modules is empty")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"budget must be bytes (int) or a fraction (float in (0, 1]), got {budget!r}")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1], got {budget!r}")
        if isinstance(budget, int) and budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        if algorithm not in ("optimal", "revolve", "sqrt", "none"):
            raise ValueError(f"algorithm must be one of optimal, revolve, sqrt, none, got {algorithm!r}")
        _check_loss_fn(loss_fn)
        super().__init__(*mods)
        self.budget = budget
        self.algorithm = algorithm
        self.loss_fn = loss_fn
        self._schedules: dict[tuple[tuple[int, ...], torch.dtype, torch.device],
                              tuple[_ck.Schedule, list[bool]]] = {}

    def _planned(self, x: torch.Tensor) -> tuple[_ck.Schedule, list[bool]]:
        key = (tuple(x.shape), x.dtype, x.device)
        planned = self._schedules.get(key)
        if planned is None:
            planned = _plan(list(self), x, self.budget, self.algorithm, self.loss_fn)
            self._schedules[key] = planned
        return planned

    def schedule_for(self, x: torch.Tensor) -> _ck.Schedule:
        """The Schedule used for inputs like ``x`` (profiled and planned on first use)."""
        return self._planned(x)[0]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fns: list[Callable[..., Any]] = list(self)
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return _plain_forward(fns, input)
        return _execute(fns, self._planned(input), input)
