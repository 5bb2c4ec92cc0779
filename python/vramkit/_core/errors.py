"""vramkit's exceptions. The C module raises these (registered at import)."""

from __future__ import annotations

from typing import Any

from .. import _C


class VramkitError(RuntimeError):
    """An allocator failure that is not bad input: a backend (CUDA) error, a missing device, or
    a broken invariant found by pool_check()."""


class OutOfMemoryError(VramkitError, MemoryError):
    """A device (or its configured limit) had no room for a request.

    The message follows PyTorch's shape ("... out of memory. Tried to allocate ..."), so retry
    loops written for torch.cuda.OutOfMemoryError keep working; the figures are also attributes:
    requested, segment_size, free, total, allocated, reserved, allowed (None without a cap) and
    device. It is a MemoryError and a RuntimeError, and it pickles across processes.
    """

    _FIELDS = ("requested", "segment_size", "free", "total", "allocated", "reserved", "allowed", "device")

    def __init__(self, message: str, *, requested: int | None = None, segment_size: int | None = None,
                 free: int | None = None, total: int | None = None, allocated: int | None = None,
                 reserved: int | None = None, allowed: int | None = None, device: str | None = None) -> None:
        super().__init__(message)
        self.requested = requested
        self.segment_size = segment_size
        self.free = free
        self.total = total
        self.allocated = allocated
        self.reserved = reserved
        self.allowed = allowed
        self.device = device

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_oom, (type(self), self.args[0], {f: getattr(self, f) for f in self._FIELDS}))


def _rebuild_oom(cls: type[OutOfMemoryError], message: str, fields: dict[str, Any]) -> OutOfMemoryError:
    return cls(message, **fields)


_C._register_exceptions(VramkitError, OutOfMemoryError)
