"""Devices: the default device, availability and counts."""

from __future__ import annotations

from typing import Any

from .. import _C

DeviceLike = Any  # str ('cpu', 'cuda', 'cuda:N', 'sim:N'), int CUDA index, torch.device or None


def set_device(device: DeviceLike) -> None:
    """Make `device` the default for every function whose `device` argument is None.

    The default starts as 'cuda:0' where CUDA is usable and 'cpu' elsewhere.
    """
    _C.set_default_device(device)


def current_device() -> str:
    """The default device's name, e.g. 'cpu' or 'cuda:0'."""
    return _C.default_device()


def device_count(kind: str = "cuda") -> int:
    """Number of devices of a kind: usable CUDA GPUs, simulated devices made so far, or 1 for cpu."""
    if kind == "cuda":
        return _C.cuda_device_count()
    if kind == "sim":
        return _C.sim_count()
    if kind == "cpu":
        return 1
    raise ValueError(f"unknown device kind {kind!r}: use 'cuda', 'sim' or 'cpu'")


def is_available(device: str = "cuda") -> bool:
    """Whether a device kind ('cuda', 'cpu', 'sim') or a specific device ('cuda:1', 'sim:0') can be used.

    Never raises for a missing driver: without one, is_available('cuda') is simply False.
    """
    if device in ("cuda", "cpu", "sim"):
        return device == "cpu" or device == "sim" or _C.cuda_device_count() > 0
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cuda' or 'cuda:1', got {type(device).__name__}")
    try:
        _C.canonical_device(device)
    except ValueError:
        if device.startswith("sim:"):
            return False
        raise
    except RuntimeError:
        return False
    return True
