"""Which ``scaled_dot_product_attention`` backend CUDA picks, for a target GPU architecture.

Follows ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (``select_sdp_backend``): the
first backend in priority order whose checks pass. The order is cuDNN attention, flash,
memory-efficient, math where torch prefers cuDNN (``check_prefer_cudnn_attention``: cuDNN above
9.15.0 on sm90 or sm10x, unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set; seen on an H200 with
torch 2.11 and cuDNN 9.19: every fp16/bf16 causal shape ran cuDNN), else flash,
memory-efficient, math, cuDNN (so cuDNN is chosen only when the user disables the others). The
user's ``torch.backends.cuda.enable_*_sdp`` switches and ``torch.nn.attention.sdpa_kernel``
are honoured, as torch reads them (the same global flags).

Only shapes, dtypes, strides, the target architecture and its cuDNN version enter; never values.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["Backend", "cuda_backend", "cudnn_ok", "cudnn_preferred", "flash_ok", "efficient_ok"]

Backend = Literal["flash", "efficient", "cudnn", "math"]


def _common_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    # check_tensor_shapes: 4-D query, key and value; check_nonzero_sequence_lengths_dense;
    # check_last_dim_stride_equals_1_dense, which on CUDA also asks it of the attention mask: a
    # mask laid out with its last dim strided (T5's relative position bias, permuted from
    # (q, k, heads), as transformers <= 5.17 passes it) sends the call to the math path. Seen on
    # an H200: T5's self-attention ran math, its cross-attention (a contiguous mask) efficient.
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    if query.size(-2) == 0 or key.size(-2) == 0:
        return False
    if mask is not None and mask.stride(-1) != 1:
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
    if not _common_ok(query, key, value, mask) or not (5, 0) <= arch < (13, 0):
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


def _mask_shape_ok(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    # sdp_utils_cpp.h check_attn_mask_shape: no grad; 2-D (L or 1, S or 1), or 4-D with batch and
    # heads each equal or 1.
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.size(-2) not in (query.size(-2), 1) or mask.size(-1) not in (key.size(-2), 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.size(0) in (1, query.size(0)) and mask.size(1) in (1, query.size(1))


def cudnn_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
             dropout_p: float, enable_gqa: bool, arch: tuple[int, int], cudnn: int | None, grad: bool) -> bool:
    """can_use_cudnn_attention: cuDNN 9 or later; fp16 or bf16 on sm80 to sm121; no dropout with
    cuDNN 9.11-9.13, and a dropout a multiple of 1/16; not under deterministic algorithms
    (unless warn-only); a mask that does not require grad, of a broadcastable shape; batch and
    heads up to 65535, grouped-query heads allowed; head sizes multiples of 8 up to 128 (256 on
    sm90/sm10x with cuDNN above 9.22, 192/128 from 9.11); a key length other than 1."""
    if cudnn is None or cudnn < 90000 or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if dropout_p > 0.0 and (91100 < cudnn < 91400 or dropout_p * 16.0 != int(dropout_p * 16.0)):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not _common_ok(query, key, value, mask) or not (8, 0) <= arch < (12, 2):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if not _mask_shape_ok(query, key, mask) or not _heads_ok(query, key, value, enable_gqa=True, gqa=True):
        return False
    if query.size(0) > 65535 or query.size(1) > 65535:
        return False
    d_qk, d_v = query.size(-1), value.size(-1)
    sm90_or_sm10x = arch == (9, 0) or arch[0] == 10
    d256 = sm90_or_sm10x and cudnn > 92200
    limit = 256 if d256 else 192 if (sm90_or_sm10x and cudnn >= 91100 and d_qk == 192 and d_v == 128) else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or key.size(-2) == 1:
        return False
    if dropout_p > 0.0 and query.size(-2) == 1:
        return False
    if d256 and grad and any(t.requires_grad for t in (query, key, value)):
        # check_cudnn_d256_bprop_head_dim: backward for d <= 128, 192/128 and 256/256 only
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


def cudnn_preferred(arch: tuple[int, int], cudnn: int | None) -> bool:
    """check_prefer_cudnn_attention: torch tries cuDNN's attention first on sm90 and sm10x with
    cuDNN above 9.15.0 (its fix for key lengths not a multiple of 128), unless the environment
    sets TORCH_CUDNN_SDPA_DEPRIORITIZED (read by torch once per process, as here at each call)."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().upper() in ("1", "ON", "YES", "TRUE", "Y"):
        return False
    return cudnn is not None and cudnn > 91500 and arch[0] in (9, 10)


def cuda_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, enable_gqa: bool, arch: tuple[int, int], grad: bool,
                 cudnn: int | None = None) -> Backend:
    """The backend ``select_sdp_backend`` returns for these inputs on a GPU of compute
    capability `arch` whose torch runs cuDNN version `cudnn` (None: no cuDNN)."""
    use_cudnn = cudnn_ok(query, key, value, mask, dropout_p, enable_gqa, arch, cudnn, grad)
    if use_cudnn and cudnn_preferred(arch, cudnn):
        return "cudnn"
    if flash_ok(query, key, value, mask, dropout_p, is_causal, enable_gqa, arch, grad):
        return "flash"
    if efficient_ok(query, key, value, mask, enable_gqa, arch):
        return "efficient"
    if torch.backends.cuda.math_sdp_enabled():
        return "math"
    if use_cudnn:
        return "cudnn"
    raise RuntimeError("scaled_dot_product_attention: no available kernel for these inputs on the target GPU "
                       "(the math backend is disabled and no fused backend accepts them)")
