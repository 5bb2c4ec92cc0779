"""``GradScaler.step`` for optimizers that unscale their gradients themselves.

torch's protocol, as ``torch.amp.GradScaler.step`` implements it: an optimizer that sets
``_step_supports_amp_scaling = True`` (torch's fused Adam, AdamW, SGD and Adagrad, and custom
ones) is stepped directly, with the scaler's state handed over instead of unscaled gradients.

- If its ``step`` takes a ``grad_scaler`` keyword (the older form of the protocol), the scaler
  passes itself there, with torch's ``FutureWarning``.
- Otherwise the scaler checks the gradients for inf/NaN without unscaling them (unless
  ``unscale_`` already ran this iteration), then sets two tensors on the optimizer for the
  duration of the step: ``grad_scale`` (the scale, times any ``grad_scale`` the user set;
  ``None``, or the user's, when the gradients are already unscaled) and ``found_inf`` (the sum
  of the per-device flags). The fused kernel divides by the scale and skips the update when
  ``found_inf`` is nonzero. Both attributes are deleted after the step.

The optimizer reads these as torch tensors, so the host scalars of a CPU scaler (NumPy 0-d
arrays) are handed over as 0-d torch tensors; ``update()`` then reads the flags from the
scaler's own per-optimizer state, as after any other step.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import numpy as np

from .state import OptState

LEGACY_WARNING = ("GradScaler is going to stop passing itself as a keyword argument to the passed "
                  "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                  "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.")


def supports_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales its own gradients (torch's ``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _as_torch(value: Any) -> Any:
    """A scaler scalar (NumPy 0-d array, torch tensor or CuPy array) as a torch tensor."""
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.tensor(float(value), dtype=torch.float32)
    return torch.from_dlpack(value)


def step_self_scaling(scaler: Any, optimizer: Any, state: dict[str, Any], check_inf: Any,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Step ``optimizer`` by the protocol above; returns (its return value, the found_inf tensor,
    or None when the optimizer was handed the scaler itself). ``check_inf(optimizer)`` fills
    ``state["found_inf_per_device"]`` without unscaling."""
    legacy = "grad_scaler" in inspect.signature(optimizer.step).parameters
    found_inf = None
    if legacy:
        warnings.warn(LEGACY_WARNING, FutureWarning, stacklevel=3)
        kwargs = {**kwargs, "grad_scaler": scaler}
    else:
        if state["stage"] is OptState.READY:
            check_inf(optimizer)
        scale = _as_torch(scaler._scale)
        found_inf = sum(_as_torch(f).to(scale.device, non_blocking=True)
                        for f in state["found_inf_per_device"].values())
        # The product of the scales, if the user has already set optimizer.grad_scale (as torch).
        optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is OptState.UNSCALED
                                else scale * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = found_inf
    try:
        retval = optimizer.step(*args, **kwargs)
    finally:
        if not legacy:
            del optimizer.grad_scale
            del optimizer.found_inf
    state["stage"] = OptState.STEPPED
    return retval, found_inf
