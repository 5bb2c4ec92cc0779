"""The functional loss-scaling forms: ``unscale_``, ``unscale_and_norm_``, ``scale_``, and
torch's ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_`` as
``non_finite_check_and_unscale_`` and ``update_scale_``, plus the CPU kernels' thread count and
SIMD path. ``GradScaler`` (``loss_scaling.py``) is built on them; see the package docstring
(``vramkit.amp``) for what they do and where they depart from PyTorch."""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

import numpy as np

from .. import _C
from . import arrays as _arrays
from .grads import _cpu_scale, _cpu_unscale
from .state import HostScalars, host_float, policy, scalars_for, set_host_float

__all__ = ["get_num_threads", "non_finite_check_and_unscale_", "scale_", "set_num_threads", "simd_path", "unscale_",
           "unscale_and_norm_", "update_scale_"]


def _run_unscale(refs: Any, inv: Any, ns: Any, found: Any, want_norm: bool, stream: int | None) -> Any:
    """Unscale one device's refs (a list of ``Ref``, or CUDA spans from ``arrays.torch_spans``).
    CPU: inv is a number, returns (found, sumsq). CUDA: inv, found are device scalars of ``ns``;
    returns a device float64 sumsq scalar (or None)."""
    if not ns.is_cuda:
        return _cpu_unscale(refs, float(inv), want_norm)
    sumsq = ns.full(0.0, "float64") if want_norm else None
    tensors = _arrays.triples(refs) if isinstance(refs, list) else refs
    _C.amp_unscale_check_cuda(tensors, ns.ptr(inv), ns.ptr(found), ns.ptr(sumsq) if want_norm else 0,
                              stream if stream is not None else ns.stream(), ns.index)
    return sumsq


def _ns_for(refs: list[_arrays.Ref]) -> Any:
    return scalars_for(refs[0].device, refs[0].family) if refs else HostScalars()


def unscale_(grads: Iterable[Any], inv_scale: float, *, stream: int | None = None) -> bool:
    """Multiply every gradient by ``inv_scale`` in place; True if any was inf/NaN.

    One fused pass per call. On CUDA this waits for the result (it returns a bool); use
    ``non_finite_check_and_unscale_`` to stay asynchronous.
    """
    fast = _arrays.cpu_unscale_fast(grads, float(inv_scale), False)  # NumPy or CPU torch: one C call
    if fast is not None:
        return fast[0]
    refs, keep = _arrays.describe_all(grads)
    if not refs:
        return False
    ns = _ns_for(refs)
    if not ns.is_cuda:
        return _cpu_unscale(refs, float(inv_scale), False)[0]
    found = ns.full(0.0, "float32")
    _run_unscale(refs, ns.full(float(inv_scale), "float32"), ns, found, False, stream)
    del keep
    found_inf: bool = ns.item(found) != 0.0
    return found_inf


def unscale_and_norm_(grads: Iterable[Any], inv_scale: float) -> tuple[bool, float]:
    """Unscale in place and return (found_inf, L2 norm of the unscaled gradients), one pass."""
    fast = _arrays.cpu_unscale_fast(grads, float(inv_scale), True)  # NumPy or CPU torch: one C call
    if fast is not None:
        return fast[0], math.sqrt(fast[1] or 0.0)
    refs, keep = _arrays.describe_all(grads)
    if not refs:
        return False, 0.0
    ns = _ns_for(refs)
    if not ns.is_cuda:
        found, sumsq = _cpu_unscale(refs, float(inv_scale), True)
        return found, math.sqrt(sumsq)
    found = ns.full(0.0, "float32")
    sumsq = _run_unscale(refs, ns.full(float(inv_scale), "float32"), ns, found, True, None)
    del keep
    return ns.item(found) != 0.0, math.sqrt(ns.item(sumsq))


def scale_(grads: Iterable[Any], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (the clip multiply); float32 math."""
    spans = _arrays.cpu_spans(grads)  # NumPy or CPU torch, walked in C
    if spans is not None:
        _C.amp_scale_inplace(spans, float(factor))
        return
    refs, keep = _arrays.describe_all(grads)
    if not refs:
        return
    ns = _ns_for(refs)
    if not ns.is_cuda:
        _cpu_scale(refs, float(factor))
    else:
        f = ns.full(float(factor), "float32")
        _C.amp_scale_inplace_cuda(_arrays.triples(refs), ns.ptr(f), ns.stream(), ns.index)
    del keep


def _scalar_ref(obj: Any, name: str, dtype: str, device: str | None) -> int:
    """Address of a one-element ``dtype`` array (NumPy, torch, CuPy, Buffer) on ``device``."""
    if type(obj).__module__.startswith("torch"):  # (checked first and cheaply: once per unscale)
        if obj.dtype is not getattr(sys.modules["torch"], dtype) or obj.numel() != 1:
            raise TypeError(f"{name} must be a 1-element {dtype} tensor, got {obj.dtype} with {obj.numel()} elements")
        index = obj.get_device()
        dev = "cpu" if index < 0 else f"cuda:{index}"
        ptr: int = obj.data_ptr()
    elif isinstance(obj, np.ndarray):
        if obj.dtype != np.dtype(dtype) or obj.size != 1:
            raise TypeError(f"{name} must be a 1-element {dtype} array, got {obj.dtype} with {obj.size} elements")
        if not obj.flags.writeable:
            raise ValueError(f"{name} is read-only")
        dev, ptr = "cpu", obj.__array_interface__["data"][0]
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        if np.dtype(cai["typestr"]) != np.dtype(dtype) or int(np.prod(cai["shape"])) != 1:
            raise TypeError(f"{name} must be a 1-element {dtype} array")
        index = getattr(getattr(obj, "device", None), "id", 0)
        dev, ptr = f"cuda:{index if isinstance(index, int) else 0}", cai["data"][0]
    elif isinstance(obj, _C.Buffer):
        if np.dtype(obj.typestr) != np.dtype(dtype) or int(np.prod(obj.shape)) != 1:
            raise TypeError(f"{name} must be a 1-element {dtype} Buffer")
        dev, ptr = obj.device, obj.ptr
    else:
        raise TypeError(f"{name} must be a 1-element {dtype} array or tensor, got {type(obj).__name__}")
    if device is not None and dev != device:
        raise ValueError(f"{name} is on {dev} but the gradients are on {device}")
    return ptr


def non_finite_check_and_unscale_(grads: Iterable[Any], found_inf: Any, inv_scale: Any) -> None:
    """Same contract as ``torch._amp_foreach_non_finite_check_and_unscale_``: multiply every
    gradient by ``inv_scale`` (a 1-element float32 array on the gradients' device) and set
    ``found_inf`` (same) to 1.0 if any gradient is inf/NaN; it is never reset to 0.
    Asynchronous on CUDA (runs on the current torch/CuPy stream)."""
    if _arrays.torch_unscale_found(grads, found_inf, inv_scale):  # plain CPU torch tensors: one C call
        return
    fast = _arrays.torch_spans(grads)
    if fast is not None:  # plain torch tensors on one device, walked in C
        spans, on, _ = fast
        found_ptr = _scalar_ref(found_inf, "found_inf", "float32", on)
        inv_ptr = _scalar_ref(inv_scale, "inv_scale", "float32", on)
        if on == "cpu":
            if _C.amp_unscale_check(spans, host_float(inv_ptr), False)[0]:
                set_host_float(found_ptr, 1.0)
        else:
            ns = scalars_for(on, "torch")
            _C.amp_unscale_check_cuda(spans, inv_ptr, found_ptr, 0, ns.stream(), ns.index)
        return
    refs, keep = _arrays.describe_all(grads)
    device = refs[0].device if refs else None
    found_ptr = _scalar_ref(found_inf, "found_inf", "float32", device)
    inv_ptr = _scalar_ref(inv_scale, "inv_scale", "float32", device)
    if not refs:
        return
    if device == "cpu":
        found, _ = _cpu_unscale(refs, host_float(inv_ptr), False)
        if found:
            set_host_float(found_ptr, 1.0)
    else:
        ns = _ns_for(refs)
        _C.amp_unscale_check_cuda(_arrays.triples(refs), inv_ptr, found_ptr, 0, ns.stream(), ns.index)
    del keep


def update_scale_(scale: Any, growth_tracker: Any, found_inf: Any, growth_factor: float, backoff_factor: float,
                  growth_interval: int, *, hysteresis_tracker: Any = None, hysteresis: int = 1,
                  min_scale: float | None = None, max_scale: float | None = None) -> Any:
    """Same contract as ``torch._amp_update_scale_`` (in place, returns ``scale``), plus the
    optional floor, ceiling and hysteresis of ``vram_scale_policy_t``."""
    p = policy(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
    s_ptr = _scalar_ref(scale, "scale", "float32", None)
    device = "cpu" if isinstance(scale, np.ndarray) or getattr(getattr(scale, "device", None), "type", "cpu") == "cpu" \
        else f"cuda:{getattr(scale.device, 'index', None) or getattr(scale.device, 'id', 0) or 0}"
    g_ptr = _scalar_ref(growth_tracker, "growth_tracker", "int32", device)
    f_ptr = _scalar_ref(found_inf, "found_inf", "float32", device)
    h_ptr = 0 if hysteresis_tracker is None else _scalar_ref(hysteresis_tracker, "hysteresis_tracker", "int32", device)
    if hysteresis > 1 and not h_ptr:
        raise ValueError(f"hysteresis={hysteresis} needs a hysteresis_tracker (a 1-element int32 array)")
    if device == "cpu":
        _C.amp_update_scale(s_ptr, g_ptr, h_ptr, f_ptr, p)
    else:
        ns = scalars_for(device, type(scale).__module__.split(".")[0])
        _C.amp_update_scale_cuda(s_ptr, g_ptr, h_ptr, f_ptr, p, ns.stream(), ns.index)
    return scale


def get_num_threads() -> int:
    """Threads the CPU kernels use (VRAMKIT_NUM_THREADS, else the CPUs this process may use)."""
    return _C.get_num_threads()


def set_num_threads(n: int) -> None:
    _C.set_num_threads(n)


def simd_path() -> str:
    """The CPU instruction-set path in use: 'avx512', 'avx2' or 'portable' (VRAMKIT_SIMD overrides)."""
    return _C.simd_path()
