"""clear_cache: the `del model; gc.collect(); empty_cache()` ritual as a context manager that
reports what it achieved."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any

from .. import _C
from .._core.devices import DeviceLike
from .._core.text_html import TextAsHtml
from .api import memory_counters


def _format(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class CacheReport(TextAsHtml):
    """What a clear_cache() block did. Filled in on entry (…_before) and on exit (…_after)."""

    device: str
    allocated_before: int = 0
    reserved_before: int = 0
    allocated_after: int = 0
    reserved_after: int = 0
    freed_bytes: int = 0  # bytes the cache returned to the device, on entry and exit together
    collected_objects: int = 0  # objects gc.collect() found unreachable, on entry and exit
    _done: bool = field(default=False, repr=False)

    def __str__(self) -> str:
        return (f"clear_cache({self.device}): freed {_format(self.freed_bytes)}; allocated "
                f"{_format(self.allocated_before)} -> {_format(self.allocated_after)}, reserved "
                f"{_format(self.reserved_before)} -> {_format(self.reserved_after)}")


class clear_cache(contextlib.ContextDecorator):
    """Collect garbage and release cached memory on entry and exit, and report the effect.

        with vramkit.clear_cache() as r:
            del model            # drop the last references to the old model
        print(r.freed_bytes, r.reserved_before, r.reserved_after)

    On entry it records memory_allocated/memory_reserved, then runs gc.collect() and
    empty_cache(); on exit it does both again and records the figures after. Exceptions inside
    the block propagate; the cleanup still runs. Also usable as a decorator.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self._device = device

    def _clean(self, report: CacheReport) -> None:
        report.collected_objects += gc.collect()
        report.freed_bytes += _C.empty_cache(self._device)

    def __enter__(self) -> CacheReport:
        before = memory_counters(self._device)
        self._report = CacheReport(_C.canonical_device(self._device), allocated_before=before.allocated,
                                   reserved_before=before.reserved)
        self._clean(self._report)
        return self._report

    def __exit__(self, *exc: Any) -> None:
        report = self._report
        self._clean(report)
        after = memory_counters(self._device)
        report.allocated_after, report.reserved_after = after.allocated, after.reserved
        report._done = True
