"""Where a GradScaler keeps its scalars: on the host (NumPy 0-d arrays) for CPU work, and as
torch tensors or CuPy arrays on a CUDA device, so a training step never waits for the GPU
except where the caller asks for a Python number. Each namespace knows how to make a scalar,
read it, and hand its address and stream to the kernels."""

from __future__ import annotations

import ctypes
import sys
from enum import Enum
from typing import Any

import numpy as np

from .. import _C


class OptState(Enum):
    """Where an optimizer is in a GradScaler iteration (torch.amp.grad_scaler.OptState)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class HostScalars:
    """Scalars in host memory; used for every CPU array family (NumPy, torch CPU, Buffers)."""

    device = "cpu"
    is_cuda = False

    def full(self, value: float, dtype: str) -> np.ndarray:
        return np.full((), value, dtype=dtype)

    def ptr(self, a: np.ndarray) -> int:
        address: int = a.__array_interface__["data"][0]
        return address

    def item(self, a: Any) -> float:
        return float(a)

    def set(self, a: np.ndarray, value: float) -> None:
        a[()] = value

    def reciprocal(self, scale: np.ndarray) -> np.float32:
        # In float64, then rounded to float32, as PyTorch's scale.double().reciprocal().float(); a
        # subnormal scale gives inf there too, without a warning.
        with np.errstate(over="ignore", divide="ignore"):
            inv: np.float32 = np.float32(1.0 / np.float64(scale))
            return inv

    def from_value(self, value: Any, dtype: str) -> np.ndarray:
        return np.full((), float(value), dtype=dtype)

    def stream(self) -> int:
        return 0


class TorchCudaScalars:
    def __init__(self, device: str):
        self.torch = sys.modules["torch"]
        self.device = device
        self.index = int(device.split(":")[1])
        self.is_cuda = True

    def full(self, value: float, dtype: str) -> Any:
        return self.torch.full((), value, dtype=getattr(self.torch, dtype), device=self.device)

    def ptr(self, a: Any) -> int:
        address: int = a.data_ptr()
        return address

    def item(self, a: Any) -> float:
        return float(a.item())

    def set(self, a: Any, value: Any) -> None:
        if isinstance(value, (int, float)):
            a.fill_(value)
        else:
            a.copy_(value)

    def reciprocal(self, scale: Any) -> Any:
        return scale.double().reciprocal().float()

    def from_value(self, value: Any, dtype: str) -> Any:
        if isinstance(value, (int, float, np.generic)):
            return self.full(float(value), dtype)
        t = value if isinstance(value, self.torch.Tensor) else self.torch.as_tensor(value)
        return t.to(device=self.device, dtype=getattr(self.torch, dtype), non_blocking=True).reshape(())

    def stream(self) -> int:
        handle: int = self.torch.cuda.current_stream(self.index).cuda_stream
        return handle


class CupyCudaScalars:
    def __init__(self, device: str):
        self.cupy = sys.modules["cupy"]
        self.device = device
        self.index = int(device.split(":")[1])
        self.is_cuda = True

    def full(self, value: float, dtype: str) -> Any:
        with self.cupy.cuda.Device(self.index):
            return self.cupy.full((), value, dtype=dtype)

    def ptr(self, a: Any) -> int:
        address: int = a.data.ptr
        return address

    def item(self, a: Any) -> float:
        return float(a.item())

    def set(self, a: Any, value: Any) -> None:
        with self.cupy.cuda.Device(self.index):
            a[()] = value

    def reciprocal(self, scale: Any) -> Any:
        with self.cupy.cuda.Device(self.index):
            return (1.0 / scale.astype("float64")).astype("float32")

    def from_value(self, value: Any, dtype: str) -> Any:
        with self.cupy.cuda.Device(self.index):
            return self.cupy.asarray(value, dtype=dtype).reshape(())

    def stream(self) -> int:
        handle: int = self.cupy.cuda.get_current_stream().ptr
        return handle


def scalars_for(device: str, family: str) -> Any:
    """The scalar namespace for a device, preferring the array family the gradients come from."""
    if device == "cpu":
        return HostScalars()
    torch = sys.modules.get("torch")
    if family == "cupy" and "cupy" in sys.modules:
        return CupyCudaScalars(device)
    if torch is not None and torch.cuda.is_available():
        return TorchCudaScalars(device)
    if "cupy" in sys.modules:
        return CupyCudaScalars(device)
    for name in ("torch", "cupy"):
        if name in sys.modules:  # already considered above (a CPU-only torch cannot help)
            continue
        try:
            __import__(name)
        except ImportError:
            continue
        return scalars_for(device, name)
    raise RuntimeError(f"keeping loss-scale state on {device} needs torch or CuPy; without them use "
                       "vramkit.amp.non_finite_check_and_unscale_ with found_inf and inv_scale arrays you allocate")


def host_float(ptr: int) -> float:
    return ctypes.c_float.from_address(ptr).value


def set_host_float(ptr: int, value: float) -> None:
    ctypes.c_float.from_address(ptr).value = value


def policy(growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int,
           min_scale: float | None, max_scale: float | None) -> tuple[float, float, int, int, float, float]:
    p = (float(growth_factor), float(backoff_factor), int(growth_interval), int(hysteresis),
         0.0 if min_scale is None else float(min_scale), float("inf") if max_scale is None else float(max_scale))
    _C.amp_check_policy(p)
    return p
