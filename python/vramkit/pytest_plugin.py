"""vramkit's pytest plugin: the markers' implementation. The plugin pytest loads (through the
``pytest11`` entry point "vramkit") is the top-level module ``vramkit_pytest``, which imports
this module only when a marked test runs, so loading the plugin never imports vramkit (a
source checkout's conftest can still choose which vramkit the tests import).

Markers::

    @pytest.mark.vram_limit("512 MiB", device="cpu")
    def test_preprocessing(): ...        # fails if it allocates more than 512 MiB at its peak

    @pytest.mark.vram_no_leak(runs=5, warmup=2, device="cpu")
    def test_training_step(): ...        # runs the body 2 + 5 times; fails on steady growth

What is measured, on `device` (a vramkit device: "cpu", "cuda:N", "sim:N"):

* vramkit's pool: the peak of ``memory_allocated`` during the test above what was allocated
  when it started (NumPy arrays with ``vramkit.numpy.install()``, vramkit Buffers, raw_alloc);
* torch tensors, where torch is imported: the bytes of live tensor storages created during the
  test on that device type (the ``vramkit.torch.track`` meter), since torch's CPU allocator has
  no counters of its own. Each source is checked against the limit on its own.

A failure names the top allocation sites: for vramkit's pool from the allocation history
(recorded during marked tests), for torch from the Python frame that created each storage.
Leak checks run the test function repeatedly in one test (fixtures are set up once), collect
garbage after each run, and fail only on steady growth: every measured run leaves more
allocated than the one before, by more than `tolerance`. A cache that fills during the warm-up
runs and then stays flat passes.

Fixture ``vram_sim``: a fresh simulated device for the test, 8 GiB or the capacity given by
``@pytest.mark.vram_sim("24 GiB")``.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

import pytest

__all__ = ["make_sim", "run_marked"]


def _size(value: Any, what: str) -> int:
    from ._trace_replay import parse_size

    if value == 0:
        return 0
    return parse_size(value, what)


def _device(marker: Any) -> str:
    from . import _C

    device = marker.kwargs.get("device", "cpu")
    try:
        return _C.canonical_device(device)
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.{marker.name}: bad device {device!r}: {exc}") from None


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------- torch storages

def _top(sites: dict[str, int], n: int = 5) -> list[str]:
    return [f"  {_fmt(b):>12}  {s}" for s, b in sorted(sites.items(), key=lambda kv: -kv[1])[:n] if b > 0]


# ----------------------------------------------------------------------------- vramkit pools


class _PoolWatch:
    """Allocated bytes and history of one vramkit device during a test."""

    def __init__(self, device: str) -> None:
        from . import _C

        self.C, self.device = _C, device
        self.was_recording = bool(_C.history_enabled(device))
        if not self.was_recording:
            _C.history_enable(device, 100_000)
        self.start = _C.memory_counters(device)[0]
        _C.reset_peak_memory_stats(device)

    def allocated(self) -> int:
        return self.C.memory_counters(self.device)[0]

    def peak_above_start(self) -> int:
        return max(0, self.C.memory_counters(self.device)[1] - self.start)

    def sites(self, n: int = 5) -> list[str]:
        from .sites import allocation_sites, format_bytes

        snapshot = self.C.memory_snapshot(self.device)
        out = []
        for s in allocation_sites(snapshot)[:n]:
            if s.live_at_peak or s.total_bytes:
                out.append(f"  {format_bytes(s.live_at_peak):>12}  {s.label}")
        return out

    def close(self) -> None:
        if not self.was_recording:
            self.C.history_enable(self.device, 0)


# ----------------------------------------------------------------------------- the call


def _call(pyfuncitem: Any) -> None:
    func = pyfuncitem.obj
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    func(**args)


def run_marked(pyfuncitem: Any) -> Any:
    """Run a test marked vram_limit and/or vram_no_leak (pytest_pyfunc_call's work)."""
    limit = pyfuncitem.get_closest_marker("vram_limit")
    leak = pyfuncitem.get_closest_marker("vram_no_leak")
    if leak is not None:
        _run_no_leak(pyfuncitem, leak, limit)
    else:
        _run_limited(pyfuncitem, limit)
    return True


def _watchers(device: str) -> tuple[_PoolWatch, Any, Any]:
    pool = _PoolWatch(device)
    meter, mode = None, None
    if "torch" in sys.modules:
        from .torch import SiteMeter, _MeterMode

        meter = SiteMeter(device.split(":")[0])
        mode = _MeterMode(meter)
    return pool, meter, mode


def _run_limited(pyfuncitem: Any, marker: Any) -> None:
    if not marker.args:
        raise pytest.UsageError("@pytest.mark.vram_limit needs a limit, e.g. vram_limit('512 MiB')")
    try:
        limit = _size(marker.args[0], "vram_limit")
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.vram_limit: {exc}") from None
    device = _device(marker)
    pool, meter, mode = _watchers(device)
    try:
        if mode is not None:
            with mode:
                _call(pyfuncitem)
        else:
            _call(pyfuncitem)
        pool_peak = pool.peak_above_start()
        problems = []
        if pool_peak > limit:
            problems.append(f"vramkit's {device} pool peaked at {_fmt(pool_peak)} allocated above the "
                            f"{_fmt(pool.start)} it started with; top allocation sites, by bytes live at the peak:\n"
                            + "\n".join(pool.sites()))
        if meter is not None and meter.peak > limit:
            problems.append(f"torch tensors on {device.split(':')[0]} peaked at {_fmt(meter.peak)} of live storages; "
                            f"top allocation sites at the peak:\n" + "\n".join(_top(meter.at_peak)))
        if problems:
            pytest.fail(f"vram_limit({_fmt(limit)}, device={device!r}) exceeded:\n" + "\n".join(problems),
                        pytrace=False)
    finally:
        pool.close()


def _run_no_leak(pyfuncitem: Any, marker: Any, limit_marker: Any) -> None:
    kw = marker.kwargs
    runs, warmup = kw.get("runs", 5), kw.get("warmup", 2)
    for name, value, low in (("runs", runs, 2), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise pytest.UsageError(f"@pytest.mark.vram_no_leak: {name} must be an integer >= {low}, got {value!r}")
    try:
        tolerance = _size(kw.get("tolerance", 0), "tolerance")
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.vram_no_leak: {exc}") from None
    device = _device(marker)
    pool, meter, mode = _watchers(device)
    pool_after: list[int] = []
    torch_after: list[int] = []
    try:
        for i in range(warmup + runs):
            if mode is not None:
                with mode:
                    _call(pyfuncitem)
            else:
                _call(pyfuncitem)
            gc.collect()
            if i >= warmup:
                pool_after.append(pool.allocated())
                torch_after.append(meter.current if meter is not None else 0)
        problems = []
        for what, values in ((f"vramkit's {device} pool (allocated)", pool_after),
                             (f"torch tensors on {device.split(':')[0]} (live storages)", torch_after)):
            steps = [b - a for a, b in zip(values, values[1:])]
            if steps and all(d > tolerance for d in steps):
                trail = " -> ".join(_fmt(v) for v in values)
                sites = pool.sites() if "pool" in what else _top(meter.live_by_site)
                problems.append(f"{what} grew on every one of {runs} runs after {warmup} warm-up runs, by "
                                f"{_fmt(sum(steps) / len(steps))} per run on average: {trail}\n"
                                f"  allocations still live, by site:\n" + "\n".join(sites))
        if problems:
            pytest.fail(f"vram_no_leak(device={device!r}) failed:\n" + "\n".join(problems), pytrace=False)
    finally:
        pool.close()
    if limit_marker is not None:
        _run_limited(pyfuncitem, limit_marker)


# ----------------------------------------------------------------------------- fixture

_sim_lock = threading.Lock()


def make_sim(request: Any) -> str:
    """The vram_sim fixture: a fresh simulated device ("sim:N"), 8 GiB or @pytest.mark.vram_sim(capacity)."""
    from . import sim

    marker = request.node.get_closest_marker("vram_sim")
    capacity = marker.args[0] if marker is not None and marker.args else "8 GiB"
    try:
        nbytes = _size(capacity, "vram_sim capacity")
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.vram_sim: {exc}") from None
    with _sim_lock:
        return sim.create(nbytes)
