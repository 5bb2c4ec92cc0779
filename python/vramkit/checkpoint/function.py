"""``vramkit.checkpoint.checkpoint``: activation checkpointing of any callable, a drop-in for
``torch.utils.checkpoint.checkpoint``.

Non-reentrant (the default): the function runs once with grad enabled under
``torch.autograd.graph.saved_tensors_hooks`` whose pack hook keeps, for every tensor autograd
would save, only a small handle (its position and metadata). The first time backward unpacks
one of them, the function is run again (RNG state and autocast state as in the first run) under
a hook that collects what it saves in the same order; each unpack then takes its tensor (and
frees it). A second backward (``retain_graph=True``) recomputes again.

Reentrant (``use_reentrant=True``): an ``autograd.Function`` that runs the function under
``no_grad`` and keeps its tensor inputs; its backward runs it again with grad and backpropagates
through that graph (only ``.backward()`` without ``inputs=``, as torch's).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, NoReturn

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

__all__ = ["checkpoint", "noop_context_fn"]

DETERMINISM_CHECKS = ("default", "none")


def _stage_name(i: int, fn: Any) -> str:
    return f"stage {i} ({type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, '__name__', type(fn).__name__)})"


def _check_output(i: int, fn: Any, y: Any) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{_stage_name(i, fn)} returned {type(y).__name__}; every stage must return a single "
                        "Tensor (as in torch.nn.Sequential)")
    return y


def noop_context_fn() -> tuple[contextlib.nullcontext[None], contextlib.nullcontext[None]]:
    return contextlib.nullcontext(), contextlib.nullcontext()


# ----------------------------------------------------------------------------- state to replay


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class _Replay:
    """RNG states (CPU, and each CUDA device the inputs live on) and autocast settings of the
    first run, set again around a recomputation."""

    def __init__(self, inputs: list[torch.Tensor], preserve_rng: bool):
        self.cpu: torch.Tensor | None = None
        self.cuda: list[torch.Tensor] | None = None
        self.devices: list[int] = []
        if preserve_rng:
            self.cpu = torch.get_rng_state()
            self.devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
            self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.autocast = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda") if dev == "cpu" or torch.cuda.is_available()]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        saved_cpu: torch.Tensor | None = None
        saved_cuda: list[torch.Tensor] = []
        if self.cpu is not None:
            saved_cpu = torch.get_rng_state()
            saved_cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
            torch.set_rng_state(self.cpu)
            assert self.cuda is not None  # saved with self.cpu
            for d, s in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(s, d)
        try:
            with contextlib.ExitStack() as stack:
                for dev, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
                yield
        finally:
            if saved_cpu is not None:
                torch.set_rng_state(saved_cpu)
                for d, s in zip(self.devices, saved_cuda):
                    torch.cuda.set_rng_state(s, d)


# ----------------------------------------------------------------------------- non-reentrant


class _Handle:
    """What autograd keeps for a saved tensor: its frame and position, not the tensor."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "_Frame", index: int):
        self.frame = frame
        self.index = index


class _Frame:
    """One checkpointed call: what is needed to run it again, and the recomputed tensors."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], replay: _Replay,
                 recompute_ctx: Any, check: bool):
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.replay = replay
        self.recompute_ctx = recompute_ctx
        self.check = check
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []  # per saved tensor of the first run
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> _Handle:
        self.meta.append((t.shape, t.dtype, t.device))
        return _Handle(self, len(self.meta) - 1)

    def recompute(self) -> None:
        got: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> None:
            got.append(t.detach())

        with self.replay(), torch.enable_grad(), self.recompute_ctx, \
                torch.autograd.graph.saved_tensors_hooks(collect, _never_unpacked):
            self.function(*self.args, **self.kwargs)
        if self.check:
            self._check(got)
        self.recomputed = {i: t for i, t in enumerate(got[:len(self.meta)])}

    def _check(self, got: list[torch.Tensor]) -> None:
        if len(got) != len(self.meta):
            raise CheckpointError(
                f"vramkit.checkpoint: the recomputation saved {len(got)} tensors for backward, the first run "
                f"{len(self.meta)}: the function must run the same ops on recomputation (no dependence on global "
                "state); pass determinism_check='none' to skip this check")
        for i, (t, (shape, dtype, device)) in enumerate(zip(got, self.meta)):
            if (t.shape, t.dtype, t.device) != (shape, dtype, device):
                raise CheckpointError(
                    f"vramkit.checkpoint: saved tensor {i} was {tuple(shape)} {dtype} on {device} in the first run "
                    f"but {tuple(t.shape)} {t.dtype} on {t.device} when recomputed: the function must run the same "
                    "ops on recomputation; pass determinism_check='none' to skip this check")

    def unpack(self, index: int) -> torch.Tensor:
        t = self.recomputed.pop(index, None)
        if t is None:  # first unpack of this backward (or a later backward with retain_graph)
            self.recompute()
            t = self.recomputed.pop(index, None)
            if t is None:
                raise CheckpointError(f"vramkit.checkpoint: saved tensor {index} was not produced by the "
                                      "recomputation (the function ran fewer ops than in the first run)")
        return t


def _never_unpacked(_: Any) -> NoReturn:
    raise CheckpointError("vramkit.checkpoint: a tensor saved during recomputation was used for backward "
                          "(backward inside a recomputation is not supported)")


def _unpack(h: _Handle) -> torch.Tensor:
    return h.frame.unpack(h.index)


def _non_reentrant(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], preserve: bool,
                   context_fn: Callable[[], Any], check: bool) -> Any:
    fwd_ctx, recompute_ctx = _contexts(context_fn)
    if not torch.is_grad_enabled():  # nothing is saved: a plain call, as torch does
        with fwd_ctx:
            return function(*args, **kwargs)
    replay = _Replay(_tensors((args, kwargs), []), preserve)
    frame = _Frame(function, args, kwargs, replay, recompute_ctx, check)
    with fwd_ctx, torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        return function(*args, **kwargs)


def _contexts(context_fn: Callable[[], Any]) -> tuple[Any, Any]:
    pair = context_fn()
    if not (isinstance(pair, tuple) and len(pair) == 2
            and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
        raise TypeError("context_fn must return a tuple of two context managers (forward, recomputation), got "
                        f"{type(pair).__name__}")
    return pair


# ----------------------------------------------------------------------------- reentrant


class _ReentrantFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
        if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            warnings.warn("vramkit.checkpoint (use_reentrant=True): none of the inputs has requires_grad=True, so "
                          "the checkpointed part gets no gradients; use use_reentrant=False", stacklevel=4)
        ctx.function = function
        ctx.replay = _Replay([a for a in args if isinstance(a, torch.Tensor)], preserve)
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("vramkit.checkpoint: with use_reentrant=True, checkpoint is incompatible with "
                               "torch.autograd.grad() and with backward(inputs=...); use use_reentrant=False, or "
                               "call .backward() without inputs=")
        tensors = iter(ctx.saved_tensors)
        args = []
        for is_tensor, other in zip(ctx.layout, ctx.others):
            if is_tensor:
                t = next(tensors)
                d = t.detach()
                d.requires_grad_(t.requires_grad)
                args.append(d)
            else:
                args.append(other)
        with ctx.replay(), torch.enable_grad():
            out = ctx.function(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if not pairs:
            raise RuntimeError("vramkit.checkpoint (use_reentrant=True): none of the function's outputs requires "
                               "grad; use use_reentrant=False")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)


# ----------------------------------------------------------------------------- public


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = False,
               context_fn: Callable[[], Any] = noop_context_fn, determinism_check: str = "default", debug: bool = False,
               early_stop: bool = True, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its intermediate activations: they are
    recomputed during backward. The arguments are those of ``torch.utils.checkpoint.checkpoint``;
    ``use_reentrant`` defaults to False (``None`` means False too, without torch's warning).

    ``preserve_rng_state`` restores the CPU RNG and that of the CUDA devices of the tensor
    inputs for the recomputation (dropout masks match). ``context_fn`` returns two context
    managers, for the first run and the recomputation. ``determinism_check`` is "default"
    (recomputed saved tensors must match in shape, dtype and device; else
    ``torch.utils.checkpoint.CheckpointError``) or "none". ``early_stop`` is accepted and has
    no effect (the function is always recomputed whole). ``debug=True`` is not supported.
    Under ``torch.no_grad()`` the function simply runs.
    """
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable (a module or function), got "
                        f"{type(function).__name__}")
    if use_reentrant is None:
        use_reentrant = False
    for name, v in (("use_reentrant", use_reentrant), ("preserve_rng_state", preserve_rng_state),
                    ("debug", debug), ("early_stop", early_stop)):
        if not isinstance(v, bool):
            raise TypeError(f"checkpoint: {name} must be True or False, got {v!r}")
    if determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(f"checkpoint: determinism_check must be one of {list(DETERMINISM_CHECKS)}, got "
                         f"{determinism_check!r}")
    if not callable(context_fn):
        raise TypeError(f"checkpoint: context_fn must be a callable returning two context managers, got "
                        f"{type(context_fn).__name__}")
    if use_reentrant:
        if kwargs:
            raise ValueError(f"checkpoint: unexpected keyword arguments with use_reentrant=True: "
                             f"{', '.join(kwargs)} (keyword arguments to the function need use_reentrant=False)")
        if context_fn is not noop_context_fn or debug:
            raise ValueError("checkpoint: context_fn and debug are only supported with use_reentrant=False")
        # torch.autograd.Function.apply is unannotated (and named after the subclass here, so
        # untyped_calls_exclude = ["torch"] does not reach it)
        return _ReentrantFunction.apply(function, preserve_rng_state, *args)  # type: ignore[no-untyped-call]
    if debug:
        raise ValueError("checkpoint: debug=True is not supported by vramkit.checkpoint.checkpoint (allowed: "
                         "debug=False); use torch.utils.checkpoint.checkpoint(..., debug=True) for an op trace")
    return _non_reentrant(function, args, kwargs, preserve_rng_state, context_fn, determinism_check == "default")


# ---- checkpoint_sequential's equal segments (torch's rule), run through checkpoint() above ----

def _equal_segments(fns: list[Callable[..., Any]], segments: int, input: torch.Tensor, use_reentrant: bool,
                    preserve_rng_state: bool) -> torch.Tensor:
    """torch's equal segments: len // segments stages each, the remainder in the last segment,
    which runs without checkpointing (its activations are needed at once)."""
    size = len(fns) // segments
    x = input
    for start in range(0, size * (segments - 1), size):
        x = checkpoint(_Segment(fns, start, start + size), x, use_reentrant=use_reentrant,
                       preserve_rng_state=preserve_rng_state)
    return _Segment(fns, size * (segments - 1), len(fns))(x)


class _Segment:
    def __init__(self, fns: list[Callable[..., Any]], start: int, stop: int):
        self.fns, self.start, self.stop = fns, start, stop

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.start, self.stop):
            x = _check_output(i, self.fns[i], self.fns[i](x))
        return x


def _order_error(functions: Any, segments: Any, input: Any, budget: Any) -> TypeError:
    what = "budget=" + repr(budget) if budget is not None else "budget=0.5"
    return TypeError(
        f"checkpoint_sequential: segments must be an int (or None with budget=), got a {type(segments).__name__}. "
        "The argument order changed to torch's: checkpoint_sequential(functions, segments, input, "
        f"use_reentrant=None, *, budget=None, ...); call checkpoint_sequential(model, None, x, {what}) for a "
        "planned schedule, or checkpoint_sequential(model, 4, x) for torch's equal segments")
