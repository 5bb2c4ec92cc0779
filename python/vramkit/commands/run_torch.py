"""`vramkit run` on a PyTorch script: the script's own tensor memory, measured by torch itself.

Nothing here imports torch unless the script does. ``TorchWatch.start()`` puts a finder on
``sys.meta_path`` that waits for the script's ``import torch`` and arms the recording as soon as
torch's ``__init__`` has run (before the script can create a tensor):

* **CUDA** (this torch sees a GPU): torch's own caching allocator records its history,
  ``torch.cuda.memory._record_memory_history(stacks="python")``. It is queued on torch.cuda's
  lazy-initialization list, so it starts together with CUDA and never initializes CUDA (half a
  GiB of context) for a script that does not use the GPU. After the script, each GPU the script
  used is reported with torch's own figures: ``torch.cuda.memory_summary(d)``,
  ``max_memory_allocated/reserved(d)``, ``memory_stats(d)["allocation.all.allocated"]``, and
  ``torch.cuda.memory._snapshot()``, which is the snapshot format vramkit's allocation sites and
  timeline already read (and pytorch.org/memory_viz opens).
* **CPU only** (no usable GPU): the live-tensor meter of ``vramkit.torch.track()`` (a
  ``TorchDispatchMode`` on the main thread) over the whole script, recording each storage's
  Python stack at its creation and at its death, turned into a snapshot of the same format: one
  event pair per storage, one "segment" per live storage (CPU tensors are not cached, so reserved
  equals allocated). Storages made by other threads (DataLoader workers) and storages that alias
  NumPy memory (``torch.from_numpy``) are not seen; the NumPy side is vramkit's cpu pool report.

With ``vramkit run --allocator vramkit`` the CUDA tensors come from vramkit's own ``cuda:N`` pool
(``vramkit.torch.use_as_cuda_allocator()``) and are reported as vramkit's devices instead.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .._core.after_import import AfterImport as _AfterImport

__all__ = ["DeviceReport", "TorchWatch"]

MAX_STACK = 48  # Python frames kept per event: enough to get out of torch.nn into the user's code


@dataclass
class DeviceReport:
    """What vramkit run prints and writes for one device, whoever measured it (vramkit's pool,
    torch's caching allocator, or the live-tensor meter)."""

    device: str  # "cpu", "cuda:0"
    heading: str  # what measured it, printed in the heading
    summary: str  # printed before the peaks line (a 75-column table where there is one)
    peak_allocated: int
    peak_reserved: int
    allocations: int  # allocations made while the script ran
    snapshot: dict[str, Any]  # torch.cuda.memory._snapshot()'s format
    trace_index: int | None  # which of snapshot["device_traces"]; None: the snapshot's own device
    suffix: str  # file-name suffix of this device's snapshot and timeline


def _stack(depth: int = 2) -> tuple[tuple[Any, int], ...]:
    """The caller's Python stack, innermost first, as (code object, line) pairs: cheap to take on
    every tensor, and holding code objects keeps no frame's locals alive."""
    frames: list[tuple[Any, int]] = []
    f: FrameType | None = sys._getframe(depth)
    while f is not None and len(frames) < MAX_STACK:
        frames.append((f.f_code, f.f_lineno))
        f = f.f_back
    return tuple(frames)


def _frames(stack: tuple[tuple[Any, int], ...], cache: dict[Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A stack in the snapshot's form: [{filename, line, name}], innermost first."""
    frames = cache.get(stack)
    if frames is None:
        frames = cache[stack] = [{"filename": code.co_filename, "line": line, "name": code.co_name}
                                 for code, line in stack]
    return frames


def _make_recorder(max_entries: int) -> Any:
    """A LiveMeter over CPU storages that also keeps a snapshot-format history (needs torch)."""
    from ..torch.meters import LiveMeter

    class CpuTensorRecorder(LiveMeter):
        def __init__(self) -> None:
            super().__init__()
            # (action, ptr, size, stack, time in us), made into snapshot entries by snapshot()
            self.trace: collections.deque[tuple[str, int, int, tuple[tuple[Any, int], ...], int]] = \
                collections.deque(maxlen=max_entries)
            self.frames_of: dict[int, tuple[tuple[Any, int], ...]] = {}
            self.allocations = 0

        def _event(self, action: str, ptr: int, size: int, stack: tuple[tuple[Any, int], ...], now: int) -> None:
            self.trace.append((action, ptr, size, stack, now))  # made into a snapshot entry in snapshot()

        def _add(self, st: Any) -> None:
            if st.device.type != "cpu":
                return
            ptr, n = st.data_ptr(), st.nbytes()
            if ptr == 0 or n == 0 or ptr in self._live:
                return
            frames = _stack(4)  # past _stack, _add, _record and __torch_dispatch__
            super()._add(st)
            now = time.time_ns() // 1000
            with self._lock:
                if ptr not in self._live:
                    return
                self.frames_of[ptr] = frames
                self.allocations += 1
                # No cache in front of torch's CPU allocator: each storage is its own "segment".
                self._event("segment_alloc", ptr, n, frames, now)
                self._event("alloc", ptr, n, frames, now)

        def _free(self, ptr: int, token: object) -> None:
            with self._lock:
                entry = self._live.get(ptr)
                ours = entry is not None and entry[1] is token
            super()._free(ptr, token)
            if not ours or entry is None:  # (ours: entry is not None)
                return
            frames, now = _stack(2), time.time_ns() // 1000
            with self._lock:
                self.frames_of.pop(ptr, None)
                for action in ("free_requested", "free_completed", "segment_free"):
                    self._event(action, ptr, entry[0], frames, now)

        def snapshot(self) -> dict[str, Any]:
            cache: dict[Any, list[dict[str, Any]]] = {}
            with self._lock:
                trace = [{"action": action, "addr": ptr, "size": size, "stream": 0, "time_us": now,
                          "frames": _frames(stack, cache)} for action, ptr, size, stack, now in self.trace]
                segments = [{
                    "address": ptr, "total_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                    "allocated_size": n, "active_size": n, "requested_size": n, "device": 0, "frames": [],
                    "is_expandable": False,
                    "blocks": [{"address": ptr, "size": n, "requested_size": n, "state": "active_allocated",
                                "frames": _frames(self.frames_of.get(ptr, ()), cache)}],
                } for ptr, (n, _) in sorted(self._live.items())]
                return {"segments": segments, "device_traces": [trace]}

    return CpuTensorRecorder()


class TorchWatch:
    """Arms torch's memory recording for the script; collects DeviceReports afterwards."""

    def __init__(self, max_entries: int, cuda: bool = True) -> None:
        self.max_entries = max_entries
        self.cuda = cuda  # False: torch's CUDA tensors are vramkit's (--allocator vramkit), reported as its pool
        self.problems: list[str] = []  # what could not be measured, and why
        self._finder: _AfterImport | None = None
        self._torch: Any = None
        self._recorder: Any = None
        self._mode: Any = None
        self._cuda_armed = False
        self._cuda_recording = False
        self._stopped = False
        self._allocations_before: dict[int, int] = {}

    def start(self) -> None:
        if "torch" in sys.modules:
            self._armed(sys.modules["torch"])
        else:
            self._finder = _AfterImport("torch", self._armed)
            sys.meta_path.insert(0, self._finder)

    def _armed(self, torch: Any) -> None:
        self._remove_finder()
        if self._torch is not None:
            return
        self._torch = torch
        try:
            if torch.cuda.is_available():
                if self.cuda:
                    self._arm_cuda(torch)
            else:
                self._arm_cpu()
        except Exception as exc:  # noqa: BLE001 -- never break the user's import of torch
            self.problems.append(f"torch's memory could not be recorded: {type(exc).__name__}: {exc}")

    def _arm_cuda(self, torch: Any) -> None:
        self._cuda_armed = True

        def start_recording() -> None:
            if self._stopped:  # CUDA started after the script ended (an in-process run): not ours to record
                return
            try:
                torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                         max_entries=self.max_entries)
                self._cuda_recording = True
                for d in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(d)
                    self._allocations_before[d] = torch.cuda.memory_stats(d).get("allocation.all.allocated", 0)
            except Exception as exc:  # noqa: BLE001 -- an exception here would fail torch's CUDA init
                self.problems.append(f"torch.cuda.memory._record_memory_history failed: {type(exc).__name__}: {exc}")

        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if torch.cuda.is_initialized() or lazy_call is None:
            start_recording()
        else:
            lazy_call(start_recording)

    def _arm_cpu(self) -> None:
        from ..torch.meters import _MeterMode

        self._recorder = _make_recorder(self.max_entries)
        self._mode = _MeterMode(self._recorder)
        self._mode.__enter__()

    def _remove_finder(self) -> None:
        if self._finder is not None:
            try:
                sys.meta_path.remove(self._finder)
            except ValueError:
                pass
            self._finder = None

    def stop(self) -> list[DeviceReport]:
        """Stop recording (leaving torch as it was found) and return the reports."""
        self._stopped = True
        self._remove_finder()
        reports: list[DeviceReport] = []
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 -- the script left torch's mode stack unbalanced
                self.problems.append(f"the CPU tensor meter could not be removed cleanly: {exc}")
            self._mode = None
            reports += self._cpu_reports()
        if self._cuda_armed and self._cuda_recording:
            reports += self._cuda_reports()
        return reports

    def _cpu_reports(self) -> list[DeviceReport]:
        from ..report.sites import format_bytes

        r = self._recorder
        if not r.allocations:
            return []
        summary = (f"PyTorch CPU tensors (live-tensor meter: storages created by torch operations on the "
                   f"main thread)\n  live now: {format_bytes(r.current)} in {r.num_storages:,} storages")
        return [DeviceReport("cpu", "PyTorch tensors, live-tensor meter", summary, r.peak, r.peak, r.allocations,
                            r.snapshot(), 0, "torch-cpu")]

    def _cuda_reports(self) -> list[DeviceReport]:
        torch = self._torch
        cuda = torch.cuda
        reports: list[DeviceReport] = []
        try:
            snapshot = cuda.memory._snapshot()
            for d in range(cuda.device_count()):
                stats = cuda.memory_stats(d)
                allocations = stats.get("allocation.all.allocated", 0) - self._allocations_before.get(d, 0)
                traces = snapshot.get("device_traces") or []
                if not allocations and not (d < len(traces) and traces[d]):
                    continue  # a GPU the script did not use
                reports.append(DeviceReport(
                    f"cuda:{d}", "PyTorch's caching allocator", cuda.memory_summary(d),
                    cuda.max_memory_allocated(d), cuda.max_memory_reserved(d), allocations, snapshot, d, f"cuda{d}"))
        finally:
            try:
                cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"could not stop torch's memory history: {exc}")
        return reports
