"""Which ``scaled_dot_product_attention`` backend CUDA picks, for a target GPU architecture.

Follows ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (``select_sdp_backend``):
backends in priority order flash attention, memory-efficient attention, math (cuDNN attention
comes after math by default, so it is chosen only when the user disables the others), the
first whose checks pass. The user's ``torch.backends.cuda.enable_*_sdp`` switches and
``torch.nn.attention.sdpa_kernel`` are honoured, as torch reads them (the same global flags).

Only shapes, dtypes, strides and the target architecture enter; never values.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Backend", "cuda_backend", "flash_ok", "efficient_ok"]

Backend = Literal["flash", "efficient", "cudnn", "math"]


def _common_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    # check_tensor_shapes: 4-D query, key and value; check_nonzero_sequence_lengths_dense;
    # check_last_dim_stride_equals_1_dense.
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    if query.size(-2) == 0 or key.size(-2) == 0:
        return False
    return all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (query, key, value))


def _heads_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool, gqa: bool) -> bool:
    # check_batch_size_and_num_heads_dense: equal batch sizes; equal head counts, or (where the
    # kernel supports grouped-query attention and enable_gqa is set) query heads a multiple of
    # the key/value heads.
    if not (query.size(0) == key.size(0) == value.size(0)):
        return False
    qh, kh, vh = query.size(1), key.size(1), value.size(1)
    if qh == kh == vh:
        return True
    return gqa and enable_gqa and kh == vh and kh > 0 and qh % kh == 0


def flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
             dropout_p: float, is_causal: bool, enable_gqa: bool, arch: tuple[int, int], grad: bool) -> bool:
    """can_use_flash_attention: fp16 or bf16 on sm80 to sm121; no attention mask; one head size
    up to 256 for q, k and v; on sm86-89 and sm120-121, with grad, not a head size of 193-224,
    nor above 224 with dropout;
    is_causal with as many queries as keys only; grouped-query attention supported."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not _common_ok(query, key, value) or mask is not None:
        return False
    if arch < (8, 0) or arch >= (13, 0):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    head = query.size(-1)
    if not (key.size(-1) == value.size(-1) == head and head <= 256):
        return False
    if (arch in ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1)) and grad and any(t.requires_grad for t in (query, key, value))
            and (192 < head <= 224 or (head > 224 and dropout_p > 0))):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if is_causal and query.size(-2) != key.size(-2):
        return False  # check_flash_causal_non_square_seqlens
    return _heads_ok(query, key, value, enable_gqa, gqa=True)


def efficient_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 enable_gqa: bool, arch: tuple[int, int]) -> bool:
    """can_use_mem_efficient_attention: fp32 or fp16 (bf16 on sm80+) on sm50 and later; an
    attention mask is allowed; the head sizes of q and k equal and of q, k, v multiples of 8
    (fp16/bf16) or 4 (fp32) on sm80+; no grouped-query attention: its dense constraints
    instantiate check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention*/>,
    so q, k and v need equal head counts (seen on an H200: an fp32 GQA Llama ran the math path)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not _common_ok(query, key, value) or not (5, 0) <= arch < (13, 0):
        return False
    allowed = (torch.float32, torch.float16, torch.bfloat16) if arch >= (8, 0) else (torch.float32, torch.float16)
    if query.dtype not in allowed or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    # minimum_gemm_alignment: sm80+ 8 for 16-bit types and 4 for fp32; sm75 8 and 1; older 1.
    if arch >= (8, 0):
        align = 4 if query.dtype == torch.float32 else 8
    else:
        align = 8 if arch >= (7, 5) and query.dtype == torch.float16 else 1
    if query.size(-1) != key.size(-1) or any(t.size(-1) % align for t in (query, value)):
        return False
    return _heads_ok(query, key, value, enable_gqa, gqa=False)


def cuda_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, enable_gqa: bool, arch: tuple[int, int], grad: bool) -> Backend:
    """The backend ``select_sdp_backend`` returns for these inputs on a GPU of compute
    capability `arch`."""
    if flash_ok(query, key, value, mask, dropout_p, is_causal, enable_gqa, arch, grad):
        return "flash"
    if efficient_ok(query, key, value, mask, enable_gqa, arch):
        return "efficient"
    if torch.backends.cuda.math_sdp_enabled():
        return "math"
    if torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    raise RuntimeError("scaled_dot_product_attention: no available kernel for these inputs on the target GPU "
                       "(the math backend is disabled and no fused backend accepts them)")
