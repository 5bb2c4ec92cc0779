"""``GradScaler``, with torch's API and state machine, built on the functional forms of
``functional.py``; see the package docstring (``vramkit.amp``) for what it does and where it
departs from PyTorch.

Helpers: ``arrays`` turns gradient arrays of any family into what the C kernels take,
``grads`` builds the gradient lists for the CPU kernels, ``state`` keeps the scaler's scalars,
``self_scaling`` steps the optimizers that unscale their gradients themselves.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from .. import _C
from . import arrays as _arrays
from .._core.devices import is_available
from .functional import _run_unscale, scale_, unscale_and_norm_
from .grads import _cpu_unscale, _grads_of, _sparse_grads
from .self_scaling import step_self_scaling, supports_amp_scaling
from .state import OptState, policy, scalars_for

__all__ = ["GradScaler", "OptState"]


# ---- GradScaler ----------------------------------------------------------------------------------

def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler:
    """Dynamic loss scaling, with ``torch.amp.GradScaler``'s API.

    ``device`` is where the scale lives: "cpu", "cuda" or "cuda:N"; None (the default) means
    wherever the first ``scale()`` output lives. ``min_scale``, ``max_scale`` and ``hysteresis``
    extend PyTorch's rule (None/None/1 reproduce it exactly).
    """

    def __init__(self, device: str | None = None, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 min_scale: float | None = None, max_scale: float | None = None, hysteresis: int = 1) -> None:
        if device is not None and not isinstance(device, str) and not isinstance(getattr(device, "type", None), str):
            raise TypeError(f"GradScaler: device must be None, 'cpu', 'cuda' or 'cuda:N' (a str or torch.device), got "
                            f"{type(device).__name__} {device!r}; the first argument is the device, so pass "
                            "init_scale= and the others by keyword")
        self._device = device
        self._enabled = bool(enabled)
        if self._enabled and device is not None and str(device).startswith("cuda") and not _cuda_usable():
            warnings.warn(f"vramkit.amp.GradScaler is enabled for device {device!r}, but CUDA is not available.  "
                          "Disabling.", stacklevel=2)
            self._enabled = False
        if self._enabled:
            if not growth_factor > 1.0:
                raise ValueError("The growth factor must be > 1.0.")
            if not backoff_factor < 1.0:
                raise ValueError("The backoff factor must be < 1.0.")
            policy(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = int(hysteresis)
        self._ns: Any = None
        self._scale: Any = None
        self._growth_tracker: Any = None
        self._hysteresis_tracker: Any = None
        self._per_optimizer_states: dict[Any, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        self._warned_bf16 = False

    # -- state on the device ---------------------------------------------------------------------

    def _lazy_init(self, device: str, family: str) -> None:
        self._ns = scalars_for(device, family)
        self._scale = self._ns.full(self._init_scale, "float32")
        self._growth_tracker = self._ns.full(self._init_growth_tracker, "int32")
        self._hysteresis_tracker = self._ns.full(self._init_hysteresis_tracker, "int32")

    def _check_scale_growth_tracker(self, funcname: str) -> None:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  {fix}")
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  {fix}")

    def _policy(self) -> tuple[float, float, int, int, float, float]:
        return policy(self._growth_factor, self._backoff_factor, self._growth_interval, self._hysteresis,
                      self._min_scale, self._max_scale)

    # -- the training-step API -------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply outputs (an array, or nested lists/tuples of them) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, np.floating):  # a NumPy loss such as x.mean(): scale it like a 0-d array
            outputs = np.asarray(outputs)
        if isinstance(outputs, (float, int)) and not isinstance(outputs, bool):
            if self._scale is None:
                self._lazy_init("cpu" if self._device in (None, "cpu") else self._device, "numpy")
            return outputs * self.get_scale() if not self._ns.is_cuda else outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, tuple) else scaled
        if hasattr(outputs, "__iter__") and not _arrays.is_array(outputs):
            return map(self.scale, outputs)
        if not _arrays.is_array(outputs):
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")
        device, family, dtype_name = _arrays.where(outputs)
        if self._scale is None:
            self._lazy_init(device, family)
        if dtype_name == "bfloat16":
            self._warn_bf16()
        if not self._ns.is_cuda:
            s = self.get_scale()
            if isinstance(outputs, np.ndarray):
                # An overflow to inf is the expected signal (the step will be skipped), not a warning.
                with np.errstate(over="ignore", invalid="ignore"):
                    if outputs.dtype.itemsize < 4 and outputs.dtype.name in ("float16", "bfloat16"):
                        # As torch does for half tensors: multiply in float32, round once. The scale
                        # itself may not be representable in 16 bits (2**16 is inf in float16).
                        return (outputs.astype(np.float32) * np.float32(s)).astype(outputs.dtype)
                    return outputs * outputs.dtype.type(s)
            return outputs * s
        return outputs * (self._scale if device == self._ns.device else _move(self._scale, self._ns,
                                                                             scalars_for(device, family)))

    def _warn_bf16(self) -> None:
        if not self._warned_bf16:
            self._warned_bf16 = True
            warnings.warn("GradScaler is enabled for bfloat16 values. bfloat16 has float32's exponent range, so "
                          "gradients do not underflow and need no loss scaling; GradScaler(enabled=False) avoids "
                          "the extra work (vramkit would still skip steps with inf/NaN gradients).", stacklevel=3)

    def _unscale_grads(self, grads: list[Any], inv_scale: Any, want_norm: bool,
                       checks: list[Any] | None = None) -> tuple[dict[str, Any], list[tuple[Any, Any]]]:
        """Unscale grouped by device; returns ({device: found_inf}, [(ns, sumsq) per device]).
        ``checks`` are arrays only tested for inf/NaN (coalesced copies of sparse gradients)."""
        if not checks and not self._ns.is_cuda:  # a CPU scaler: plain CPU tensors in one C call
            done = _arrays.torch_unscale_cpu(grads, float(inv_scale), want_norm)
            if done is not None:
                found_host, sumsq, dtype_bits = done
                if dtype_bits & (1 << _arrays.BFLOAT16):
                    self._warn_bf16()
                return {"cpu": self._ns.full(1.0 if found_host else 0.0, "float32")}, [(self._ns, sumsq)]
        fast = None if checks else _arrays.torch_spans(grads)
        if fast is not None:  # plain torch tensors on one device, walked in C
            spans, device, dtype_bits = fast
            if dtype_bits & (1 << _arrays.BFLOAT16):
                self._warn_bf16()
            ns = self._ns if device == self._ns.device else scalars_for(device, "torch")
            inv = inv_scale if ns is self._ns else _move(inv_scale, self._ns, ns)
            if not ns.is_cuda:
                found_host, sumsq = _C.amp_unscale_check(spans, float(inv), want_norm)
                return {device: ns.full(1.0 if found_host else 0.0, "float32")}, [(ns, sumsq)]
            found = ns.full(0.0, "float32")
            return {device: found}, [(ns, _run_unscale(spans, inv, ns, found, want_norm, None))]
        refs, keep = _arrays.describe_mixed(grads)
        by_device: dict[str, list[_arrays.Ref]] = defaultdict(list)
        for r in refs:
            by_device[r.device].append(r)
        if any(r.dtype == _arrays.BFLOAT16 for r in refs):
            self._warn_bf16()
        found_per_device: dict[str, Any] = {}
        norms: list[tuple[Any, Any]] = []
        for device, group in by_device.items():
            _arrays.check_no_overlap(group)
            ns = self._ns if device == self._ns.device else scalars_for(device, group[0].family)
            inv = inv_scale if ns is self._ns else _move(inv_scale, self._ns, ns)
            if not ns.is_cuda:
                found, sumsq = _cpu_unscale(group, float(inv), want_norm)
                found_per_device[device] = ns.full(1.0 if found else 0.0, "float32")
                norms.append((ns, sumsq))
            else:
                found = ns.full(0.0, "float32")
                sumsq = _run_unscale(group, inv, ns, found, want_norm, None)
                found_per_device[device] = found
                norms.append((ns, sumsq))
        if checks:
            self._check_only(checks, found_per_device)
        del keep
        return found_per_device, norms

    def _check_only(self, arrays: list[Any], found_per_device: dict[str, Any]) -> None:
        """Set found_inf of each array's device if it holds an inf/NaN; nothing is written."""
        refs, keep = _arrays.describe_mixed(arrays)
        for r in refs:
            ns = self._ns_of(r.device)
            if not ns.is_cuda:
                if _cpu_unscale([r], 1.0, False)[0]:
                    found_per_device[r.device] = ns.full(1.0, "float32")
                else:
                    found_per_device.setdefault(r.device, ns.full(0.0, "float32"))
            else:
                found = found_per_device.setdefault(r.device, ns.full(0.0, "float32"))
                _run_unscale([r], ns.full(1.0, "float32"), ns, found, False, None)
        del keep

    def _begin_unscale(self, optimizer: Any) -> tuple[dict[str, Any], list[Any], list[Any]]:
        self._check_scale_growth_tracker("unscale_")
        key, grads, sparse = _grads_of(optimizer)
        state = self._per_optimizer_states[key]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        checks: list[Any] = []
        if sparse:  # only now, after the checks above: torch rebinds fp16 sparse .grad during the unscale
            grads, checks = _sparse_grads(optimizer)
        return state, grads, checks

    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients of ``optimizer`` (a torch optimizer or a list of arrays) by the scale."""
        if not self._enabled:
            return
        state, grads, checks = self._begin_unscale(optimizer)
        inv = self._ns.reciprocal(self._scale)
        state["found_inf_per_device"], _ = self._unscale_grads(grads, inv, False, checks)
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: Any) -> None:
        """Look for inf/NaN in the gradients without unscaling them (torch's method of the same
        name), for optimizers that unscale themselves; the stage stays READY."""
        state, grads, checks = self._begin_unscale(optimizer)
        state["found_inf_per_device"], _ = self._unscale_grads(grads, self._ns.full(1.0, "float32"), False, checks)

    def unscale_and_clip_(self, optimizer: Any, max_norm: float) -> Any:
        """``unscale_`` plus ``clip_grad_norm_(max_norm)`` in one pass over the gradients.

        Returns the total L2 norm of the unscaled gradients: a float on the CPU, a 0-d device
        scalar on CUDA (no host synchronisation). Nothing is clipped when an inf/NaN was found
        (the step will be skipped anyway); the returned norm is then inf or nan.
        """
        max_norm = float(max_norm)
        if not max_norm > 0 or math.isinf(max_norm):
            raise ValueError(f"max_norm must be a positive finite number, got {max_norm}")
        if not self._enabled:
            key, grads, _ = _grads_of(optimizer)
            found, norm = unscale_and_norm_(grads, 1.0)
            if not found:
                _clip_host(grads, norm, max_norm)
            return norm
        state, grads, checks = self._begin_unscale(optimizer)
        inv = self._ns.reciprocal(self._scale)
        found_per_device, norms = self._unscale_grads(grads, inv, True, checks)
        state["found_inf_per_device"] = found_per_device
        state["stage"] = OptState.UNSCALED
        if not norms:
            return 0.0 if not self._ns.is_cuda else self._ns.full(0.0, "float32")
        if all(not ns.is_cuda for ns, _ in norms):
            norm = math.sqrt(sum(s for _, s in norms))
            if not any(self._ns_of(d).item(f) != 0.0 for d, f in found_per_device.items()):
                _clip_host(grads, norm, max_norm)
            return norm
        if len(norms) != 1:
            raise ValueError("unscale_and_clip_ takes gradients on one CUDA device")
        ns, sumsq = norms[0]
        coef, norm = ns.full(1.0, "float32"), ns.full(0.0, "float32")
        _C.amp_clip_coef_cuda(ns.ptr(sumsq), max_norm, ns.ptr(coef), ns.ptr(norm), ns.stream(), ns.index)
        refs, keep = _arrays.describe_all(grads)
        _C.amp_scale_inplace_cuda(_arrays.triples(refs), ns.ptr(coef), ns.stream(), ns.index)
        del keep
        return norm

    def step(self, optimizer: Any, *args: Any, step_fn: Callable[..., Any] | None = None,
             return_found_inf: bool = False, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and run the step unless an inf/NaN was found.

        ``optimizer`` is a torch optimizer (its ``step(*args, **kwargs)`` runs) or a list of
        gradient arrays together with ``step_fn`` (``step_fn(*args, **kwargs)`` runs). Returns
        the step's return value (None when skipped), or ``(value, found_inf)`` with
        ``return_found_inf=True``. An optimizer that sets ``_step_supports_amp_scaling`` (torch's
        fused ones) is stepped as torch steps it, unscaling in its own kernel: see
        ``vramkit.amp.self_scaling``.
        """
        is_optimizer = hasattr(optimizer, "param_groups")
        if not is_optimizer and step_fn is None:
            raise TypeError("step() with a list of gradients needs step_fn=, the callable that performs the step")
        run = step_fn if step_fn is not None else optimizer.step  # (no step_fn: an optimizer, checked above)
        if not self._enabled:
            retval = run(*args, **kwargs)
            return (retval, False) if return_found_inf else retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        key, _, _ = _grads_of(optimizer)
        state = self._per_optimizer_states[key]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if is_optimizer and step_fn is None and supports_amp_scaling(optimizer):
            # torch's fused optimizers unscale inside their kernel (amp/self_scaling.py)
            retval, found = step_self_scaling(self, optimizer, state, self._check_inf_per_device, args, kwargs)
            if not return_found_inf:
                return retval
            return retval, (bool(found.item() != 0) if found is not None else None)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        found_inf = any(self._ns_of(d).item(v) != 0.0 for d, v in state["found_inf_per_device"].items())
        retval = None if found_inf else run(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return (retval, found_inf) if return_found_inf else retval

    def _ns_of(self, device: str) -> Any:
        return self._ns if device == self._ns.device else scalars_for(device, "torch")

    def update(self, new_scale: Any = None) -> None:
        """Update the scale: back off if any step this iteration found inf/NaN, grow after
        ``growth_interval`` clean updates; or set it to ``new_scale``."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                self._ns.set(self._scale, float(new_scale))
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
                          "with requires_grad=False.")
                if getattr(new_scale, "requires_grad", False) or int(np.prod(getattr(new_scale, "shape", ()))) != 1:
                    raise ValueError(reason)
                self._ns.set(self._scale, self._ns.from_value(new_scale, "float32"))
        else:
            found_infs = [(d, f) for state in self._per_optimizer_states.values()
                          for d, f in state["found_inf_per_device"].items()]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            if not self._ns.is_cuda:
                combined = self._ns.full(sum(self._ns_of(d).item(f) for d, f in found_infs), "float32")
                _C.amp_update_scale(self._ns.ptr(self._scale), self._ns.ptr(self._growth_tracker),
                                    self._ns.ptr(self._hysteresis_tracker), self._ns.ptr(combined), self._policy())
            else:
                combined = self._ns.full(0.0, "float32")
                for d, f in found_infs:
                    combined += f if d == self._ns.device else _move(f, self._ns_of(d), self._ns)
                _C.amp_update_scale_cuda(self._ns.ptr(self._scale), self._ns.ptr(self._growth_tracker),
                                         self._ns.ptr(self._hysteresis_tracker), self._ns.ptr(combined),
                                         self._policy(), self._ns.stream(), self._ns.index)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- getters, setters, checkpoints -----------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host synchronisation on CUDA)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._ns.item(self._scale)

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        policy(new_factor, self._backoff_factor, self._growth_interval, self._hysteresis, self._min_scale,
               self._max_scale)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        policy(self._growth_factor, new_factor, self._growth_interval, self._hysteresis, self._min_scale,
               self._max_scale)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        policy(self._growth_factor, self._backoff_factor, new_interval, self._hysteresis, self._min_scale,
               self._max_scale)
        self._growth_interval = int(new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._ns.item(self._growth_tracker))

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's keys (so ``torch.amp.GradScaler.load_state_dict`` accepts it) plus vramkit's
        extensions; {} when disabled. A host synchronisation on CUDA."""
        if not self._enabled:
            return {}
        hyst = self._init_hysteresis_tracker if self._hysteresis_tracker is None else \
            int(self._ns.item(self._hysteresis_tracker))
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker(), "min_scale": self._min_scale,
                "max_scale": self._max_scale, "hysteresis": self._hysteresis, "_hysteresis_tracker": hyst}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.amp.GradScaler.state_dict()``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._scale is not None:
            self._ns.set(self._scale, self._init_scale)
            self._ns.set(self._growth_tracker, self._init_growth_tracker)
            self._ns.set(self._hysteresis_tracker, self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if any(s["stage"] is not OptState.READY for s in self._per_optimizer_states.values()):
                raise AssertionError("A GradScaler instance may only be pickled at the beginning of an iteration, "
                                     "or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self.state_dict()["_hysteresis_tracker"]
            for name in ("_ns", "_scale", "_growth_tracker", "_hysteresis_tracker"):
                state[name] = None
        state["_per_optimizer_states"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# ---- helpers -------------------------------------------------------------------------------------

def _cuda_usable() -> bool:
    if is_available("cuda"):
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _move(value: Any, src: Any, dst: Any) -> Any:
    """A scalar of namespace ``src`` as a scalar of namespace ``dst`` (a sync only when leaving a GPU)."""
    if not dst.is_cuda:
        return np.float32(src.item(value))
    return dst.from_value(value if not src.is_cuda or type(src) is type(dst) else src.item(value), "float32")


def _clip_host(grads: list[Any], norm: float, max_norm: float) -> None:
    # torch.nn.utils.clip_grad_norm_ in float32: coef = max_norm / (norm + 1e-6), clamped to 1.
    coef = np.float32(max_norm) / (np.float32(norm) + np.float32(1e-6))
    if coef < 1.0:
        scale_(grads, float(coef))
