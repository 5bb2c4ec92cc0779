"""The gradient lists GradScaler and the functional forms hand to the CPU kernels: dense tensors
in one fused call, strided (non-dense) ones through the strided kernel, and sparse COO gradients
through their values, with torch.amp.GradScaler's rule for fp16 ones (see _sparse_grads)."""

from __future__ import annotations

from typing import Any

from .. import _C
from . import arrays as _arrays


def _cpu_unscale(refs: list[_arrays.Ref], inv: float, want_norm: bool) -> tuple[bool, Any]:
    """One CPU pass over dense and strided refs: (found_inf, sumsq or None)."""
    dense, strided = _arrays.split(refs)
    if not strided:  # the common case: one fused call, exactly as before strided support
        return _C.amp_unscale_check(dense, inv, want_norm)
    # A strided tensor's layout is checked in C; check them all (factor 1 writes nothing) before
    # the dense call writes, so a bad list still changes nothing.
    _check_strided(refs, strided)
    found, sumsq = _C.amp_unscale_check(dense, inv, want_norm)
    found_s, sumsq_s = _C.amp_unscale_check_strided(strided, inv, want_norm)
    # (the sums are None exactly when want_norm is false)
    return found or found_s, (sumsq + sumsq_s) if sumsq is not None and sumsq_s is not None else None


def _check_strided(refs: list[_arrays.Ref], strided: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]) -> None:
    """Validate strided layouts in C (factor 1 writes nothing); errors name the index in ``refs``."""
    try:
        _C.amp_scale_inplace_strided(strided, 1.0)
    except ValueError as e:
        head, _, rest = str(e).partition(": ")
        if head.startswith("tensor ") and head[7:].isdigit():
            positions = [i for i, r in enumerate(refs) if r.strides is not None]
            raise ValueError(f"tensor {positions[int(head[7:])]}: {rest}") from None
        raise


def _cpu_scale(refs: list[_arrays.Ref], factor: float) -> None:
    dense, strided = _arrays.split(refs)
    if strided:
        _check_strided(refs, strided)  # validate before anything is written
    _C.amp_scale_inplace(dense, factor)
    if strided:
        _C.amp_scale_inplace_strided(strided, factor)


def _is_sparse_coo(g: Any) -> bool:
    return getattr(g, "is_sparse", False) is True  # torch's sparse COO; other families lack the attribute


def _grads_of(optimizer_or_grads: Any) -> tuple[Any, list[Any], bool]:
    """(state key, gradient list, whether any is sparse) for a torch optimizer or a list of
    gradient arrays. A sparse COO gradient is listed as its values (see _sparse_grads)."""
    if hasattr(optimizer_or_grads, "param_groups"):
        grads = [p.grad for group in optimizer_or_grads.param_groups for p in group["params"] if p.grad is not None]
        if not any(g.is_sparse for g in grads):
            return id(optimizer_or_grads), grads, False
        return id(optimizer_or_grads), [g._values() if g.is_sparse else g for g in grads], True
    if isinstance(optimizer_or_grads, (str, bytes)) or not hasattr(optimizer_or_grads, "__iter__"):
        raise TypeError("expected a torch optimizer or a list of gradient arrays, got "
                        f"{type(optimizer_or_grads).__name__}")
    grads = list(optimizer_or_grads)
    sparse = any(_is_sparse_coo(g) for g in grads)
    if sparse:
        grads = [g._values() if _is_sparse_coo(g) else g for g in grads]
    # A list is keyed by the memory it covers, so a rebuilt list of the same arrays is "the same optimizer".
    refs, _ = _arrays.describe_mixed(grads)
    return ("grads",) + tuple((r.device, r.ptr, r.numel) for r in refs), grads, sparse


def _sparse_grads(optimizer_or_grads: Any) -> tuple[list[Any], list[Any]]:
    """torch.amp.GradScaler's rule for sparse COO gradients: (arrays to unscale, arrays to check only).

    A sparse gradient is unscaled through its values, in place. An fp16 one is first coalesced,
    because adding the values of duplicate indices can overflow fp16: torch replaces
    ``param.grad`` by ``param.grad.coalesce()``, and so does this for optimizers. A list of
    gradients has no parameter to rebind, so an uncoalesced fp16 tensor there is unscaled
    through its own values and its coalesced values are checked for inf/NaN (same found_inf).
    """
    checks: list[Any] = []
    if hasattr(optimizer_or_grads, "param_groups"):
        import torch

        grads = []
        for group in optimizer_or_grads.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    if g.dtype is torch.float16:
                        p.grad = g = g.coalesce()
                    g = g._values()
                grads.append(g)
        return grads, checks
    grads = []
    for g in optimizer_or_grads:
        if _is_sparse_coo(g):
            if str(g.dtype) == "torch.float16" and not g.is_coalesced():
                checks.append(g.coalesce()._values())
            g = g._values()
        grads.append(g)
    return grads, checks
