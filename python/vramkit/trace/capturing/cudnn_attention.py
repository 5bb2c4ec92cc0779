"""The workspace cuDNN's attention backward takes from the caching allocator.

``_scaled_dot_product_cudnn_attention_backward`` (``cudnn/MHA.cpp``, ``run_cudnn_SDP_bprop``)
allocates dq, dk and dv, re-lays grad_out out when its last dimension is strided, and then
executes cuDNN's plan with a workspace it takes from the caching allocator
(``at::empty({workspace_size}, kByte)``) and frees when the plan is queued. The meta kernel
allocates the gradients only; the workspace is the plan's, and no source states its size.

Read off an H200 (torch 2.11.0+cu130, cuDNN 9.19.0, sm_90; ``benchmarks/gpu/attention_probe.py``),
six shapes (fp16 and bf16; head sizes 64 and 128; sequences 512 to 2048; grouped-query 16/4
and 14/2), each to the byte:

    4 * B * Hq * Lq * D            a float32 accumulator for dq
  + 4 * B * Hq * Lq                float32 row sums of dO * O (the softmax's derivative)
  + 256
  + 2 * B * Hq * Lk * D * size     with grouped-query heads: dk and dv for every query head,
                                   in the inputs' dtype, reduced to the key/value heads after

The same shapes on another cuDNN may take another plan; the size is marked as an estimate
(``trace.meta["estimated_bytes"]``).
"""

from __future__ import annotations

import torch

__all__ = ["BACKWARD", "OP_NAME", "ESTIMATE", "backward_workspace_bytes"]

BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
OP_NAME = "cudnn attention workspace (estimated)"
ESTIMATE = (f"allocations named {OP_NAME!r} are cuDNN's attention backward workspace, sized by a rule read off "
            "an H200 with cuDNN 9.19 (vramkit.trace.capturing.cudnn_attention): estimates, not cuDNN's own sizes")


def backward_workspace_bytes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The workspace of one cuDNN attention backward over (B, H, L, D) query, key and value."""
    batch, heads, seq_q, dim = query.shape
    seq_k, dim_v = key.size(-2), value.size(-1)
    n = 4 * batch * heads * seq_q * dim + 4 * batch * heads * seq_q + 256
    if key.size(1) != heads:
        n += batch * heads * seq_k * (dim + dim_v) * query.element_size()
    return int(n)
