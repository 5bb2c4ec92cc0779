"""vramkit's pytest plugin: the markers' implementation. The plugin pytest loads (through the
``pytest11`` entry point "vramkit") is this package's ``__init__`` (``vramkit_pytest``), which
imports this module only when a marked test runs, so loading the plugin never imports vramkit
(a source checkout's conftest can still choose which vramkit the tests import).

Markers::

    @pytest.mark.vram_limit("512 MiB", device="cpu")
    def test_preprocessing(): ...        # fails if it allocates more than 512 MiB at its peak

    @pytest.mark.vram_no_leak(runs=5, warmup=2, device="cpu")
    def test_training_step(): ...        # runs the body 2 + 5 times; fails on steady growth

What is measured, on `device` (a vramkit device: "cpu", "cuda:N", "sim:N"):

* vramkit's pool: the peak of ``memory_allocated`` during the test above what was allocated
  when it started (vramkit Buffers, raw_alloc, and on "cpu" NumPy arrays: the markers install
  vramkit's NumPy handler for the test, as ``vramkit.numpy.caching()``, and restore the one the
  test had; ``numpy=False`` on the marker leaves NumPy's own allocator, whose arrays are not
  counted);
* torch tensors, where torch is imported: the bytes of live tensor storages created during the
  test on that device type (the ``vramkit.torch.track`` meter), since torch's CPU allocator has
  no counters of its own. Each source is checked against the limit on its own.

A failure names the top allocation sites: for vramkit's pool from the allocation history
(recorded during marked tests), for torch from the Python frame that created each storage.
Leak checks run the test function repeatedly in one test (fixtures are set up once), collect
garbage after each run, and fail only on steady growth: every measured run leaves more
allocated than the one before, by more than `tolerance`. A cache that fills during the warm-up
runs and then stays flat passes.

unittest.TestCase methods are measured too: pytest runs them through unittest, not through
``pytest_pyfunc_call``, so the plugin wraps their ``runtest()`` for the call phase. setUp and
tearDown run inside the measurement, and a leak check reruns all three. unittest hands a
failure to pytest instead of raising it; a run that fails ends the reruns, and that failure
is what pytest reports.

Fixture ``vram_sim``: a fresh simulated device for the test, 8 GiB or the capacity given by
``@pytest.mark.vram_sim("24 GiB")``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Any, Callable, Iterator

import pytest

from vramkit import _C
from vramkit._core.sizes import format_size, parse_size
from vramkit.memory.api import memory_counters

__all__ = ["make_sim", "run_marked"]


def _size(value: Any, what: str) -> int:
    if value == 0:
        return 0
    return parse_size(value, what)


def _device(marker: Any) -> str:
    device = marker.kwargs.get("device", "cpu")
    try:
        return _C.canonical_device(device)
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.{marker.name}: bad device {device!r}: {exc}") from None


# ----------------------------------------------------------------------------- torch storages

def _top(sites: dict[str, int], n: int = 5) -> list[str]:
    return [f"  {format_size(b):>12}  {s}" for s, b in sorted(sites.items(), key=lambda kv: -kv[1])[:n] if b > 0]


# ----------------------------------------------------------------------------- vramkit pools


class _PoolWatch:
    """Allocated bytes and history of one vramkit device during a test."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.was_recording = bool(_C.history_enabled(device))
        if not self.was_recording:
            _C.history_enable(device, 100_000)
        self.start = memory_counters(device).allocated
        _C.reset_peak_memory_stats(device)

    def allocated(self) -> int:
        return memory_counters(self.device).allocated

    def peak_above_start(self) -> int:
        return max(0, memory_counters(self.device).peak_allocated - self.start)

    def sites(self, n: int = 5) -> list[str]:
        from vramkit.report.sites import allocation_sites, format_bytes

        snapshot = _C.memory_snapshot(self.device)
        out = []
        for s in allocation_sites(snapshot)[:n]:
            if s.live_at_peak or s.total_bytes:
                out.append(f"  {format_bytes(s.live_at_peak):>12}  {s.label}")
        return out

    def close(self) -> None:
        if not self.was_recording:
            _C.history_enable(self.device, 0)


# ----------------------------------------------------------------------------- the call


def _pyfunc_body(pyfuncitem: Any) -> Callable[[], bool]:
    """One run of a plain test function with its fixture values; it raises if the test fails."""
    def run() -> bool:
        func = pyfuncitem.obj
        func(**{name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames})
        return False

    return run


def _runtest_body(item: Any, runtest: Callable[[], Any]) -> Callable[[], bool]:
    """One run of an item through its own runtest() (a unittest.TestCase method: setUp, the
    method, tearDown). unittest reports a failure to pytest's item instead of raising it
    (``item._excinfo``, which pytest reports after the call); the run returns True then, so the
    markers neither rerun nor judge a test that already failed."""
    def run() -> bool:
        runtest()
        return bool(getattr(item, "_excinfo", None))

    return run


def run_marked(item: Any, runtest: Callable[[], Any] | None = None) -> Any:
    """Run a test marked vram_limit and/or vram_no_leak: a plain test function (the plugin's
    pytest_pyfunc_call), or, given its original `runtest`, any other item (a TestCase method)."""
    limit = item.get_closest_marker("vram_limit")
    leak = item.get_closest_marker("vram_no_leak")
    body = _pyfunc_body(item) if runtest is None else _runtest_body(item, runtest)
    if leak is not None:
        _run_no_leak(body, leak, limit)
    else:
        _run_limited(body, limit)
    return True


def _numpy_option(marker: Any) -> bool:
    value = marker.kwargs.get("numpy", True)
    if not isinstance(value, bool):
        raise pytest.UsageError(f"@pytest.mark.{marker.name}: numpy must be True or False, got {value!r} (True counts "
                                "NumPy arrays in vramkit's cpu pool during the test; False leaves NumPy's allocator)")
    return value


@contextlib.contextmanager
def _counting_numpy(device: str, enabled: bool) -> Iterator[None]:
    """NumPy arrays are allocated by vramkit's cpu pool during the block (so a cpu limit counts
    them) unless disabled or measuring another device; the handler the test had before is
    restored afterwards, whether or not it was vramkit's (the fixture's install() survives)."""
    if not enabled or device != "cpu":
        yield
        return
    from vramkit import numpy as vramkit_numpy

    with vramkit_numpy.caching():
        yield


def _watchers(device: str) -> tuple[_PoolWatch, Any, Any]:
    pool = _PoolWatch(device)
    meter, mode = None, None
    if "torch" in sys.modules:
        from vramkit.torch.meters import SiteMeter, _MeterMode

        meter = SiteMeter(device.split(":")[0])
        mode = _MeterMode(meter)
    return pool, meter, mode


def _run_limited(body: Callable[[], bool], marker: Any) -> None:
    if not marker.args:
        raise pytest.UsageError("@pytest.mark.vram_limit needs a limit, e.g. vram_limit('512 MiB')")
    try:
        limit = _size(marker.args[0], "vram_limit")
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.vram_limit: {exc}") from None
    device = _device(marker)
    count_numpy = _numpy_option(marker)
    pool, meter, mode = _watchers(device)
    try:
        with _counting_numpy(device, count_numpy), (mode if mode is not None else contextlib.nullcontext()):
            if body():
                return  # the test failed on its own: that failure is the report
        pool_peak = pool.peak_above_start()
        problems = []
        if pool_peak > limit:
            problems.append(f"vramkit's {device} pool peaked at {format_size(pool_peak)} allocated above the "
                            f"{format_size(pool.start)} it started with; top allocation sites, by bytes live at the peak:\n"
                            + "\n".join(pool.sites()))
        if meter is not None and meter.peak > limit:
            problems.append(f"torch tensors on {device.split(':')[0]} peaked at {format_size(meter.peak)} of live storages; "
                            f"top allocation sites at the peak:\n" + "\n".join(_top(meter.at_peak)))
        if problems:
            pytest.fail(f"vram_limit({format_size(limit)}, device={device!r}) exceeded:\n" + "\n".join(problems),
                        pytrace=False)
    finally:
        pool.close()


def _run_no_leak(body: Callable[[], bool], marker: Any, limit_marker: Any) -> None:
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
    count_numpy = _numpy_option(marker)
    pool, meter, mode = _watchers(device)
    pool_after: list[int] = []
    torch_after: list[int] = []
    try:
        for i in range(warmup + runs):
            with _counting_numpy(device, count_numpy), (mode if mode is not None else contextlib.nullcontext()):
                if body():
                    return  # a run failed on its own: no more runs, and that failure is the report
            gc.collect()
            if i >= warmup:
                pool_after.append(pool.allocated())
                torch_after.append(meter.current if meter is not None else 0)
        problems = []
        for what, values in ((f"vramkit's {device} pool (allocated)", pool_after),
                             (f"torch tensors on {device.split(':')[0]} (live storages)", torch_after)):
            steps = [b - a for a, b in zip(values, values[1:])]
            if steps and all(d > tolerance for d in steps):
                trail = " -> ".join(format_size(v) for v in values)
                sites = pool.sites() if "pool" in what else _top(meter.live_by_site)
                problems.append(f"{what} grew on every one of {runs} runs after {warmup} warm-up runs, by "
                                f"{format_size(sum(steps) / len(steps))} per run on average: {trail}\n"
                                f"  allocations still live, by site:\n" + "\n".join(sites))
        if problems:
            pytest.fail(f"vram_no_leak(device={device!r}) failed:\n" + "\n".join(problems), pytrace=False)
    finally:
        pool.close()
    if limit_marker is not None:
        _run_limited(body, limit_marker)


# ----------------------------------------------------------------------------- fixture

_sim_lock = threading.Lock()


def make_sim(request: Any) -> str:
    """The vram_sim fixture: a fresh simulated device ("sim:N"), 8 GiB or @pytest.mark.vram_sim(capacity)."""
    from vramkit import sim

    marker = request.node.get_closest_marker("vram_sim")
    capacity = marker.args[0] if marker is not None and marker.args else "8 GiB"
    try:
        nbytes = _size(capacity, "vram_sim capacity")
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"@pytest.mark.vram_sim: {exc}") from None
    with _sim_lock:
        return sim.create(nbytes)
