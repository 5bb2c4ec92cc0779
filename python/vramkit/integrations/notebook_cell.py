"""``CellMeter``: what one notebook cell did to memory, for ``%%vram``.

Per device: allocated and reserved bytes before and after the cell, and their peaks during it.

* **vramkit's devices**: ``cpu``, every ``sim:N`` made so far and ``cuda:N``. The peak counters
  are reset at the cell's start (``reset_peak_memory_stats``: there is no other way to learn
  the peak of a stretch of time), so afterwards ``max_memory_allocated()`` means "since the
  cell began"; the peaks before the reset are kept in the report (``peak_before``).
* **torch's CUDA allocator**, when torch is imported and has initialized CUDA: the same figures
  from ``torch.cuda`` (its peaks are reset the same way). Never initializes CUDA.
* **torch's CPU tensors**, which no allocator counter sees: with torch imported before the
  cell, the cell runs under ``vramkit.torch.track()`` with a meter of CPU storages. It counts
  only tensors created in the cell: the bytes still alive at its end and the most alive at once.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .. import _C
from .._core.text_html import TextAsHtml
from .._core.sizes import format_size
from ..memory.api import MemoryCounters, memory_counters

__all__ = ["CellMeter", "CellReport", "DeviceChange", "known_devices", "signed_size"]

TORCH_CPU = "torch cpu*"  # the row of CPU tensors created in the cell (see the footnote)
_FOOTNOTE = "* tensors created in this cell: the bytes alive at its end, and the most alive at once"


def known_devices() -> list[str]:
    """vramkit's devices: cpu, the simulated devices made so far and the usable CUDA devices."""
    return (["cpu"] + [f"sim:{i}" for i in range(_C.sim_count())]
            + [f"cuda:{i}" for i in range(_C.cuda_device_count())])


def signed_size(n: int) -> str:
    return "0 B" if n == 0 else ("+" if n > 0 else "-") + format_size(abs(n))


@dataclass
class DeviceChange:
    """One device's figures for a cell, in bytes (``None`` where the device has no such figure:
    torch's CPU tensors have no reserved memory)."""

    device: str
    allocated_before: int
    allocated_after: int
    peak_allocated: int  # the most allocated at once during the cell
    reserved_before: int | None = None
    reserved_after: int | None = None
    peak_reserved: int | None = None
    peak_before: int | None = None  # the device's max_memory_allocated before the cell reset it

    @property
    def allocated_change(self) -> int:
        return self.allocated_after - self.allocated_before

    @property
    def reserved_change(self) -> int | None:
        if self.reserved_after is None or self.reserved_before is None:
            return None
        return self.reserved_after - self.reserved_before

    def used(self) -> bool:
        return any((self.allocated_before, self.allocated_after, self.peak_allocated, self.reserved_before,
                    self.reserved_after, self.peak_reserved))

    def cells(self) -> list[str]:
        """The row as %%vram prints it."""
        reserved = self.reserved_change
        return [self.device, signed_size(self.allocated_change), format_size(self.peak_allocated),
                "-" if reserved is None else signed_size(reserved),
                "-" if self.peak_reserved is None else format_size(self.peak_reserved)]


@dataclass
class CellReport(TextAsHtml):
    """What a ``%%vram`` cell did: ``devices`` (rows for the devices that held or used memory)
    and, when the cell raised, the exception's type name in ``error``."""

    devices: list[DeviceChange] = field(default_factory=list)
    error: str = ""

    def __str__(self) -> str:
        lines = [f"the cell raised {self.error}; figures up to the error"] if self.error else []
        if not self.devices:
            return "\n".join(lines + ["no memory allocated or reserved on any vramkit device or by torch"])
        rows = [["device", "Δ allocated", "peak allocated", "Δ reserved", "peak reserved"]]
        rows += [d.cells() for d in self.devices]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines += ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip()
                  for r in rows]
        if any(d.device == TORCH_CPU for d in self.devices):
            lines.append(_FOOTNOTE)
        return "\n".join(lines)


def _torch_cuda() -> Any | None:
    """torch.cuda when torch is imported and has initialized CUDA; never initializes it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_initialized() else None
    except (AttributeError, RuntimeError):
        return None


def _torch_cuda_counters(cuda: Any) -> dict[str, MemoryCounters]:
    """The counters of each CUDA device from torch.cuda, named as vramkit's;
    empty where torch's allocator has no such counters (vramkit's hooks in its place: then
    vramkit's cuda:N rows count the same memory)."""
    try:
        return {f"torch cuda:{i}": MemoryCounters(cuda.memory_allocated(i), cuda.max_memory_allocated(i),
                                                  cuda.memory_reserved(i), cuda.max_memory_reserved(i))
                for i in range(cuda.device_count())}
    except RuntimeError:
        return {}


class CellMeter:
    """A context manager around one cell: ``report`` is its ``CellReport`` after the block.

    devices: the vramkit devices to report (always shown); None means every known device that
    held or used memory, made during the cell too. meter_torch: run the cell under the torch
    CPU tensor meter (only when torch is already imported)."""

    def __init__(self, devices: list[str] | None = None, meter_torch: bool = True) -> None:
        self.devices = devices
        self.meter_torch = meter_torch
        self.report = CellReport()
        self._before: dict[str, MemoryCounters] = {}
        self._stack = contextlib.ExitStack()
        self._meter: Any = None

    def __enter__(self) -> CellMeter:
        for device in self.devices if self.devices is not None else known_devices():
            self._before[device] = memory_counters(device)
            _C.reset_peak_memory_stats(device)
        cuda = _torch_cuda()
        if cuda is not None:
            counters = _torch_cuda_counters(cuda)
            self._before.update(counters)
            for i in range(len(counters)):  # none where torch's allocator has no counters to reset
                cuda.reset_peak_memory_stats(i)
        if self.meter_torch and "torch" in sys.modules:
            from ..torch.meters import SiteMeter, track

            self._meter = self._stack.enter_context(track(SiteMeter("cpu")))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()
        self.report = CellReport(self._vramkit_rows() + self._torch_rows(), kind.__name__ if kind else "")

    def _row(self, device: str, after: MemoryCounters) -> DeviceChange:
        # A device made during the cell (or CUDA initialized by it) had nothing before.
        before = self._before.get(device, MemoryCounters(0, 0, 0, 0))
        return DeviceChange(device, allocated_before=before.allocated, allocated_after=after.allocated,
                            peak_allocated=after.peak_allocated, reserved_before=before.reserved,
                            reserved_after=after.reserved, peak_reserved=after.peak_reserved,
                            peak_before=before.peak_allocated)

    def _vramkit_rows(self) -> list[DeviceChange]:
        if self.devices is not None:
            return [self._row(d, memory_counters(d)) for d in self.devices]
        rows = [self._row(d, memory_counters(d)) for d in known_devices()]
        return [r for r in rows if r.used()]

    def _torch_rows(self) -> list[DeviceChange]:
        rows = []
        cuda = _torch_cuda()
        if cuda is not None:
            rows += [r for r in (self._row(d, c) for d, c in _torch_cuda_counters(cuda).items()) if r.used()]
        if self._meter is not None and self._meter.peak:
            rows.append(DeviceChange(TORCH_CPU, 0, self._meter.current, self._meter.peak))
        return rows
