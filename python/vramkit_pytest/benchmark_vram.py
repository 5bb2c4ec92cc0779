"""Memory beside time in pytest-benchmark: the ``vram`` fixture of vramkit's pytest plugin.

The plugin pytest loads (this package's ``__init__``, ``vramkit_pytest``) defines the fixture
and imports this module only when a test uses it::

    def test_sort(benchmark, vram):
        benchmark(np.sort, data)       # extra_info gets vram_peak_allocated, vram_peak_reserved

    @pytest.mark.vram_benchmark(device="cuda:0")
    def test_matmul(benchmark, vram): ...

The fixture wraps the test's ``benchmark`` fixture (``benchmark(...)``, ``benchmark.pedantic``
and ``benchmark.weave`` alike): the device's cache is emptied and its peak counters reset before
pytest-benchmark's first call, and read after its last, so every call it makes is covered and
none of its timed calls carries a hook. What lands in ``benchmark.extra_info`` (bytes):

* ``vram_device``; ``vram_peak_allocated`` and ``vram_peak_reserved``: vramkit's pool on the
  device, the most above the level at the start;
* ``torch_peak_allocated`` (and on CUDA ``torch_peak_reserved``), where torch is imported: on
  CUDA torch's own counters; on cpu the live storage bytes of the ``vramkit.torch`` meter.

NumPy arrays and torch tensors on cpu have no counters that cost nothing per call (NumPy's
allocator keeps none; the torch meter is a dispatch mode around every operation), so they are
measured in ONE extra, untimed call made before pytest-benchmark's own (after them, its last
call's result would still be alive beside it): with vramkit's NumPy handler installed and the
meter on. The timed calls run with the allocator the test chose. A
test that already installed vramkit's handler needs no extra call for NumPy: its arrays come
from the pool in every timed call. ``numpy=False`` / ``torch=False`` on the marker leave these
out (and the extra call with them).

``benchmark.pedantic(setup=...)``: what the setup allocates is the input, not the benchmarked
function's memory, so each round is measured above the level after its setup. (pytest-benchmark
keeps a round's result until the next round's call returns: that memory really is held, and
counts.)

pytest-benchmark's table has a fixed set of columns (``--benchmark-columns`` accepts only its
own names), so at the end of the session the plugin prints a second table, memory beside the
timings, for the benchmarks that used the fixture; ``--benchmark-json`` and saved runs carry
the figures in each benchmark's ``extra_info``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import pytest

from vramkit import _C
from vramkit._core.errors import VramkitError
from vramkit._core.sizes import format_size
from vramkit.memory import api

__all__ = ["VramBenchmark", "make_vram", "terminal_summary"]

MARKER = "vram_benchmark"
_OPTIONS = ("device", "numpy", "torch")


# ----------------------------------------------------------------------------- devices


def _usage(message: str) -> pytest.UsageError:
    return pytest.UsageError(f"@pytest.mark.{MARKER} / vram fixture: {message}")


@dataclass(frozen=True)
class _Target:
    """What is measured for one device: vramkit's pool on it and/or torch's CUDA counters."""

    device: str
    pool: bool
    torch_cuda_index: int | None


def _torch_cuda_index(device: str) -> int | None:
    """The CUDA index of `device` when torch is imported and sees that GPU; torch is never
    imported here (a test that did not import it made no tensors)."""
    torch = sys.modules.get("torch")
    if torch is None or not device.startswith("cuda:"):
        return None
    digits = device.split(":")[1].split("/")[0]
    if not digits.isdigit():
        return None
    index = int(digits)
    return index if torch.cuda.is_available() and index < torch.cuda.device_count() else None


def _target(device: Any) -> _Target:
    if isinstance(device, bool) or device is None:
        raise _usage(f"bad device {device!r}: use 'cpu', 'cuda:N' or 'sim:N' (the vram_sim fixture's device)")
    try:
        canonical = _C.canonical_device(device)
    except (TypeError, ValueError) as exc:
        raise _usage(f"bad device {device!r}: {exc}") from None
    except VramkitError as exc:
        # vramkit built without CUDA (or not seeing this GPU) can still report torch's counters
        name = f"cuda:{device}" if isinstance(device, int) else str(device)
        if _torch_cuda_index(name) is not None:
            return _Target(name, False, _torch_cuda_index(name))
        raise _usage(f"device {device!r} is not available: {exc}") from None
    return _Target(canonical, True, _torch_cuda_index(canonical))


def _device_type(device: str) -> str:
    return device.split(":")[0].split("/")[0]


# ----------------------------------------------------------------------------- counters


class _Counters(Protocol):
    """One source of allocated / reserved bytes with a resettable peak."""

    def empty_cache(self) -> None: ...
    def current(self) -> tuple[int, int]: ...       # (allocated, reserved)
    def peaks(self) -> tuple[int, int]: ...         # (max allocated, max reserved) since reset
    def reset_peak(self) -> None: ...


class _PoolCounters:
    def __init__(self, device: str) -> None:
        self.device = device

    def empty_cache(self) -> None:
        api.empty_cache(self.device)

    def current(self) -> tuple[int, int]:
        counters = api.memory_counters(self.device)
        return counters.allocated, counters.reserved

    def peaks(self) -> tuple[int, int]:
        counters = api.memory_counters(self.device)
        return counters.peak_allocated, counters.peak_reserved

    def reset_peak(self) -> None:
        api.reset_peak_memory_stats(self.device)


class _TorchCudaCounters:
    """torch.cuda's counters for one GPU. Until torch initializes CUDA nothing is allocated and
    every counter is 0; they are not touched then, since touching them would initialize CUDA."""

    def __init__(self, index: int) -> None:
        self.cuda, self.index = sys.modules["torch"].cuda, index

    def _live(self) -> bool:
        return bool(self.cuda.is_initialized())

    def empty_cache(self) -> None:
        if self._live():
            self.cuda.empty_cache()

    def current(self) -> tuple[int, int]:
        if not self._live():
            return 0, 0
        return int(self.cuda.memory_allocated(self.index)), int(self.cuda.memory_reserved(self.index))

    def peaks(self) -> tuple[int, int]:
        if not self._live():
            return 0, 0
        return int(self.cuda.max_memory_allocated(self.index)), int(self.cuda.max_memory_reserved(self.index))

    def reset_peak(self) -> None:
        if self._live():
            self.cuda.reset_peak_memory_stats(self.index)


class _Window:
    """The peak of one counter source above a base level. ``restart`` sets the base to the
    current level; ``fold`` takes the peak since then into the result. Rounds of
    ``benchmark.pedantic(setup=...)`` restart after each setup, so its inputs stay out."""

    def __init__(self, counters: _Counters) -> None:
        self.counters = counters
        self.allocated = self.reserved = 0
        counters.empty_cache()  # cached segments left by earlier tests would hide this one's
        self.restart()

    def restart(self) -> None:
        self.base = self.counters.current()
        self.counters.reset_peak()

    def fold(self) -> None:
        peak_allocated, peak_reserved = self.counters.peaks()
        self.allocated = max(self.allocated, peak_allocated - self.base[0])
        self.reserved = max(self.reserved, peak_reserved - self.base[1])


def _torch_cuda_usable(index: int) -> bool:
    """torch.cuda's statistics raise where another allocator is torch's (vramkit's own, through
    CUDAPluggableAllocator); vramkit's pool then has the figures."""
    try:
        _TorchCudaCounters(index).current()
    except RuntimeError:
        return False
    return True


# ----------------------------------------------------------------------------- the fixture


def _bool_option(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _usage(f"{name} must be True or False, got {value!r}")
    return value


def _marker_options(item: Any) -> dict[str, Any]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return {}
    unknown = sorted(set(marker.kwargs) - set(_OPTIONS))
    if unknown:
        raise _usage(f"unknown argument(s) {', '.join(unknown)}; the arguments are device='cpu' (a vramkit "
                     "device: 'cpu', 'cuda:N', 'sim:N'), numpy=True and torch=True")
    if len(marker.args) > 1 or (marker.args and "device" in marker.kwargs):
        raise _usage(f"takes one device, given positionally or as device=..., got args {marker.args!r} "
                     f"and kwargs {marker.kwargs!r}")
    options = dict(marker.kwargs)
    if marker.args:
        options["device"] = marker.args[0]
    return options


def _check_markers(item: Any, device: str) -> None:
    """vram_limit and vram_no_leak read the same peak counters, which the fixture resets."""
    for name in ("vram_limit", "vram_no_leak"):
        marker = item.get_closest_marker(name)
        if marker is None:
            continue
        try:
            same = _C.canonical_device(marker.kwargs.get("device", "cpu")) == device
        except (TypeError, ValueError, RuntimeError):
            same = False  # the marker reports its own bad device
        if same:
            raise _usage(f"cannot measure {device} in a test marked {name} on the same device: both use its peak "
                         "counters, which the fixture resets for the benchmark; put the limit on a test of its own")


class VramBenchmark:
    """The ``vram`` fixture's value. Set ``device`` before calling ``benchmark`` to measure a
    device only known at run time (``vram.device = vram_sim``); after the call, ``peaks`` holds
    what was added to ``benchmark.extra_info``."""

    def __init__(self, item: Any, bench: Any, device: Any = "cpu", numpy: bool = True, torch: bool = True) -> None:
        self._item, self._bench = item, bench
        self.numpy = _bool_option("numpy", numpy)
        self.torch = _bool_option("torch", torch)
        self.device = device
        self.peaks: dict[str, Any] = {}

    @property
    def device(self) -> str:
        return self._target.device

    @device.setter
    def device(self, value: Any) -> None:
        self._target = _target(value)

    def __repr__(self) -> str:
        return f"VramBenchmark(device={self.device!r}, numpy={self.numpy}, torch={self.torch}, peaks={self.peaks})"

    # --- measurement

    def _windows(self) -> dict[str, _Window]:
        _check_markers(self._item, self.device)
        if self._extra_call_sources()[1]:
            _warm_torch_meter()
        windows = {}
        if self._target.pool:
            windows["vram"] = _Window(_PoolCounters(self.device))
        index = self._target.torch_cuda_index
        if self.torch and index is not None and _torch_cuda_usable(index):
            windows["torch"] = _Window(_TorchCudaCounters(index))
        return windows

    def _extra_call_sources(self) -> tuple[bool, bool]:
        """(NumPy, torch): what the extra untimed call is for; neither, no extra call."""
        if _device_type(self.device) != "cpu":
            return False, False
        numpy = self.numpy and "numpy" in sys.modules
        if numpy:
            from vramkit.numpy import is_installed

            numpy = not is_installed()  # the timed calls counted the arrays already
        return numpy, self.torch and "torch" in sys.modules

    @contextlib.contextmanager
    def _extra_call(self, numpy: bool, torch: bool) -> Iterator[list[int]]:
        """Around the one untimed call: vramkit's NumPy handler and the torch meter. Yields a
        list that holds the meter's peak afterwards."""
        torch_peak: list[int] = []
        with contextlib.ExitStack() as stack:
            if numpy:
                from vramkit.numpy import caching

                stack.enter_context(caching())
            meter = None
            if torch:
                from vramkit.torch.meters import SiteMeter, track

                meter = stack.enter_context(track(SiteMeter("cpu")))
            yield torch_peak
        if meter is not None:
            torch_peak.append(meter.peak)

    def _measure(self, run: Callable[[], Any], prepare_again: Callable[[], Callable[[], Any]],
                 windows: dict[str, _Window]) -> Any:
        """Where NumPy arrays or torch tensors are measured, first one call of the function
        (`prepare_again` runs a pedantic setup and returns the call) under vramkit's NumPy handler
        and the torch meter; then pytest-benchmark's `run`; record the peaks of both. The extra
        call comes first because pytest-benchmark keeps its last call's result, which would be
        alive beside the extra call's own."""
        numpy, torch = self._extra_call_sources()
        torch_peak: list[int] = []
        if numpy or torch:
            again = prepare_again()  # outside the handler and the meter: the inputs are not the function's
            with self._extra_call(numpy, torch) as torch_peak:
                try:
                    again()
                except BaseException as exc:
                    if sys.version_info >= (3, 11):
                        exc.add_note("(raised in the vram fixture's extra untimed call, made to measure NumPy arrays "
                                     "and torch tensors; @pytest.mark.vram_benchmark(numpy=False, torch=False) "
                                     "leaves it out)")
                    raise
            del again  # a pedantic setup's inputs go before the timed rounds
        result = run()
        for window in windows.values():
            window.fold()
        self._record(windows, torch_peak[0] if torch_peak else None)
        return result

    def _record(self, windows: dict[str, _Window], torch_cpu_peak: int | None) -> None:
        peaks: dict[str, Any] = {"vram_device": self.device}
        if "vram" in windows:
            peaks["vram_peak_allocated"] = windows["vram"].allocated
            peaks["vram_peak_reserved"] = windows["vram"].reserved
        if "torch" in windows:
            peaks["torch_peak_allocated"] = windows["torch"].allocated
            peaks["torch_peak_reserved"] = windows["torch"].reserved
        elif torch_cpu_peak is not None:
            peaks["torch_peak_allocated"] = torch_cpu_peak
        self.peaks = peaks
        self._bench.extra_info.update(peaks)  # the same dict pytest-benchmark writes to its JSON and tables read

    # --- pytest-benchmark's two entry points, wrapped on this test's fixture instance

    def _raw(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def raw(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if self._bench.disabled:  # --benchmark-disable: one plain call, no figures to go with
                return original(function, *args, **kwargs)
            windows = self._windows()
            return self._measure(lambda: original(function, *args, **kwargs),
                                 lambda: lambda: function(*args, **kwargs), windows)

        return raw

    def _raw_pedantic(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def raw_pedantic(target: Callable[..., Any], **options: Any) -> Any:
            if self._bench.disabled:
                return original(target, **options)
            windows = self._windows()
            setup, teardown = options.get("setup"), options.get("teardown")
            if setup is not None:
                options["setup"] = _measured_setup(setup, windows)

            def prepare_again() -> Callable[[], None]:
                args, kwargs = options.get("args") or (), options.get("kwargs") or {}
                if options.get("setup") is not None:
                    made = options["setup"]()  # pytest-benchmark's rule: a setup may return (args, kwargs)
                    if made:
                        args, kwargs = made

                def again() -> None:
                    target(*args, **kwargs)
                    if teardown is not None:
                        teardown(*args, **kwargs)

                return again

            return self._measure(lambda: original(target, **options), prepare_again, windows)

        return raw_pedantic


_torch_meter_warm = False


def _warm_torch_meter() -> None:
    """torch's first operation under a dispatch mode imports modules (sympy among them) that
    build NumPy arrays; once, before any window opens, so no benchmark is charged for them."""
    global _torch_meter_warm
    if _torch_meter_warm:
        return
    import torch

    from vramkit.torch.meters import LiveMeter, track

    with track(LiveMeter()):
        torch.empty(1)
    _torch_meter_warm = True


def _measured_setup(setup: Callable[[], Any], windows: dict[str, _Window]) -> Callable[[], Any]:
    """The round's peak so far is kept before the setup runs; the base moves past its inputs after."""
    def measured() -> Any:
        for window in windows.values():
            window.fold()
        made = setup()
        for window in windows.values():
            window.restart()
        return made

    return measured


def _check_benchmark_fixture(bench: Any) -> None:
    if not all(hasattr(bench, name) for name in ("_raw", "_raw_pedantic", "extra_info", "disabled")):
        raise _usage(f"the benchmark fixture here is {type(bench).__module__}.{type(bench).__qualname__}, not "
                     "pytest-benchmark's BenchmarkFixture, whose _raw and _raw_pedantic the vram fixture wraps")


def make_vram(request: Any, bench: Any) -> Iterator[VramBenchmark]:
    """The vram fixture: wrap this test's pytest-benchmark fixture for the test's duration."""
    _check_benchmark_fixture(bench)
    vram = VramBenchmark(request.node, bench, **_marker_options(request.node))
    bench._raw = vram._raw(bench._raw)
    bench._raw_pedantic = vram._raw_pedantic(bench._raw_pedantic)
    try:
        yield vram
    finally:  # the instance attributes go; the class's methods show through again
        del bench._raw, bench._raw_pedantic


# ----------------------------------------------------------------------------- the table


def _rows(session: Any) -> list[tuple[Any, str, dict[str, Any]]]:
    """(group, name, flat benchmark) for this run's benchmarks that used the fixture, in the
    groups and order of pytest-benchmark's own table (its grouping hook, --benchmark-sort and
    --benchmark-name already applied). Rows of saved runs (--benchmark-compare) are left out:
    pytest-benchmark gives them this run's extra_info, not theirs."""
    rows = []
    for group, benchmarks in getattr(session, "groups", None) or ():
        for bench in sorted(benchmarks, key=lambda b: b[session.sort]):
            if bench.get("path") is None and "vram_device" in (bench.get("extra_info") or {}):
                rows.append((group, str(session.name_format(bench)), bench))
    return rows


def _time(seconds: float) -> str:
    """A time in the unit pytest-benchmark would pick for it (each row its own: groups differ)."""
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if seconds >= 1 / scale:
            return f"{seconds * scale:,.2f} {unit}"
    return f"{seconds * 1e9:,.2f} ns"


def _size_cell(peaks: dict[str, Any], key: str) -> str:
    return format_size(peaks[key]) if key in peaks else "-"


def _table(rows: list[tuple[Any, str, dict[str, Any]]]) -> list[list[str]]:
    """The header and one row of cells per benchmark; a group's name in a row of its own."""
    with_torch = any("torch_peak_allocated" in bench["extra_info"] for _, _, bench in rows)
    table = [["Name", "Min", "Mean", "Device", "Peak allocated", "Peak reserved"]
             + (["torch peak alloc", "torch peak resv"] if with_torch else [])]
    groups = {group for group, _, _ in rows}
    previous: Any = object()
    for group, name, bench in rows:
        if group != previous and len(groups) > 1:
            table.append([f"[{group or 'no group'}]"])
        previous = group
        peaks = bench["extra_info"]
        cells = [name, _time(bench["min"]), _time(bench["mean"]), str(peaks["vram_device"]),
                 _size_cell(peaks, "vram_peak_allocated"), _size_cell(peaks, "vram_peak_reserved")]
        if with_torch:
            cells += [_size_cell(peaks, "torch_peak_allocated"), _size_cell(peaks, "torch_peak_reserved")]
        table.append(cells)
    return table


def _lines(rows: list[tuple[Any, str, dict[str, Any]]]) -> list[str]:
    table = _table(rows)
    widths = [max(len(line[i]) for line in table if len(line) > i) for i in range(len(table[0]))]
    return ["   ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            if len(line) > 1 else line[0] for line in table]


def terminal_summary(reporter: Any) -> None:
    """Memory beside time for the benchmarks that used the vram fixture, printed after
    pytest-benchmark's own table (its columns are fixed: --benchmark-columns accepts only its
    own names). Nothing under --benchmark-quiet, --benchmark-disable, or without such benchmarks."""
    session = getattr(reporter.config, "_benchmarksession", None)
    if session is None or getattr(session, "quiet", False):
        return
    rows = _rows(session)
    if not rows:
        return
    lines = _lines(rows)
    reporter.ensure_newline()
    reporter.write_line("")
    reporter.write_line(" vram: peak memory per benchmark ".center(len(lines[0]), "-"), yellow=True)
    reporter.write_line(lines[0])
    reporter.write_line("-" * len(lines[0]), yellow=True)
    for line in lines[1:]:
        reporter.write_line(line)
    reporter.write_line("-" * len(lines[0]), yellow=True)
    reporter.write_line("Peaks: the most above the level at each benchmark's start (its device's cache emptied first), "
                        "over every call pytest-benchmark made; on cpu NumPy arrays and torch tensors from one extra "
                        "untimed call. Bytes in --benchmark-json's extra_info.")
