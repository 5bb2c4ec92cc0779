"""``nn.RMSNorm`` and ``F.rms_norm`` as CUDA runs them, in a meta capture (``CudaChoices.rms_norm``).

``aten::rms_norm`` calls ``aten::_fused_rms_norm`` for every input but a channels-last or
complex one, or one whose weight has another dtype (``layer_norm.cpp``: those take the
composite). On CUDA ``_fused_rms_norm`` is one kernel with its own autograd formula: it returns
the output and ``rstd``, one float32 per normalized row, and saves the input, ``rstd`` and the
weight for ``_fused_rms_norm_backward``, which returns the input's and the weight's gradients.
On CPU and meta the op has no kernel and decomposes (``CompositeImplicitAutograd``): the input
upcast to float32, squared, averaged, ``rsqrt``, multiplied twice, cast back; autograd then
saves what each of those ops needs, among them the float32 copy and the normalized product:
activation-sized tensors a CUDA run never holds (for bf16 inputs, 2 to 3 times the input's
bytes per norm).

During a meta capture with the choice on, ``_fused_rms_norm`` runs as the CUDA kernel does,
its allocations made on meta (so the capture's mode records them): the forward's output and
``rstd``, the backward's two gradients. Not modelled: the backward kernel's per-block partial
sums of the weight's gradient, which for large row counts are a few float32 rows of the
weight's size (kilobytes to a few MiB).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["fused_rms_norm"]


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's ``_fused_rms_norm``: what it allocates and saves, without computing anything."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
                eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(normalized_shape)
        stat_shape = tuple(input.shape[: input.dim() - n]) + (1,) * n
        # rstd is kept in the kernel's accumulation type: float32 for half, bfloat16 and float32
        accumulate = torch.float64 if input.dtype == torch.float64 else torch.float32
        out = torch.empty_like(input, memory_format=torch.contiguous_format)
        rstd = torch.empty(stat_shape, dtype=accumulate, device=input.device)
        ctx.save_for_backward(input, rstd, weight)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # (no zeros for rstd's gradient: CUDA's formula makes none)
        return out, rstd

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_rstd: torch.Tensor | None) -> tuple[Any, ...]:
        input, rstd, weight = ctx.saved_tensors
        grad_input = torch.empty_like(input, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_weight, None


def fused_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
                   eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fused_rms_norm``'s ``AutogradMeta`` kernel for a meta capture (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(input, FakeTensor):
        # dynamo tracing a compiled region: torch's own composite; the compiled graph's plan is
        # inductor's (compiled_regions)
        decomposed: tuple[torch.Tensor, torch.Tensor] = torch.ops.aten._fused_rms_norm.default.decompose(
            input, normalized_shape, weight, eps)
        return decomposed
    out, rstd = _FusedRmsNorm.apply(input, list(normalized_shape), weight, eps)  # type: ignore[no-untyped-call]
    return out, rstd
