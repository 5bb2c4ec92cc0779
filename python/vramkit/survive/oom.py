"""``vramkit.on_oom("oom-dumps/")``: a post-mortem of every out-of-memory, without changing the
training loop.

From the call on, each out-of-memory writes a snapshot (pytorch.org/memory_viz) and the offline
HTML timeline to the directory, and prints one screen (``oom_report.PostMortem``): what was
asked and free, the top live allocation sites at the failure, the model/optimizer/rest split
when the model is known (``OomWatch.track``), and the remedies that apply. Where the failures
come from:

* **vramkit's pools** (``cpu``, ``sim:N``, ``cuda:N``; NumPy arrays under vramkit's handler,
  torch's tensors under ``use_as_cuda_allocator``): the C core reports every failure
  (``vram_set_oom_callback``); the extension queues it and the interpreter hands it to this
  module at its next safe point on the main thread (``_C._set_oom_observer``), since the
  failure can happen inside NumPy's allocation or on a thread without the GIL. The pools'
  histories (turned on here) keep what was live at the failure.
* **PyTorch's CUDA caching allocator**: torch's own out-of-memory observer
  (``torch._C._cuda_attach_out_of_memory_observer``) with torch's memory history recording
  (``torch.cuda.memory._record_memory_history``, queued on CUDA's lazy initialization as
  ``vramkit run`` does). Armed when torch is imported, now or later. torch has no way to detach
  an observer: one forwarder is attached per process and forwards to the active watch.

Multi-process jobs: the rank (``RANK``, as torchrun sets it) is in each file name and on the
screen. At most `max_dumps` failures write files (a retry loop that halves its batch after each
OOM would fill a disk); later ones print a line. Writing never raises: a full disk or an
unwritable directory is a warning, and the out-of-memory goes on as it would have.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, TextIO

from .. import _C
from .._core.after_import import AfterImport
from .oom_report import OomDumpWarning, PostMortem, build, model_state_bytes, write_files

__all__ = ["OomDumpWarning", "OomWatch", "PostMortem", "active", "on_oom"]

HISTORY_ENTRIES = 100_000  # events kept per device, as vramkit run keeps

_lock = threading.RLock()
_active: OomWatch | None = None
_torch_forwarder_attached = False


class OomWatch:
    """An armed post-mortem (``on_oom``). ``remove()`` (or leaving its ``with`` block) disarms it;
    ``dumps`` are the post-mortems so far; ``track(model=..., optimizer=...)`` lets a
    post-mortem split the device's memory into parameters, gradients and optimizer state."""

    def __init__(self, directory: str, *, top: int, max_dumps: int, stream: TextIO | None, history: bool) -> None:
        self.directory = directory
        self.top = top
        self.max_dumps = max_dumps
        self.stream = stream
        self.history = history
        self.dumps: list[PostMortem] = []
        self.failures = 0  # out-of-memories seen, dumped or not
        self._models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._history_started: list[str] = []  # vramkit devices whose history this watch turned on
        self._paused = 0
        self._removed = False

    def __enter__(self) -> OomWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def armed(self) -> bool:
        return not self._removed

    def track(self, model: Any = None, optimizer: Any = None) -> OomWatch:
        """Remember (weakly) a model and/or optimizer whose tensors a post-mortem counts."""
        if model is not None:
            self._models.add(model)
        if optimizer is not None:
            self._optimizers.add(optimizer)
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context in which out-of-memories are expected (a batch-size search): not reported."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def remove(self) -> None:
        """Disarm: no more post-mortems; the histories this watch turned on are turned off."""
        global _active
        with _lock:
            if self._removed:
                return
            self._removed = True
            if _active is self:
                _active = None
                _C._set_oom_observer(None)
        from ..memory.api import record_memory_history

        for device in self._history_started:
            try:
                record_memory_history(False, device=device)
            except Exception:  # noqa: BLE001 -- a device gone since: nothing to turn off
                pass

    # ------------------------------------------------------------------ failures

    def _vramkit_oom(self, info: dict[str, Any]) -> None:
        """The extension's observer: a failure of one of vramkit's pools (see the module docstring)."""
        from ..memory.api import memory_snapshot

        device = str(info.get("device"))
        snapshot = None
        problems = []
        try:
            snapshot = memory_snapshot(device.partition("/")[0])
        except Exception as exc:  # noqa: BLE001 -- a private pool, a device gone: figures only
            problems.append(f"no snapshot of {device}: {exc}")
        self._report(info, snapshot, "vramkit", None, problems)

    def _torch_oom(self, device: int, requested: int, limit: int, free: int) -> None:
        """torch's observer, called by its allocator before it raises OutOfMemoryError (with its
        lock released): (device, the request, the memory fraction's cap if one is set else the
        device's total, the device's free bytes)."""
        torch = sys.modules["torch"]
        info: dict[str, Any] = {"device": f"cuda:{device}", "requested": requested, "free": free,
                                "message": "CUDA out of memory (PyTorch's caching allocator)"}
        problems = []
        try:
            info["allocated"] = int(torch.cuda.memory_allocated(device))
            info["reserved"] = int(torch.cuda.memory_reserved(device))
            info["total"] = total = int(torch.cuda.get_device_properties(device).total_memory)
            if 0 < limit < total:  # set_per_process_memory_fraction
                info["allowed"] = limit
        except Exception as exc:  # noqa: BLE001
            problems.append(f"torch's counters could not be read: {exc}")
        snapshot = None
        try:
            snapshot = torch.cuda.memory._snapshot()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"torch.cuda.memory._snapshot() failed: {exc}")
        self._report(info, snapshot, "torch", device, problems)

    def _report(self, info: dict[str, Any], snapshot: Any, allocator: str, trace_index: int | None,
                problems: list[str]) -> None:
        if self._removed or self._paused:
            return
        self.failures += 1
        n, rank = self.failures, _rank()
        device = str(info.get("device"))
        if n > self.max_dumps:
            self._print(f"vramkit: out of memory on {device} again ({n} so far; the first {self.max_dumps} are "
                        f"in {self.directory})")
            return
        categories = model_state_bytes(device, list(self._models), list(self._optimizers), info.get("allocated"))
        pm = build(info, snapshot, allocator=allocator, top=self.top, trace_index=trace_index,
                   categories=categories, other_processes=_other_processes(device), rank=rank)
        pm.problems[:0] = problems
        stem = (f"oom-{time.strftime('%Y%m%d-%H%M%S', time.localtime(pm.when))}-pid{os.getpid()}"
                + (f"-rank{rank}" if rank is not None else "") + f"-{device.replace(':', '').replace('/', '-')}-{n}")
        write_files(pm, snapshot, self.directory, stem, trace_index)
        self.dumps.append(pm)
        self._print(pm.text())

    def _print(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream: the files still hold it
            pass


def on_oom(directory: str | os.PathLike[str] = "oom-dumps", *, top: int = 5, max_dumps: int = 3,
           stream: TextIO | None = None, history: bool = True, devices: Any = ("cpu",)) -> OomWatch:
    """Arm the out-of-memory post-mortem (see the module docstring) and return its watch. One
    watch is active per process: arming again replaces the previous one.

    `directory` receives the files (created at the first failure). `top`: allocation sites on
    the screen. `max_dumps`: failures that write files. `stream`: where the screen goes
    (standard error). `history`: turn on the allocation history (with Python stacks) of vramkit's
    `devices` and of torch's CUDA allocator where it is off, so the screen can say where live
    memory was allocated; without it the figures and the split by model state remain."""
    global _active
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int >= 0, got {top!r}")
    if isinstance(max_dumps, bool) or not isinstance(max_dumps, int) or max_dumps < 0:
        raise ValueError(f"max_dumps must be an int >= 0, got {max_dumps!r}")
    path = os.fspath(directory)
    if not isinstance(path, str) or not path:
        raise ValueError(f"directory must be a non-empty path, got {directory!r}")
    names = [devices] if isinstance(devices, str) else list(devices)
    watch = OomWatch(path, top=top, max_dumps=max_dumps, stream=stream, history=history)
    if history:
        _start_histories(watch, names)  # (bad device names raise here, before anything changes)
    with _lock:
        previous, _active = _active, watch
        _C._set_oom_observer(_forward_vramkit)
    if previous is not None:
        previous.remove()
    _arm_torch()
    return watch


def active() -> OomWatch | None:
    """The armed watch, if any."""
    return _active


def _start_histories(watch: OomWatch, devices: list[Any]) -> None:
    from ..memory.api import record_memory_history

    off = [d for d in devices if not _C.history_enabled(d)]  # (raises on a device that does not exist)
    for d in off:
        record_memory_history(True, max_entries=HISTORY_ENTRIES, device=d)
        watch._history_started.append(d)


def _forward_vramkit(info: dict[str, Any]) -> None:
    watch = _active
    if watch is not None:
        watch._vramkit_oom(info)


def _forward_torch(device: int, requested: int, limit: int, free: int) -> None:
    watch = _active
    if watch is not None:
        watch._torch_oom(device, requested, limit, free)


def _arm_torch() -> None:
    """Attach the forwarder to torch's CUDA allocator once torch is imported (now or later)."""
    if "torch" in sys.modules:
        _attach_torch(sys.modules["torch"])
    elif not any(isinstance(f, AfterImport) and f.callback is _attach_torch for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport("torch", _attach_torch))


def _attach_torch(torch: Any) -> None:
    global _torch_forwarder_attached
    for finder in [f for f in sys.meta_path if isinstance(f, AfterImport) and f.callback is _attach_torch]:
        sys.meta_path.remove(finder)
    with _lock:
        if _torch_forwarder_attached:
            return
        try:
            if not torch.cuda.is_available():
                return
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is None:
                return
            watch = _active
            if watch is not None and watch.history:
                _start_torch_history(torch)
            attach(_forward_torch)
            _torch_forwarder_attached = True
        except Exception as exc:  # noqa: BLE001 -- never break the user's import of torch
            watch = _active
            if watch is not None:
                watch._print(f"vramkit.on_oom: torch's allocator could not be watched: {type(exc).__name__}: {exc}")


def _start_torch_history(torch: Any) -> None:
    """torch's history with Python stacks, started with CUDA (never initializing it)."""
    def start() -> None:
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=HISTORY_ENTRIES)
        except Exception:  # noqa: BLE001 -- an exception here would fail torch's CUDA init
            pass

    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if torch.cuda.is_initialized() or lazy_call is None:
        start()
    else:
        lazy_call(start)


def _rank() -> int | None:
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


def _other_processes(device: str) -> list[tuple[int, str, int, bool]]:
    """Other processes on this GPU, from NVML (empty off CUDA or without NVML)."""
    if not device.startswith("cuda"):
        return []
    try:
        from .smi import _nvml_index, processes

        index = _nvml_index(device.partition("/")[0])
        return [(p.pid, (p.command or "?").split()[0] if p.command else "?", p.used_memory or 0, p.stale)
                for p in processes(index) if p.pid != os.getpid()]
    except Exception:  # noqa: BLE001 -- no NVML, no driver: nothing to say
        return []
