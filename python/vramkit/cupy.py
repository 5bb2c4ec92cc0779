"""vramkit as CuPy's device memory allocator: ``vramkit.cupy.install()`` / ``uninstall()``.

``install()`` hands ``cupy.cuda.set_allocator`` a function that CuPy calls for every device
allocation: it takes a block from vramkit's pool for CuPy's current device (``cuda:N``) on
CuPy's current stream, and returns a ``cupy.cuda.MemoryPointer`` over a
``cupy.cuda.UnownedMemory`` whose owner frees the block when CuPy drops its last reference to
the memory. vramkit's counters, summaries, snapshots and ``empty_cache`` then describe CuPy's
arrays. An allocation vramkit cannot serve raises ``vramkit.OutOfMemoryError``, a
``MemoryError`` as CuPy's own ``OutOfMemoryError`` is. ``uninstall()`` restores the allocator
CuPy had before (arrays allocated meanwhile stay valid and free their blocks when they die).

``install(device="sim:N")`` sends the requests to a simulated device instead, for tests and
dry runs without a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _C

__all__ = ["install", "uninstall", "is_installed"]

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "previous": None, "device": None}


class _Block:
    """The owner CuPy keeps alive with the memory: frees vramkit's block when CuPy lets go."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                _C.raw_free(ptr)
            except Exception:  # interpreter teardown: the pool outlives the module, nothing to do
                pass


def _malloc(nbytes: int) -> Any:
    import cupy

    device_id = cupy.cuda.Device().id
    device = _state["device"] or f"cuda:{device_id}"
    ptr = _C.raw_alloc(nbytes, device, cupy.cuda.get_current_stream().ptr)
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, _Block(ptr), device_id)
    return cupy.cuda.MemoryPointer(memory, 0)


def install(device: str | None = None) -> None:
    """Make vramkit CuPy's device allocator. A second call is a no-op; ``device`` routes the
    requests to another vramkit device (a ``sim:N`` for tests), and must match a first call's."""
    import cupy

    with _lock:
        if _state["installed"]:
            if device != _state["device"]:
                raise ValueError(f"vramkit.cupy is already installed for {_state['device'] or 'cuda:N'}; "
                                 "call uninstall() before installing it for another device")
            return
        if device is not None and not device.startswith("sim:"):
            raise ValueError(f"device routes CuPy's requests to a simulated device 'sim:N' (tests and dry runs); "
                             f"got {device!r}. Without it each request goes to CuPy's current CUDA device")
        _state.update(previous=cupy.cuda.get_allocator(), device=device, installed=True)
        cupy.cuda.set_allocator(_malloc)


def uninstall() -> None:
    """Give CuPy back the allocator it had before install(); a no-op when not installed."""
    import cupy

    with _lock:
        if not _state["installed"]:
            return
        cupy.cuda.set_allocator(_state["previous"])
        _state.update(previous=None, device=None, installed=False)


def is_installed() -> bool:
    return bool(_state["installed"])
