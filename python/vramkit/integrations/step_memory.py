"""What the Hugging Face ``Trainer`` and Lightning callbacks share: a training run's memory
figures, the out-of-memory post-mortem armed for the run, the leak watch over windows of steps,
and the breakdown printed after the first step. The framework modules only translate their
framework's events into ``StepMonitor`` calls and hand its figures to the framework's logger.

**The figures** (``KEYS``, in MiB except the fraction), from the first source that applies:

* ``"torch.cuda"``: a model on a CUDA device under PyTorch's caching allocator: torch.cuda's
  ``memory_allocated``, ``memory_reserved``, ``max_memory_allocated`` and
  ``max_memory_reserved`` (peaks since the process started or the user's last
  ``reset_peak_memory_stats``: the callbacks never reset them, a user's own readings stay valid);
* ``"vramkit"``: a CUDA model with vramkit as torch's allocator
  (``vramkit.torch.use_as_cuda_allocator``): the same four counters of vramkit's ``cuda:N`` pool;
* ``"tensors"``: a model on the CPU, where torch's allocator keeps no counters: the bytes of the
  live tensor storages that vramkit knows of: the model's parameters, gradients and buffers and
  the optimizers' state (looked at when figures are taken), plus every storage created inside the
  metered windows (``vramkit.torch``'s live-tensor meter) while it lives. Tensors created between
  windows outside the model and the optimizer are not seen. torch's CPU allocator caches nothing,
  so there is no reserved memory and no fragmentation to report: only the two allocated keys.

``fragmentation`` is ``1 - allocated / reserved``: the part of the cache that holds no tensor
(0 when nothing is reserved).

**Windows.** The leak watch and the CPU meter put a ``TorchDispatchMode`` over every tensor
operation, which costs more than the step itself on a small model, so they run only over
windows of ``WINDOW`` consecutive steps, one starting every ``check_every`` steps (the first at
step 1). In each window the leak watch (``vramkit.survive.leaks``) takes its ``WARMUP`` steps and
then asks whether live memory grew in every one of the remaining steps; if it did, a
``MemoryGrowthWarning`` names the lines that allocated what grew.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from typing import Any

from .. import _C
from ..memory.api import memory_counters
from ..report.sites import format_bytes
from ..survive.leaks import LeakWatch, LeakWatchWarning
from ..survive.oom import OomWatch, active, on_oom
from ..survive.oom_report import model_state_bytes

__all__ = ["KEYS", "MemoryGrowthWarning", "StepMonitor", "WARMUP", "WINDOW"]

KEYS = ("vram/allocated_mib", "vram/reserved_mib", "vram/peak_allocated_mib", "vram/peak_reserved_mib",
        "vram/fragmentation")
WARMUP = 2  # steps of each window the leak watch takes as warm-up
WINDOW = WARMUP + 3  # so that growth must show in each of 3 measured steps
MiB = float(1 << 20)


class MemoryGrowthWarning(RuntimeWarning):
    """Live memory grew in every measured step of a window: a leak across training steps. The
    message is the leak watch's report, with the lines that allocated what grew."""


def check_options(check_every: int, leak_check: bool, breakdown: bool, oom: bool) -> None:
    """The callbacks' shared options, checked before anything is armed."""
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < WINDOW:
        raise ValueError(f"check_every must be an integer >= {WINDOW} (a window is {WINDOW} steps: {WARMUP} warm-up "
                         f"and 3 measured), got {check_every!r}")
    for name, value in (("leak_check", leak_check), ("breakdown", breakdown), ("oom", oom)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


class _Counters:
    """torch.cuda's or vramkit's counters of one CUDA device."""

    def __init__(self, torch: Any, index: int, vramkit_pool: bool) -> None:
        self.torch, self.index = torch, index
        self.source = "vramkit" if vramkit_pool else "torch.cuda"

    def read(self) -> tuple[int, int | None, int, int | None]:
        """(allocated, reserved, peak allocated, peak reserved) in bytes."""
        if self.source == "vramkit":
            c = memory_counters(f"cuda:{self.index}")
            return c.allocated, c.reserved, c.peak_allocated, c.peak_reserved
        cuda = self.torch.cuda
        return (int(cuda.memory_allocated(self.index)), int(cuda.memory_reserved(self.index)),
                int(cuda.max_memory_allocated(self.index)), int(cuda.max_memory_reserved(self.index)))


class _Tensors:
    """The live-tensor meter on the CPU (see the module docstring), pushed over the windows."""

    def __init__(self) -> None:
        from ..torch.meters import LiveMeter, _MeterMode

        class Meter(LiveMeter):
            def adopt(self, tensors: list[Any]) -> None:
                # Storages made before the meter (parameters, optimizer state) are counted too,
                # and their frees followed like those of the storages it saw created.
                for t in tensors:
                    try:
                        st = t.untyped_storage()
                    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no one storage
                        continue
                    if st.device.type == "cpu":
                        self._add(st)

        self.source = "tensors"
        self.meter = Meter()
        self.mode = _MeterMode(self.meter)


class StepMonitor:
    """One training run's memory watch; see the module docstring. The framework module calls
    ``start`` at the start of training, ``begin_step``/``end_step`` around each step,
    ``after_optimizer`` after the first step's optimizer step (gradients still live), and
    ``stop`` at the end (or after an exception)."""

    def __init__(self, *, check_every: int, leak_check: bool, breakdown: bool, oom: bool,
                 oom_dir: str | os.PathLike[str] | None) -> None:
        check_options(check_every, leak_check, breakdown, oom)
        self.check_every, self.leak_check, self.breakdown, self.oom = check_every, leak_check, breakdown, oom
        self.oom_dir = None if oom_dir is None else os.fspath(oom_dir)
        self.device = "cpu"
        self.source: _Counters | _Tensors | None = None
        self.models: list[Any] = []
        self.optimizers: list[Any] = []
        self.steps = 0  # steps begun in this run
        self.watch: OomWatch | None = None
        self.own_watch = False  # the watch was armed here (a user's own is left armed)
        self.leaks: LeakWatch | None = None
        self.in_window = -1  # steps ended in the open window; -1 while none is open
        self.growth: list[str] = []  # the leak reports warned about
        self._first: str | None = None  # the breakdown, once measured
        self._open_modes: list[Any] = []

    # ------------------------------------------------------------------ run

    def start(self, device: Any, models: list[Any], optimizers: list[Any], default_oom_dir: str) -> None:
        """A run starts on torch device `device` with these models and optimizers."""
        self.stop()  # a previous run that ended in an exception left its windows open
        import torch

        device = torch.device(device)
        self.models, self.optimizers = [m for m in models if m is not None], [o for o in optimizers if o is not None]
        self.steps, self.in_window, self._first = 0, -1, None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = f"cuda:{index}"
            from ..torch.allocator import is_installed

            self.source = _Counters(torch, index, is_installed())
        elif device.type == "cpu":
            self.device, self.source = "cpu", _Tensors()
        else:  # mps, xpu...: no counters vramkit reads, and the CPU meter would see none of its tensors
            self.device, self.source, self.leak_check = str(device), None, False
            warnings.warn(f"vramkit: no memory figures and no leak check on {device} (CUDA devices and the CPU only); "
                          "the out-of-memory post-mortem is armed", RuntimeWarning, stacklevel=3)
        if self.oom:
            self._arm(default_oom_dir)

    def _arm(self, default_oom_dir: str) -> None:
        watch = active()
        self.own_watch = watch is None
        if watch is None:
            watch = on_oom(self.oom_dir or default_oom_dir)
        # A user's own watch stays theirs; it only learns the model, so its screen splits by model state.
        for m in self.models:
            watch.track(model=m)
        for o in self.optimizers:
            watch.track(optimizer=o)
        self.watch = watch

    def stop(self) -> None:
        """End of the run: close the open window, hand over a pending out-of-memory report, and
        disarm the post-mortem armed here."""
        self._close_window(judge=False)
        if self.watch is not None:
            _C._drain_oom_queue()  # a vramkit pool's failure still queued is reported before disarming
            if self.own_watch and active() is self.watch:
                self.watch.remove()
            self.watch = None

    # ------------------------------------------------------------------ steps

    def begin_step(self) -> None:
        self.steps += 1
        if self.in_window < 0 and (self.steps - 1) % self.check_every == 0:
            self._open_window()

    def after_optimizer(self) -> None:
        """After the first step's optimizer step: the breakdown by what the memory holds."""
        if self.breakdown and self.steps == 1 and self._first is None:
            self._first = self._breakdown()

    def end_step(self) -> str | None:
        """The step ended; returns the breakdown text at the end of the first step, else None."""
        if self.in_window >= 0:
            self.in_window += 1
            if self.leaks is not None:
                gc.collect(1)  # the young generations only: a full collection costs ~0.3 s with transformers loaded
                self.leaks.step()
            if self.in_window >= WINDOW:
                self._close_window(judge=True)
        if self.steps == 1 and self.breakdown:
            text = self._first if self._first is not None else self._breakdown()
            self._first = text
            return text
        return None

    # ------------------------------------------------------------------ windows

    def _open_window(self) -> None:
        self.in_window = 0
        if self.leak_check:
            try:
                self.leaks = LeakWatch(self.device, warmup=WARMUP, collect=False, auto_step=False)
                self.leaks.__enter__()
                self._open_modes.append(self.leaks)
            except Exception as exc:  # noqa: BLE001 -- e.g. a vramkit build without CUDA: no check, say so once
                self.leaks, self.leak_check = None, False
                warnings.warn(f"vramkit: the leak check is off for this run: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)
        if isinstance(self.source, _Tensors):
            self.source.meter.adopt(self._state_tensors())
            self.source.mode.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's is unannotated
            self._open_modes.append(self.source.mode)

    def _close_window(self, judge: bool) -> None:
        """Pop the window's dispatch modes (newest first) and, after a full window, judge growth."""
        while self._open_modes:
            mode = self._open_modes.pop()
            pushed = getattr(mode, "_mode", None) if mode is self.leaks else mode
            if _top_mode() is not pushed:
                # Something pushed a mode over ours (a step that raised inside another mode):
                # popping now would pop that one instead. Leave them; say so.
                warnings.warn("vramkit: a tensor-metering mode of the memory callback could not be removed "
                              "(another TorchDispatchMode is above it)", RuntimeWarning, stacklevel=2)
                self._open_modes.clear()
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LeakWatchWarning)  # a run that ended mid-window
                mode.__exit__(None, None, None)
        if judge and self.leaks is not None:
            report = self.leaks.report()
            if report.leaking:
                first = self.steps - WINDOW + 1
                text = f"vramkit: memory grew across training steps {first}-{self.steps}:\n{report}"
                self.growth.append(text)
                warnings.warn(text, MemoryGrowthWarning, stacklevel=2)
        self.leaks, self.in_window = None, -1

    # ------------------------------------------------------------------ figures

    def _state_tensors(self) -> list[Any]:
        out: list[Any] = []
        for m in self.models:
            for p in m.parameters():
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out += list(m.buffers())
        for opt in self.optimizers:
            for state in opt.state.values():
                out += [v for v in state.values() if hasattr(v, "untyped_storage")]
        return out

    def counters(self) -> tuple[int, int | None, int, int | None]:
        """(allocated, reserved, peak allocated, peak reserved) in bytes; None where the source
        has no such figure."""
        if isinstance(self.source, _Counters):
            return self.source.read()
        if isinstance(self.source, _Tensors):
            meter = self.source.meter
            meter.adopt(self._state_tensors())
            return meter.current, None, meter.peak, None
        return 0, None, 0, None

    def figures(self) -> dict[str, float]:
        """The KEYS this source measures, for the framework's logger ({} without a source)."""
        if self.source is None:
            return {}
        a, r, peak_a, peak_r = self.counters()
        out = {KEYS[0]: round(a / MiB, 6)}
        if r is not None:
            out[KEYS[1]] = round(r / MiB, 6)
        out[KEYS[2]] = round(peak_a / MiB, 6)
        if peak_r is not None:
            out[KEYS[3]] = round(peak_r / MiB, 6)
        if r is not None:
            out[KEYS[4]] = round(1 - a / r, 4) if r else 0.0
        return out

    def source_name(self) -> str:
        if self.source is None:
            return f"{self.device}: not measured"
        if isinstance(self.source, _Counters):
            return (f"{self.device}, vramkit's allocator" if self.source.source == "vramkit"
                    else f"{self.device}, torch.cuda's counters")
        return f"{self.device}, live tensors seen by vramkit.torch's meter"

    def _breakdown(self) -> str:
        a, _, peak_a, _ = self.counters()
        parts = model_state_bytes(self.device, self.models, self.optimizers, a)
        lines = [f"vramkit: memory after the first training step ({self.source_name()})"]
        if parts:
            lines.append("  " + ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items()))
        else:
            lines.append("  (no parameter of the model is on this device)")
        above = f" ({format_bytes(peak_a - a)} more than now: activations and temporaries)" if peak_a > a else ""
        lines.append(f"  live now {format_bytes(a)}; peak so far {format_bytes(peak_a)}{above}")
        return "\n".join(lines)


def _top_mode() -> Any:
    """The innermost TorchDispatchMode now pushed, or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.utils._python_dispatch._get_current_dispatch_mode()
    except (AttributeError, RuntimeError):
        return None
