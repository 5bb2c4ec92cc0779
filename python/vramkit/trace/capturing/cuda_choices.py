"""The dispatch choices a CUDA run makes that a meta (or CPU) run makes differently.

ATen and ``torch.optim`` pick implementations by device. On ``meta`` they take the paths a CPU
takes (or none at all), so a meta capture of a step would predict a CPU's memory, not a GPU's.
During a meta capture, ``CudaChoices`` makes each choice as CUDA makes it, for a target GPU
architecture; each is switchable, and with all off (``CudaChoices.off()``) a meta capture
equals a CPU capture event for event.

* ``dropout``: ``aten::dropout`` (``Dropout.cpp``) calls ``native_dropout`` when
  ``train && is_fused_kernel_acceptable(input, p)`` — an input on CUDA (or XPU, lazy,
  privateuse1), ``0 < p < 1``, ``numel > 0``. It saves a **bool** mask. Elsewhere
  ``_dropout_impl`` draws a noise tensor in the input's dtype (``empty_like`` + ``bernoulli_``)
  and multiplies by it, and autograd saves the noise: 1 more byte an element in bf16, 3 in fp32.
  ``dropout_`` (in place) takes the noise path on every device, and so stays as it is.
* ``optimizer``: ``torch.optim.optimizer._default_to_fused_or_foreach`` picks ``foreach``
  when every parameter is on a device of ``_get_foreach_kernels_supported_devices()`` (CUDA,
  XPU, privateuse1 — not meta or CPU) and the optimizer's ``foreach``/``fused`` were left at
  None; ``fused=True`` is checked against ``_get_fused_kernels_supported_devices()``. During
  the capture "meta" is added to the foreach list, so the optimizer runs the implementation it
  runs on CUDA (foreach's ``_foreach_*`` temporaries, e.g. Adam's ``_foreach_sqrt`` of every
  ``exp_avg_sq``). ``fused=True`` is the step's own choice and runs on meta whatever the
  choices: "meta" joins the fused list, and fused kernels without a meta kernel
  (``_fused_sgd_``, ``_fused_adagrad_``, the ``tensor_lr`` overloads) get a no-op one for the
  capture: they write in place and allocate nothing.
* ``attention``: ``scaled_dot_product_attention`` on meta has no backend to choose and runs
  the math path (an L x S attention matrix). On CUDA, ``sdp_utils.cpp`` chooses flash,
  memory-efficient, cuDNN or math by dtype, head size, mask, GQA and the GPU's architecture:
  ``sdpa_rules`` follows those rules for ``arch`` and ``cudnn`` (torch prefers cuDNN's attention
  on sm90/sm10x with cuDNN above 9.15) and calls the chosen backend's own op, whose
  meta kernel allocates what the CUDA kernel returns (flash: the output and a float32
  log-sum-exp row per query; memory-efficient: the same, rows padded to 32; math: the
  attention matrix, in float32 for fp16/bf16 inputs). With ``attention`` off, torch's own CPU
  chooser decides (``_fused_sdp_choice`` on stand-in CPU tensors of the same shapes and
  strides, which allocate no more than one row). The backends' backward ops also make, on
  meta, the temporaries their CUDA kernels make (``sdpa_backward_cuda``: a contiguous copy of
  grad_out, float32 accumulators and workspaces).

* ``rms_norm``: ``nn.RMSNorm``/``F.rms_norm`` reach ``_fused_rms_norm``, one kernel with its own
  backward on CUDA and a decomposition (float32 copy, pow, mean, rsqrt, two products, each saved)
  elsewhere: on meta it runs as the kernel does (``rms_norm_cuda``).
* ``nccl``: a bucket DDP all-reduces (``capture_step._buckets``) is held, at its free, until
  DDP's next all-reduce starts or the step ends (``Recorder.hold``). At the bucket rebuild of
  DDP's second step the old buckets are freed in its forward; on a GPU they lived on beside the
  new ones until the backward's first all-reduce (ProcessGroupNCCL keeps a collective's tensors
  until it has seen the work complete). Calibrated on an H200: it reproduces both DDP runs
  that had the overlap (``CudaChoices`` says more).

Not a choice but a gap: ``torch.nn.utils``' gradient clipping (``clip_grad_norm_``,
``clip_grad_value_``, ``get_total_norm``, ``clip_grads_with_norm_``) asks
``_foreach_utils._device_has_foreach_support``, which is true on CUDA and on CPU and false on
meta: on meta ``foreach=None`` would take the per-tensor loop neither real device takes, and
``foreach=True`` (as LLM recipes pass it) raises "can't use the foreach API on meta tensors".
During a meta capture "meta" is a foreach device for that check, so clipping runs the
``_foreach_norm``/``_foreach_mul_`` path CUDA and CPU both run, whatever the choices.

Each choice is installed for one capture and removed after it (``install``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ..target.dispatch import CudaChoices
from .rms_norm_cuda import fused_rms_norm
from .sdpa_backward_cuda import register as register_attention_backward
from .sdpa_rules import Backend, cuda_backend

__all__ = ["CudaChoices", "install"]


# ---------------------------------------------------------------------------------- dropout


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as on CUDA: the fused ``native_dropout`` (bool mask) whenever
    ``is_fused_kernel_acceptable``; otherwise ``_dropout_impl``'s early returns."""
    if input.is_nested or (train and 0.0 < p < 1.0 and input.numel() > 0):
        out: torch.Tensor = torch.ops.aten.native_dropout(input, p, train)[0]
        return out
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)  # p == 1


# ---------------------------------------------------------------------------------- attention


def _bool_mask_to_float(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # attention.cpp convert_boolean_attn_mask: True keeps, False gets -inf, in the query's dtype.
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), torch.tensor(float("-inf"), dtype=dtype, device=mask.device),
                       torch.tensor(0.0, dtype=dtype, device=mask.device))


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with `t`'s shape, dtype and last-dim stride, over one row of memory: enough
    for torch's CPU backend chooser, which reads shapes, strides and dtypes, never values."""
    strides = [0] * t.dim()
    if t.dim():
        strides[-1] = t.stride(-1)
    row = max(1, (t.size(-1) - 1) * t.stride(-1) + 1) if t.dim() else 1
    return torch.empty(row, dtype=t.dtype).as_strided(t.shape, strides)


def _cpu_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> Backend:
    # Outside the capture's dispatch mode: the stand-ins are not the step's allocations.
    choice: Any
    with _disable_current_modes():
        choice = torch.ops.aten._fused_sdp_choice.default(
            _stand_in(query), _stand_in(key), _stand_in(value), None if mask is None else _stand_in(mask),
            dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    flash: Any = torch.nn.attention.SDPBackend.FLASH_ATTENTION
    return "flash" if int(choice) == int(flash) else "math"


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
          is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    # The math kernel itself computes fp16/bf16 in float32 (unless
    # allow_fp16_bf16_reduction_math_sdp) and casts the result back, on every device.
    out: torch.Tensor = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    return out


def make_attention(choices: CudaChoices | None) -> Any:
    """The ``scaled_dot_product_attention`` a capture registers at AutogradMeta: the backend CUDA
    would choose for `choices.arch` (or, with attention off or on a CPU capture, the CPU's)."""
    on_cuda = choices is not None and choices.attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if isinstance(query, FakeTensor):
            # dynamo tracing a compiled region: torch's own composite, as compiling
            # it on a GPU would record; the compiled graph makes its own choice (compiled_regions)
            decomposed: torch.Tensor = torch.ops.aten.scaled_dot_product_attention.default.decompose(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            return decomposed
        mask = _bool_mask_to_float(attn_mask, query.dtype)
        if on_cuda:
            assert choices is not None
            backend = cuda_backend(query, key, value, mask, dropout_p, is_causal, enable_gqa, choices.arch,
                                   grad=torch.is_grad_enabled(), cudnn=choices.cudnn)
        else:
            backend = _cpu_backend(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)
        out: torch.Tensor
        if backend == "flash" and not on_cuda:
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
            return out
        if backend == "flash":
            head = query.size(-1)
            pad = (-head) % 8  # attention.cpp pads the head dim to a multiple of 8, then slices it back
            q, k, v = (torch.nn.functional.pad(t, (0, pad)) if pad else t for t in (query, key, value))
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale if scale is not None else head ** -0.5)[0]
            return out[..., :head] if pad else out
        if backend == "efficient":
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if mask is not None:
                mask = _pad_mask(mask, query, key)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, grad, dropout_p, is_causal, scale=scale)[0]
            return out
        if backend == "cudnn":
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale)[0]
            return out
        return _math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)

    return attention


def _pad_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """attention.cpp preprocess_mask for the memory-efficient kernel: a mask whose strides are
    not multiples of 8 (or whose last stride is not 1) is padded by 8 - S % 8 columns (a copy)
    and sliced back; then expanded to (B, H, L, S)."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        s = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - s % 8))[..., :s]
    return mask.expand(query.size(0), query.size(1), query.size(-2), key.size(-2))


# ---------------------------------------------------------------------------------- install


_FUSED_OPTIMIZERS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def install(choices: CudaChoices | None, device: str) -> Iterator[None]:
    """Register the capture's kernels for its duration: attention (always, CPU rules unless
    CUDA's are on), and on meta the chosen CUDA choices."""
    lib = torch.library.Library("aten", "IMPL")
    undo: list[Any] = []
    try:
        meta_cuda = choices if device == "meta" else None
        lib.impl("scaled_dot_product_attention", make_attention(meta_cuda), "AutogradMeta")
        if meta_cuda is not None and meta_cuda.attention:
            # the temporaries CUDA's attention backward kernels make besides their gradients
            register_attention_backward(lib, meta_cuda.arch)
        if meta_cuda is not None and meta_cuda.dropout:
            lib.impl("dropout", _dropout, "AutogradMeta")
        if meta_cuda is not None and meta_cuda.rms_norm:
            lib.impl("_fused_rms_norm", fused_rms_norm, "AutogradMeta")
        if device == "meta":
            # fused=True is the step's own choice, not a default: on meta it runs whatever the
            # choices, with a no-op meta kernel (they write in place, allocate nothing) for each
            # fused optimizer overload that has none (_fused_sgd_, _fused_adagrad_, tensor_lr forms).
            undo.append(_optimizer_devices(foreach=meta_cuda is not None and meta_cuda.optimizer))
            undo.append(_clipping_foreach_on_meta())
            for name in _FUSED_OPTIMIZERS:
                if hasattr(torch.ops.aten, name):  # (torch.ops.aten loads ops on first access)
                    for overload in getattr(torch.ops.aten, name).overloads():
                        full = name if overload == "default" else f"{name}.{overload}"
                        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{full}", "Meta"):
                            lib.impl(full, _no_op, "Meta")
        yield
    finally:
        for restore in reversed(undo):
            restore()
        lib._destroy()


def _clipping_foreach_on_meta() -> Any:
    """Make meta a foreach device for ``_foreach_utils._device_has_foreach_support`` (gradient
    clipping's check; the optimizers read their own imported copy, which ``_optimizer_devices``
    handles); return the undo."""
    from torch.utils import _foreach_utils

    original = _foreach_utils._get_foreach_kernels_supported_devices
    _foreach_utils._get_foreach_kernels_supported_devices = lambda: [*original(), "meta"]

    def restore() -> None:
        _foreach_utils._get_foreach_kernels_supported_devices = original

    return restore


def _optimizer_devices(foreach: bool) -> Any:
    """Add "meta" to torch.optim's fused device list, and with `foreach` to its foreach list;
    return the undo."""
    from torch.optim import optimizer as opt_module

    # Looked up in optimizer.py's globals at each call (by _default_to_fused_or_foreach and
    # _device_dtype_check_for_fused), so replacing them there reaches every optimizer.
    names = ("_get_foreach_kernels_supported_devices",) * foreach + ("_get_fused_kernels_supported_devices",)
    originals = {name: getattr(opt_module, name) for name in names}

    def with_meta(original: Any) -> Any:
        return lambda: [*original(), "meta"]

    for name in names:
        setattr(opt_module, name, with_meta(originals[name]))

    def restore() -> None:
        for name in names:
            setattr(opt_module, name, originals[name])

    return restore
