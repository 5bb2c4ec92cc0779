"""``torch.autocast`` on the meta device, for captures (``vramkit.trace.capture``).

torch has no autocast for meta tensors: its Autocast dispatch keys exist per backend (CPU,
CUDA, ...) and none for Meta, and ``torch.autocast("cuda")`` is disabled outright on a build
without CUDA. So a meta capture of a mixed-precision step would record every activation in
float32. While a meta capture runs, vramkit makes ``torch.autocast(device_type, dtype)`` in the
user's own code (a ``with`` block, ``torch.cuda.amp.autocast`` too) enter an
emulation instead (regions created during the capture: an autocast decorator built before it
keeps torch's behaviour): a ``TorchFunctionMode`` that applies the cast policy of autocast's op
lists for that device type (PyTorch's ``aten/src/ATen/autocast_mode.cpp``), the innermost
region's dtype winning as in autocast:

* lower precision (matmuls, convolutions, linear, attention): floating inputs that are not
  float64 are cast to the autocast dtype; casts of leaf tensors that require grad (the
  parameters) are cached until the outermost region exits, as autocast's cast cache does;
* fp32: lower-precision floating inputs are cast to float32;
* fp32 with an output dtype (softmax, log_softmax, sum, cumsum, prod, ...): ``dtype=float32``
  is passed when the caller gave none and the input is lower precision;
* promote: floating inputs are cast to the widest floating type among them.

The emulation works at the Python API, autocast at the dispatcher: both see the call the user
made (``F.linear``, ``x @ w``, ``F.cross_entropy``) and neither re-casts inside it. A
checkpoint's recomputation runs in the backward, where function modes are not active, so the
checkpoint's saved autocast state reports the emulated region and its recomputation enters
the emulation again. Tests compare a meta capture emulating the CPU lists with a CPU capture
under the real ``torch.autocast("cpu")``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, TypeGuard

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["emulate_autocast", "POLICIES"]

LOWER, FP32, FP32_DTYPE, PROMOTE = "lower", "fp32", "fp32_dtype", "promote"


def _policy(lower: str, fp32: str, fp32_dtype: str, promote: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for names, kind in ((lower, LOWER), (fp32, FP32), (fp32_dtype, FP32_DTYPE), (promote, PROMOTE)):
        out.update({n: kind for n in names.split()})
    return out


# Python-level names of the ops in autocast's CUDA lists (methods and operators included).
_CUDA = _policy(
    lower="conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d prelu addmm addmv addr "
          "matmul __matmul__ __rmatmul__ einsum mm mv linear addbmm baddbmm bmm chain_matmul multi_dot lstm_cell "
          "gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention",
    fp32="acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__ "
         "float_power softplus layer_norm group_norm cosine_similarity poisson_nll_loss cosine_embedding_loss "
         "nll_loss hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
         "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
         "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp cross_entropy",
    fp32_dtype="prod softmax log_softmax cumprod cumsum sum vector_norm matrix_norm",
    promote="addcdiv addcmul atan2 bilinear cross dot grid_sample index_put tensordot scatter_add",
)
# The CPU lists (used by the tests against the real CPU autocast, and for device_type="cpu").
_CPU = _policy(
    lower="conv1d conv2d conv3d bmm mm baddbmm addmm addbmm linear matmul __matmul__ __rmatmul__ conv_tbc "
          "conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention",
    fp32="avg_pool3d binary_cross_entropy grid_sample polar prod quantile nanquantile stft cdist trace "
         "view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d "
         "max_unpool2d max_unpool3d adaptive_avg_pool3d mse_loss cosine_embedding_loss nll_loss "
         "hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy l1_loss huber_loss margin_ranking_loss "
         "soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss "
         "binary_cross_entropy_with_logits",
    fp32_dtype="",
    promote="stack cat index_copy",
)
POLICIES = {"cuda": _CUDA, "cpu": _CPU}
_LOWER_PRECISION = (torch.float16, torch.bfloat16)


class _State:
    """The emulated regions open in this capture (a stack) and the parameter-cast cache."""

    def __init__(self) -> None:
        self.regions: list[tuple[str, torch.dtype, bool]] = []  # (device_type, dtype, enabled)
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, its cast)
        self.recompute_device = "cuda"  # the lists a checkpoint recomputation uses
        self.modes: list[Any] = []  # the emulation mode of each open region (None: reuses the outer one)


_STATE: _State | None = None


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _eligible(t: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _Emulation(TorchFunctionMode):
    def __init__(self, state: _State, device_type: str, dtype: torch.dtype, cache: bool) -> None:
        super().__init__()
        self.state, self.policy, self.dtype, self.cache = state, POLICIES[device_type], dtype, cache

    def _cast(self, t: Any, to: torch.dtype) -> Any:
        if not _eligible(t) or t.dtype == to:
            return t
        if self.cache and t.is_leaf and t.requires_grad:
            hit = self.state.cache.get(id(t))
            if hit is not None and hit[0] is t and hit[1].dtype == to:
                return hit[1]
            cast = t.to(to)
            self.state.cache[id(t)] = (t, cast)
            return cast
        return t.to(to)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        kind = self.policy.get(_name(func))
        if kind is None or not self.state.modes or self.state.modes[-1] is not self or not self.state.regions[-1][2]:
            # Not listed; inside autocast(enabled=False); or an inner region's mode already
            # applied its policy (autocast uses the innermost region's dtype only).
            return func(*args, **kwargs)
        if kind == LOWER:
            args, kwargs = _cast_args(args, kwargs, lambda t: self._cast(t, self.dtype))
        elif kind == FP32:
            args, kwargs = _cast_args(args, kwargs, lambda t: self._cast(t, torch.float32)
                                      if _eligible(t) and t.dtype in _LOWER_PRECISION else t)
        elif kind == FP32_DTYPE:
            first = args[0] if args else None
            if kwargs.get("dtype") is None and _eligible(first) and first.dtype in _LOWER_PRECISION:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif kind == PROMOTE:
            floats = [t for t in tree_leaves((args, kwargs)) if _eligible(t)]
            if floats:
                widest = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
                args, kwargs = _cast_args(args, kwargs, lambda t: self._cast(t, widest))
        return func(*args, **kwargs)


def _cast_args(args: tuple[Any, ...], kwargs: dict[str, Any],
               cast: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast the arguments last to first, as autocast's C++ kernels do: they cast in the call
    expression ``op(cached_cast(args)...)``, whose arguments GCC evaluates right to left. The
    order decides which cast is allocated first, so it shows in a trace."""
    new_kwargs = {k: tree_map(cast, kwargs[k]) for k in reversed(list(kwargs))}
    new_args = [tree_map(cast, a) for a in reversed(args)][::-1]
    return tuple(new_args), {k: new_kwargs[k] for k in kwargs}


def tree_leaves(obj: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    return tree_flatten(obj)[0]


@contextlib.contextmanager
def emulate_autocast() -> Iterator[None]:
    """For the duration of a meta capture: ``torch.autocast`` enters the emulation."""
    global _STATE
    from torch.amp import autocast_mode
    import torch.utils.checkpoint as ckpt

    state = _State()
    cls = autocast_mode.autocast
    saved: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]] = (
        cls.__init__, cls.__enter__, cls.__exit__, ckpt._get_autocast_kwargs)
    orig_init, orig_enter, orig_exit, orig_kwargs = saved

    def init(self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
             cache_enabled: bool | None = None) -> None:
        self._vramkit_request = (device_type, dtype, enabled, cache_enabled)
        with warnings.catch_warnings():  # "CUDA is not available ... Disabling autocast"
            warnings.simplefilter("ignore")
            orig_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def enter(self: Any) -> Any:
        request = getattr(self, "_vramkit_request", None)
        if request is None or request[0] not in POLICIES:
            self._vramkit_entered = "real"
            return orig_enter(self)
        device_type, dtype, enabled, cache_enabled = request
        if torch._C._current_graph_task_id() != -1 and enabled and state.regions == []:
            device_type = state.recompute_device  # a checkpoint recomputing an emulated region
        dtype = dtype or (torch.float16 if device_type == "cuda" else torch.bfloat16)
        state.regions.append((device_type, dtype, bool(enabled)))
        mode = None
        if enabled and (len(state.regions) == 1 or state.regions[-2][:2] != (device_type, dtype)
                        or not state.regions[-2][2]):
            mode = _Emulation(state, device_type, dtype, True if cache_enabled is None else bool(cache_enabled))
            mode.__enter__()  # type: ignore[no-untyped-call]  # TorchFunctionMode.__enter__ is unannotated
        # The mode that acts in this region: its own, or the enclosing one it shares the policy with.
        state.modes.append(mode if mode is not None else (state.modes[-1] if state.modes else None))
        self._vramkit_entered = mode
        return self

    def exit(self: Any, *exc: Any) -> Any:
        mode = self.__dict__.pop("_vramkit_entered", "real")
        if mode == "real":
            return orig_exit(self, *exc)
        if mode is not None:
            mode.__exit__(*exc)
        state.regions.pop()
        state.modes.pop()
        if not state.regions:
            state.cache.clear()  # the cast cache lives until the outermost region exits
        return False

    def autocast_kwargs(device_type: str = "cuda") -> tuple[dict[str, Any], dict[str, Any]]:
        device_kwargs, cpu_kwargs = orig_kwargs(device_type)
        active = [r for r in state.regions if r[2]]
        if active:
            # A checkpoint records the autocast state to restore in its recomputation; report
            # the emulated region as CPU autocast, which the recomputation always re-enters.
            _, dtype, _ = active[-1]
            cpu_kwargs = {"enabled": True, "dtype": dtype, "cache_enabled": True}
            state.recompute_device = active[-1][0]
        return device_kwargs, cpu_kwargs

    # patching torch.autocast (restored below) is the point of the emulation
    cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit  # type: ignore[method-assign]
    ckpt._get_autocast_kwargs = autocast_kwargs
    _STATE = state
    try:
        yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__, ckpt._get_autocast_kwargs = saved  # type: ignore[method-assign]
        _STATE = None
