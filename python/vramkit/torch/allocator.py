"""vramkit as PyTorch's CUDA allocator: ``vramkit.torch.use_as_cuda_allocator()``.

torch loads two C functions of vramkit's extension module with
``torch.cuda.memory.CUDAPluggableAllocator(path, "vramkit_torch_malloc", "vramkit_torch_free")``
and ``change_current_allocator``; from then on every CUDA storage of the process comes from
vramkit's ``cuda:N`` pool on the caller's stream. vramkit's ``memory_allocated``,
``memory_summary``, snapshots, history, ``clear_cache()`` and OOM figures then describe the
script's own tensors.

torch's Python API hands the pluggable allocator only those two hooks. Two more things a user
expects are wired here in Python:

* ``torch.cuda.empty_cache()`` reaches a pluggable allocator's ``emptyCache``, which does
  nothing without a reset hook; it is wrapped to also call ``vramkit.empty_cache`` for every
  CUDA device.
* ``Tensor.record_stream(s)`` reaches the pluggable allocator's ``recordStream``, likewise a
  no-op without a hook; vramkit's pool reuses a freed block on its own stream only after the
  recorded streams finish, so it is wrapped to also call ``vramkit.record_stream`` on the
  storage's block.

What torch shows when vramkit has no memory: ``vramkit_torch_malloc`` throws a C++
``std::runtime_error`` with vramkit's out-of-memory message, and torch raises it as a Python
``RuntimeError`` (not ``torch.OutOfMemoryError``, which only torch's own C++ can raise):
``RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of
...``. ``vramkit.torch.is_vramkit_out_of_memory(exc)`` tells such errors apart.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from .. import _C

ALLOC_FN = "vramkit_torch_malloc"
FREE_FN = "vramkit_torch_free"

_lock = threading.Lock()
_state: dict[str, Any] = {"allocator": None, "empty_cache": None, "record_stream": None}


def library_path() -> str:
    """The shared object torch loads the hooks from (vramkit's extension module)."""
    return _C.__file__


def hooks() -> ctypes.CDLL:
    """The C hooks (vramkit_torch.h) through ctypes, as torch loads them; the extension module
    is already loaded, so this is the same library, not a second copy."""
    lib = ctypes.CDLL(library_path())
    lib.vram_torch_malloc.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.vram_torch_malloc.restype = ctypes.c_int
    lib.vramkit_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vramkit_torch_malloc.restype = ctypes.c_void_p
    lib.vramkit_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vramkit_torch_free.restype = None
    lib.vramkit_torch_empty_cache.argtypes = []
    lib.vramkit_torch_empty_cache.restype = None
    lib.vramkit_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.vramkit_torch_record_stream.restype = None
    lib.vramkit_torch_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    lib.vramkit_torch_set_memory_fraction.restype = None
    lib.vramkit_torch_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.vramkit_torch_base_alloc.restype = ctypes.c_void_p
    lib.vram_torch_stray_frees.argtypes = []
    lib.vram_torch_stray_frees.restype = ctypes.c_uint64
    lib.vram_torch_route.argtypes = [ctypes.c_char_p]
    lib.vram_torch_route.restype = ctypes.c_int
    lib.vram_last_error.argtypes = []
    lib.vram_last_error.restype = ctypes.c_char_p
    return lib


def is_installed() -> bool:
    return _state["allocator"] is not None


def use_as_cuda_allocator() -> Any:
    """Make vramkit PyTorch's CUDA allocator for this process; returns torch's allocator object.

    Must run before anything initializes CUDA in torch (the first CUDA tensor, or a call such
    as ``torch.cuda.memory_allocated()``): torch cannot swap an allocator it has used. A second
    call is a no-op that returns the same allocator. Raises RuntimeError, naming the rule, when
    CUDA is already initialized, and when this PyTorch has no CUDA support."""
    import torch

    with _lock:
        if _state["allocator"] is not None:
            return _state["allocator"]
        memory = getattr(torch.cuda, "memory", None)
        if memory is None or not hasattr(memory, "CUDAPluggableAllocator") or not torch.backends.cuda.is_built():
            raise RuntimeError("vramkit.torch.use_as_cuda_allocator() needs a CUDA build of PyTorch "
                               f"(this one, {torch.__version__}, has no CUDA support)")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "vramkit.torch.use_as_cuda_allocator() must run before torch initializes CUDA: torch cannot swap "
                "an allocator it has already used, and CUDA is initialized in this process (a CUDA tensor was "
                "created, or a torch.cuda call initialized it). Call it at the top of the script, or run the script "
                "with `python -m vramkit run --allocator vramkit script.py`.")
        allocator = memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
        memory.change_current_allocator(allocator)
        _state["allocator"] = allocator
        _wrap_empty_cache(torch)
        _wrap_record_stream(torch)
        return allocator


def _wrap_empty_cache(torch: Any) -> None:
    original = torch.cuda.empty_cache

    lib = hooks()

    def empty_cache() -> None:
        original()
        lib.vramkit_torch_empty_cache()

    empty_cache.__doc__ = original.__doc__
    _state["empty_cache"] = original
    torch.cuda.empty_cache = empty_cache
    torch.cuda.memory.empty_cache = empty_cache


def _wrap_record_stream(torch: Any) -> None:
    original = torch.Tensor.record_stream
    lib = hooks()

    def record_stream(self: Any, stream: Any) -> None:
        original(self, stream)
        if self.is_cuda:  # the storage's start is the block vramkit handed out
            lib.vramkit_torch_record_stream(self.untyped_storage().data_ptr(), int(stream.cuda_stream))

    record_stream.__doc__ = original.__doc__
    _state["record_stream"] = original
    torch.Tensor.record_stream = record_stream


def is_vramkit_out_of_memory(exc: BaseException) -> bool:
    """True for the RuntimeError torch raises when vramkit's pool, as torch's CUDA allocator,
    had no memory for a tensor. False for anything else, torch's own ``torch.OutOfMemoryError``
    included: that one comes from torch's caching allocator, though its message reads the same.
    (``vramkit.survive.out_of_memory_rule`` recognises every kind of out-of-memory error.)"""
    if not isinstance(exc, RuntimeError) or " out of memory. Tried to allocate " not in str(exc):
        return False
    torch = sys.modules.get("torch")  # an error from torch means torch is imported
    torch_own = getattr(torch, "OutOfMemoryError", None)
    return not (isinstance(torch_own, type) and isinstance(exc, torch_own))


def _restore_python_wrappers() -> None:
    """Undo the Python-side wrappers and forget the allocator (tests only: torch itself cannot
    take a pluggable allocator back)."""
    import torch

    with _lock:
        if _state["empty_cache"] is not None:
            torch.cuda.empty_cache = torch.cuda.memory.empty_cache = _state["empty_cache"]
        if _state["record_stream"] is not None:
            # puts back torch's own method, which use_as_cuda_allocator wrapped
            torch.Tensor.record_stream = _state["record_stream"]  # type: ignore[method-assign]
        _state.update(allocator=None, empty_cache=None, record_stream=None)
