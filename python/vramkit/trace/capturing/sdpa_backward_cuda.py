"""What CUDA's attention backward kernels allocate besides the gradients they return.

The meta kernels of ``_scaled_dot_product_{efficient,flash,cudnn}_attention_backward`` allocate
the gradients (and the memory-efficient one its padded ``grad_bias``), nothing else. The CUDA
kernels (``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``cudnn/MHA.cpp``, torch
2.11) also make temporaries that live only inside the call but add to its peak, often the
step's. During a meta capture with ``CudaChoices.attention`` on, ``install`` registers, at
``AutogradMeta``, a kernel for each backward op that makes them with ordinary ATen ops on meta
(so the capture records them as it records any op's output, under the ops CUDA itself runs:
``clone``, ``mul``, ``sum``, ``empty``), calls the op's own meta kernel below autograd, and
drops them in the order the C++ destroys them. Sizes are from the source unless a comment says
otherwise.

Memory-efficient (``_efficient_attention_backward``, CUTLASS kernels chosen by ``cutlassB.h``):

1. ``grad_out.transpose(1, 2).contiguous()``: a copy when the (B, L, H, D) view of grad_out is
   not contiguous (``o.sum().backward()`` hands down an expanded, stride-0 tensor);
2. the op's outputs: grad_q, grad_k, grad_v, and grad_bias (last dim padded to 16);
3. ``delta`` (B, H, Lq) float32: an empty tensor when the kernel computes it (fp16/bf16
   kernels except on sm70 with gradients kept in global memory); otherwise
   ``(grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()``, whose product
   (B, Lq, H, Dv) float32 and row sums are held until that expression ends;
4. the kernel's workspace, ``Params::workspace_size()``: per (batch, head), float32 staging
   for grad_k and grad_v when the kernel cannot keep them in registers
   (``num_splits_key * block_j * align_up(D, block_i)`` each) and grad_q's per-tile
   accumulators with a 16-byte lock header (``ceil(Lq / block_i) * ceil(Dq / block_j)`` tiles
   of ``block_i * block_j`` floats), rounded up to 4 floats;
5. freed: delta, then the workspace, then the grad_out copy.

Flash (``_flash_attention_backward`` -> ``mha_bwd``): the grad_out copy (when its (B, L, H, D)
view is not contiguous), then dq, dk, dv, then ``softmax_d`` (B, H,
round_up(Lq, 128)) float32 and ``dq_accum`` (B, round_up(Lq, 128), H, round_up(D, 32 or 64))
float32 (with deterministic algorithms, ``nsplits`` zeroed copies), and for grouped-query
attention dk/dv expanded to every query head; freed in reverse.

cuDNN (``run_cudnn_SDP_bprop``, cuDNN >= 9.5.1): dq, dk, dv, then grad_out re-laid out as out
when its last dimension is not contiguous, then the plan's workspace (``cudnn_attention``,
recorded by the capture's workspace handler with CudaChoices.workspaces on), all live together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["EfficientKernel", "efficient_kernel", "efficient_workspace_bytes", "flash_buffers", "register"]

_HALF = (torch.float16, torch.bfloat16)
# GPUs with about 100 KB or less of shared memory a block: generate_kernels.py keeps the 64-row
# kernels as a "fallback ... for GPUs with less shmem (Sm75, Sm86 ...)", and its K=96 kernel is
# "the only kernel that can keep the outputs on RF on Sm86/Sm89". Which 128-row kernels fit is
# a shared-memory check at launch; this set is our reading of it, not measured.
_SMALL_SHARED_MEMORY = {(7, 5), (8, 6), (8, 7), (8, 9), (12, 0), (12, 1)}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


# ------------------------------------------------------------------------- memory-efficient


@dataclass(frozen=True)
class EfficientKernel:
    """The CUTLASS backward kernel ``dispatch_cutlassB`` launches: its tile and what it keeps
    where (generate_kernels.py's ``BwdKernel`` list, taken in its sort order)."""

    sm: int  # the kernel family: 50, 70, 75 or 80 (sm80 kernels serve sm80 and later)
    half: bool
    block_i: int
    block_j: int
    max_k: int

    @property
    def output_in_rf(self) -> bool:  # kOutputInRF: grad_k, grad_v accumulate in registers
        return self.half and self.max_k <= self.block_i

    @property
    def computes_delta(self) -> bool:  # kKernelComputesDelta
        return self.half and (self.output_in_rf or self.sm != 70)

    @property
    def accumulates_grad_q(self) -> bool:  # kNeedsAccumGradQ: split keys (sm70+) or fp16/bf16 output
        return self.sm >= 70 or self.half

    @property
    def accumulates_grad_kv(self) -> bool:  # kNeedsAccumGradK/V
        return not self.output_in_rf and self.half


def efficient_kernel(dtype: torch.dtype, arch: tuple[int, int], head_dim: int, dropout: bool) -> EfficientKernel:
    """The kernel chosen for inputs of `dtype` and largest head size `head_dim` on `arch`: the
    smallest ``max_k`` that holds the head, then the larger row block where the architecture
    has one that fits (128 rows for max_k above 64 on sm80+, or on sm70+ for fp16/bf16)."""
    half = dtype in _HALF
    sm = 80 if arch >= (8, 0) else 75 if arch >= (7, 5) else 70 if arch >= (7, 0) else 50
    max_k = next(k for k in (32, 64, 128, 1 << 16) if head_dim <= k)
    if half and not dropout and arch in ((8, 6), (8, 9)) and 64 < head_dim <= 96:
        return EfficientKernel(sm, half, 128, 64, 96)  # the K=96 kernel, dispatched on cc 86/89 only
    big = max_k > 64 and (sm >= 80 or (sm >= 70 and half)) and arch not in _SMALL_SHARED_MEMORY
    block_i = 128 if big else 64
    preload = half and sm >= 80 and max_k <= block_i
    return EfficientKernel(sm, half, block_i, 128 if preload and max_k > 64 else 64, max_k)


def efficient_workspace_bytes(kernel: EfficientKernel, batch: int, heads: int, seq_q: int, seq_k: int,
                              head_dim: int, head_dim_v: int, deterministic: bool = False) -> int:
    """``Params::workspace_size()`` after the launch's key-splitting heuristic."""
    bi, bj = kernel.block_i, kernel.block_j
    splits = _ceil_div(seq_k, bj)
    if batch * heads >= 256 and seq_k <= 2 * bj:
        splits = 1  # enough blocks already
    if kernel.accumulates_grad_kv:
        splits = min(splits, 200 // (batch * heads))  # splitting would multiply the staging
    if kernel.sm < 70 or splits < 1 or deterministic:
        splits = 1
    gk = gv = gq = 0
    if kernel.accumulates_grad_kv:
        gk = splits * bj * _round_up(head_dim, bi)
        gv = splits * bj * _round_up(head_dim_v, bi)
    if kernel.accumulates_grad_q:
        # GradQTempStorage: int32 lock, counter, 2 pad, then one tile of float accumulators
        gq = _ceil_div(seq_q, bi) * _ceil_div(head_dim, bj) * (4 + bi * bj)
    return batch * heads * _round_up(gk + gv + gq, 4) * 4


def _efficient(original: Callable[..., Any], arch: tuple[int, int]) -> Callable[..., Any]:
    def backward(grad_out: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_bias: torch.Tensor | None, out: torch.Tensor, logsumexp: torch.Tensor,
                 philox_seed: torch.Tensor, philox_offset: torch.Tensor, dropout_p: float,
                 grad_input_mask: list[bool], is_causal: bool = False, scale: float | None = None) -> Any:
        args = (grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                grad_input_mask, is_causal)
        if grad_out is None or _fake(query) or query.size(0) > 0xFFFF:
            return _below_autograd(original, args, scale)  # (a batch over 65535 runs in chunks: not modelled)
        go = _copy_if_strided(grad_out.transpose(1, 2))
        grads = _below_autograd(original, args, scale)
        batch, heads, seq_q, dim = query.shape
        seq_k, dim_v = key.size(2), value.size(3)
        kernel = efficient_kernel(query.dtype, arch, max(dim, dim_v), dropout_p != 0)
        if kernel.computes_delta:
            delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=query.device)
        else:
            # One C++ expression: its temporaries live until it ends, then go in reverse order.
            go_f = go.to(torch.float32)
            out_f = out.transpose(1, 2).to(torch.float32)
            product = go_f * out_f
            sums = product.sum(-1)
            delta = sums.transpose(-2, -1).contiguous()
            del sums, product, out_f, go_f
        size = efficient_workspace_bytes(kernel, batch, heads, seq_q, seq_k, dim, dim_v, _deterministic())
        workspace = torch.empty(size, dtype=torch.uint8, device=query.device) if size else None
        del delta, workspace, go  # the launch lambda's delta, then the function's locals
        return grads

    return backward


# ------------------------------------------------------------------------------------- flash


def flash_buffers(batch: int, heads: int, heads_k: int, seq_q: int, seq_k: int, head_dim: int, dtype: torch.dtype,
                  deterministic: bool = False, splits: int = 1) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What ``mha_bwd`` allocates after dq, dk and dv, in order: (name, shape, dtype). `head_dim`
    is the padded head size the kernel sees (a multiple of 8); with deterministic algorithms
    dq_accum has `splits` copies (``ceil(SMs / (batch * heads))``, which needs the SM count)."""
    seq_q_rounded = _round_up(seq_q, 128)
    dim_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    accum: tuple[int, ...] = (batch, seq_q_rounded, heads, dim_rounded)
    out = [("softmax_d", (batch, heads, seq_q_rounded), torch.float32),
           ("dq_accum", (splits, *accum) if deterministic else accum, torch.float32)]
    if heads_k != heads:  # grouped-query attention: dk, dv per query head, summed into dk, dv after
        out += [(name, (batch, seq_k, heads, head_dim), dtype) for name in ("dk_expanded", "dv_expanded")]
    return out


def _flash(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(grad_out: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: torch.Tensor | None,
                 cum_seq_k: torch.Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                 philox_seed: torch.Tensor, philox_offset: torch.Tensor, scale: float | None = None) -> Any:
        args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, philox_seed, philox_offset)
        if grad_out is None or _fake(query) or cum_seq_q is not None:
            return _below_autograd(original, args, scale)  # (nested/varlen inputs: not modelled)
        # "CUDA code assumes that dout is contiguous". (`out` is made contiguous too, but CUDA's
        # forward returns it as a transposed (B, L, H, D) tensor, so that copies nothing; the meta
        # kernel lays it out (B, H, L, D), which must not make a copy here.)
        go = _copy_if_strided(grad_out.transpose(1, 2))
        grads = _below_autograd(original, args, scale)
        batch, heads, seq_q, dim = query.shape
        # deterministic dq_accum needs the SM count, which a CudaChoices does not carry: one split
        temps = [torch.empty(shape, dtype=dtype, device=query.device) for _, shape, dtype in
                 flash_buffers(batch, heads, key.size(1), seq_q, key.size(2), dim, query.dtype)]
        while len(temps) > 1:
            temps.pop()  # mha_bwd's locals in reverse: dv/dk_expanded, dq_accum
        del temps  # softmax_d, returned to _flash_attention_backward and dropped at its end
        del go
        return grads

    return backward


# ------------------------------------------------------------------------------------- cuDNN


def _cudnn(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(grad_out: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, philox_seed: torch.Tensor, philox_offset: torch.Tensor,
                 attn_bias: torch.Tensor | None, cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None,
                 max_q: int, max_k: int, dropout_p: float, is_causal: bool, scale: float | None = None) -> Any:
        args = (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                cum_seq_k, max_q, max_k, dropout_p, is_causal)
        relaid = None
        if grad_out is not None and not _fake(query) and cum_seq_q is None and grad_out.stride(-1) != 1:
            # permute_to_matching_layout(o, dO): grad_out copied into out's memory layout (made
            # here, before the gradients, so that it lives beside them and the workspace, as in
            # the kernel, which re-lays it out after allocating them)
            relaid = torch.empty_like(out).copy_(grad_out)
        grads = _below_autograd(original, args, scale)
        del relaid
        return grads

    return backward


# ---------------------------------------------------------------------------------- register


def _fake(t: Any) -> bool:
    # dynamo/AOTAutograd tracing a compiled region: the compiled graph makes its own choices
    return isinstance(t, FakeTensor)


def _copy_if_strided(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _below_autograd(op: Any, args: tuple[Any, ...], scale: float | None) -> Any:
    # Below autograd this kernel is not reached again; the capture's dispatch mode still is.
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args, scale=scale)


def register(lib: torch.library.Library, arch: tuple[int, int]) -> None:
    """Register the three backward kernels in `lib` (an ``aten`` IMPL library) for a meta
    capture targeting compute capability `arch`."""
    aten = torch.ops.aten
    lib.impl("_scaled_dot_product_efficient_attention_backward",
             _efficient(aten._scaled_dot_product_efficient_attention_backward.default, arch), "AutogradMeta")
    lib.impl("_scaled_dot_product_flash_attention_backward",
             _flash(aten._scaled_dot_product_flash_attention_backward.default), "AutogradMeta")
    lib.impl("_scaled_dot_product_cudnn_attention_backward",
             _cudnn(aten._scaled_dot_product_cudnn_attention_backward.default), "AutogradMeta")
