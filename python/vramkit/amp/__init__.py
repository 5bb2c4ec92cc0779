"""Loss scaling for mixed-precision training: fused kernels and a GradScaler with PyTorch's API.

``GradScaler`` mirrors ``torch.amp.GradScaler`` (same defaults, methods, per-optimizer state
machine, error messages and ``state_dict`` keys, so a torch checkpoint's scaler state loads)
and works on NumPy arrays, torch tensors (CPU and CUDA), CuPy arrays and vramkit Buffers.
The unscale, the inf/NaN check and, for clipping, the gradient norm happen in one pass over
memory in C (CPU: AVX-512 / AVX2+F16C / portable, multithreaded) or CUDA.

Where it departs from PyTorch, on purpose:
- fp16 gradients are accepted (PyTorch raises "Attempting to unscale FP16 gradients."); the
  kernel computes in float32 and rounds back, as for any 16-bit type, and bf16 works on CUDA.
- a finite gradient that overflows when multiplied by inv_scale counts as inf.
- optional ``min_scale``, ``max_scale`` and ``hysteresis`` (back off only after N
  consecutive overflows), which PyTorch users keep asking for.
- ``step()`` also takes a list of gradient arrays plus a ``step_fn`` for frameworks without
  torch optimizers.
"""

from __future__ import annotations

from .functional import (
    get_num_threads,
    non_finite_check_and_unscale_,
    scale_,
    set_num_threads,
    simd_path,
    unscale_,
    unscale_and_norm_,
    update_scale_,
)
from .loss_scaling import GradScaler, OptState

__all__ = [
    "GradScaler",
    "OptState",
    "get_num_threads",
    "non_finite_check_and_unscale_",
    "scale_",
    "set_num_threads",
    "simd_path",
    "unscale_",
    "unscale_and_norm_",
    "update_scale_",
]
