"""``profile`` and ``profile_loss``: a chain of modules measured for the planner (forward and
backward times, activation bytes through ``torch.autograd.graph.saved_tensors_hooks``, transient
bytes through ``vramkit.torch.track``), and the helpers the executor (``sequential.py``) shares
with it: the chain as a list of functions, the checks of a stage's output, the RNG state a
stage's recomputation restores (CPU, and CUDA when the input is on CUDA), so dropout matches
the run without checkpointing."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import planner as _ck
from ..torch.meters import track

__all__ = ["profile", "profile_loss"]


# ----------------------------------------------------------------------------- helpers


def _as_functions(functions: Any) -> list[Callable[..., Any]]:
    if isinstance(functions, nn.Sequential):
        fns: list[Callable[..., Any]] = list(functions.children())
    elif isinstance(functions, (list, tuple, nn.ModuleList)):
        fns = list(functions)
    else:
        raise TypeError("functions must be a torch.nn.Sequential or a list of modules/callables, got "
                        f"{type(functions).__name__}")
    if not fns:
        raise ValueError("functions is empty: a chain needs at least one stage")
    for i, f in enumerate(fns):
        if not callable(f):
            raise TypeError(f"stage {i} is not callable (got {type(f).__name__})")
    return fns


def _stage_name(i: int, fn: Any) -> str:
    return f"stage {i} ({type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, '__name__', type(fn).__name__)})"


def _check_output(i: int, fn: Any, y: Any) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{_stage_name(i, fn)} returned {type(y).__name__}; every stage must return a single "
                        "Tensor (as in torch.nn.Sequential)")
    return y


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


class _RngState:
    """CPU RNG state, plus the CUDA state of ``device`` when it is a CUDA device."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


# ----------------------------------------------------------------------------- profile


def _meter_on_first(r: int) -> Any:
    """The live-tensor meter for pass 0 (memory), nothing for the timed passes: the meter's
    dispatch mode costs time on every op."""
    return track() if r == 0 else contextlib.nullcontext()


def _profile(fns: list[Callable[..., Any]], sample_input: torch.Tensor, repeats: int = 3,
             loss_fn: Callable[..., Any] | None = None) -> tuple[list[_ck.Stage], int, list[bool], _ck.Stage | None]:
    """(stages, output bytes, keep_out per stage, loss Stage or None): the loss, when given, is
    measured as one more stage whose input is the chain's output."""
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"sample_input must be a Tensor, got {type(sample_input).__name__}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    device = sample_input.device
    rng = _RngState(device)
    # buffers (BatchNorm running stats) are restored after profiling
    buffers = [(b, b.detach().clone()) for f in fns if isinstance(f, nn.Module) for b in f.buffers()]
    stages = []
    keep_out: list[bool] = []  # per stage: autograd saves the output (or it aliases the input)
    x = sample_input.detach()
    try:
        for i, fn in enumerate(fns + ([loss_fn] if loss_fn is not None else [])):
            a_i = _storage_bytes(x)
            params = [p for p in (fn.parameters() if isinstance(fn, nn.Module) else ()) if p.requires_grad]
            # Pass 0 of each loop measures memory with the live-tensor meter (and warms up); the
            # other passes are timed without it, since its dispatch mode costs time on every op.
            fwd_times = []
            fwd_tmp = fwd_tmp_nograd = 0
            for r in range(repeats + 1):
                with torch.no_grad(), _meter_on_first(r) as m:
                    _sync(x)
                    t0 = time.perf_counter()
                    y = _check_output(i, fn, fn(x))
                    _sync(y)
                    if r == 0:
                        out_new = _storage_bytes(y) if y.untyped_storage().data_ptr() in m._live else 0
                        fwd_tmp_nograd = m.peak - out_new
                    else:
                        fwd_times.append(time.perf_counter() - t0)
                    del y
            # the saved tensors, and the transient memory of the saving forward and the backward
            saved: dict[int, int] = {}
            bwd_times = []
            bwd_tmp = 0
            for r in range(repeats + 1):
                inp = x.detach()
                if _differentiable(inp):
                    inp.requires_grad_(True)
                packed: list[torch.Tensor] = []

                def pack(t: torch.Tensor) -> torch.Tensor:
                    packed.append(t)
                    return t

                with torch.enable_grad(), _meter_on_first(r) as m, \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = _check_output(i, fn, fn(inp))
                    if r == 0:
                        live_end = m.current
                        in_ptr = inp.untyped_storage().data_ptr()
                        for t in packed:
                            st = t.untyped_storage()
                            ptr = st.data_ptr()
                            if ptr != in_ptr and ptr in m._live:  # created by this stage (not params)
                                saved[ptr] = int(st.nbytes())
                        fwd_tmp = m.peak - live_end
                        y_ptr = y.untyped_storage().data_ptr()
                        keep_out.append(y_ptr == in_ptr or any(t.untyped_storage().data_ptr() == y_ptr
                                                               for t in packed))
                        input_saved = any(t.untyped_storage().data_ptr() == in_ptr for t in packed)
                packed.clear()
                wrt = ([inp] if inp.requires_grad else []) + params
                if y.requires_grad and wrt:
                    g = torch.ones_like(y)
                    _sync(g)
                    with _meter_on_first(r) as m:
                        t0 = time.perf_counter()
                        torch.autograd.grad(y, wrt, g, allow_unused=True)
                        _sync(g)
                        if r == 0:
                            bwd_tmp = m.peak - a_i
                        else:
                            bwd_times.append(time.perf_counter() - t0)
                elif r:
                    bwd_times.append(0.0)
                del y
            with torch.no_grad():
                y = fn(x)
            # Two forward transients: a no-grad forward's (what it frees as it goes), and a saving
            # forward's beyond what it saves (often much less: the same intermediates are kept).
            # The loss only ever runs saving. Its output (a scalar, which the model gives size 0)
            # lives through its backward, so it is counted with what the loss keeps.
            extra = 0
            if i == len(fns):
                fwd_tmp_nograd = fwd_tmp
                extra = _storage_bytes(y)
                if not input_saved:
                    # The model keeps x_L through the loss's backward; a loss that does not save
                    # its input (cross-entropy keeps its log-softmax) lets it go after the
                    # forward, and its backward's transient can reuse those bytes.
                    bwd_tmp = max(0, bwd_tmp - a_i)
            stages.append(_ck.Stage(float(statistics.median(fwd_times)), float(statistics.median(bwd_times)), a_i,
                                    a_i + sum(saved.values()) + extra, int(max(0, fwd_tmp_nograd)),
                                    int(max(0, bwd_tmp)), int(max(0, fwd_tmp))))
            x = y.detach()
    finally:
        rng.restore()
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
    if loss_fn is not None:  # the loss's input is the chain's output
        return stages[:-1], stages[-1].input_bytes, keep_out[:-1], stages[-1]
    return stages, _storage_bytes(x), keep_out, None


def profile(modules: Any, sample_input: torch.Tensor, repeats: int = 3) -> list[_ck.Stage]:
    """Measure a chain: one ``Stage`` per module (median times over ``repeats`` runs, in seconds;
    sizes in bytes). ``saved_bytes`` counts the distinct storages autograd saves for the stage that
    the stage created, plus its input; parameters are not counted. ``fwd_tmp``/``bwd_tmp`` are the
    transient bytes measured with ``vramkit.torch.track`` (``bwd_tmp`` includes the parameter
    gradients of the stage). RNG state and module buffers are restored afterwards."""
    return _profile(_as_functions(modules), sample_input, repeats)[0]


def profile_loss(loss_fn: Callable[..., Any], sample_output: torch.Tensor, repeats: int = 3) -> Any:
    """Measure a loss function (``output -> scalar``) on a sample of the chain's output, as a
    ``Stage`` to pass to ``plan(..., loss=...)``: its ``saved_bytes`` includes what it keeps for
    its backward (cross-entropy keeps a softmax the size of the logits)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output -> scalar loss), got {type(loss_fn).__name__}")
    return _profile([], sample_output, repeats, loss_fn)[3]
