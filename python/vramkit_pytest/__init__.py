"""The pytest plugin of vramkit, loaded by pytest through the ``pytest11`` entry point "vramkit".

It registers the markers ``vram_limit``, ``vram_no_leak``, ``vram_sim`` and ``vram_benchmark`` and the
fixtures ``vram_sim`` and ``vram``; the work is in this package's ``markers`` and ``benchmark_vram``
(see their docstrings), imported only when a marked test runs or a fixture is used, so that
loading the plugin does not import vramkit. The plugin is a package of its own beside vramkit,
not inside it, because importing any module of vramkit runs vramkit's ``__init__`` first (the
extension module, the allocator's facade): all three files live here, and only this one is
loaded with every pytest session.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import pytest

_MARKERS = (
    "vram_limit(limit, device='cpu', numpy=True): fail if the test's peak allocated memory on the device exceeds "
    "limit (bytes or a size like '512 MiB'); vramkit's pool and torch tensors are each checked, and on 'cpu' NumPy "
    "arrays count (vramkit's NumPy handler is installed for the test; numpy=False leaves NumPy's own)",
    "vram_no_leak(runs=5, warmup=2, tolerance=0, device='cpu', numpy=True): run the test body warmup + runs times "
    "and fail if memory grows on every measured run (a unittest.TestCase method reruns with setUp and tearDown)",
    "vram_sim(capacity='8 GiB'): the capacity of the vram_sim fixture's simulated device",
    "vram_benchmark(device='cpu', numpy=True, torch=True): what the vram fixture measures beside pytest-benchmark's "
    "timings (peak allocated and reserved into benchmark.extra_info); on 'cpu' NumPy arrays and torch tensors are "
    "measured in one extra untimed call (numpy=False, torch=False leave them out)",
)
_BENCHMARK_IMPL = f"{__name__}.benchmark_vram"
_BENCHMARK_NOT_ACTIVE = ("the vram fixture puts memory beside pytest-benchmark's timings, but pytest-benchmark is not "
                         "active here (not installed, or disabled with -p no:benchmark): pip install pytest-benchmark, "
                         "or deselect the tests that use vram")


def pytest_configure(config: Any) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def _marked(item: Any) -> bool:
    return item.get_closest_marker("vram_limit") is not None or item.get_closest_marker("vram_no_leak") is not None


def _runs_through_pyfunc_call(item: Any) -> bool:
    """Whether pytest calls the test through pytest_pyfunc_call: plain test functions do;
    unittest.TestCase methods (pytest's TestCaseFunction runs them through unittest) and other
    plugins' items with a runtest of their own do not."""
    return isinstance(item, pytest.Function) and type(item).runtest is pytest.Function.runtest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Any:
    if not _marked(pyfuncitem) or not _runs_through_pyfunc_call(pyfuncitem):
        return None
    import inspect

    if inspect.iscoroutinefunction(pyfuncitem.obj) or inspect.isasyncgenfunction(pyfuncitem.obj):
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: vram_limit / vram_no_leak cannot measure an async test "
                                "(its body runs in the event loop of an async plugin, not in this call)")
    from .markers import run_marked

    return run_marked(pyfuncitem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """Marked items that do not run through pytest_pyfunc_call (unittest.TestCase methods) are
    measured by wrapping their runtest() for the call phase: the markers never pass silently."""
    if not _marked(item) or _runs_through_pyfunc_call(item):
        yield
        return
    from .markers import run_marked

    original = item.runtest
    item.runtest = lambda: run_marked(item, original)
    try:
        yield
    finally:
        del item.runtest  # the instance attribute; the class's runtest shows through again


@pytest.fixture
def vram_sim(request: Any) -> str:
    """A fresh simulated device ("sim:N") for this test: 8 GiB, or @pytest.mark.vram_sim("24 GiB")."""
    from .markers import make_sim

    return make_sim(request)


@pytest.fixture
def vram(request: Any, benchmark: Any) -> Iterator[Any]:
    """Memory beside time: wraps this test's pytest-benchmark ``benchmark`` so that the benchmarked
    function's peak allocated and reserved bytes land in ``benchmark.extra_info`` (device 'cpu',
    or @pytest.mark.vram_benchmark(device=...), or ``vram.device = ...`` before the call)."""
    from .benchmark_vram import make_vram

    yield from make_vram(request, benchmark)


def _benchmark_plugin_active(config: Any) -> bool:
    return any(getattr(plugin, "__name__", None) == "pytest_benchmark.plugin"
               for plugin in config.pluginmanager.get_plugins())


def _uses_our_vram(item: Any) -> bool:
    """Whether the test's fixture "vram" is this plugin's (not a conftest's of the same name)."""
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("vram")
    if not definitions:
        return False
    return getattr(definitions[-1].func, "__module__", None) == __name__


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    """Without pytest-benchmark a test using vram fails at setup with a message that says so,
    whichever of ``benchmark`` and ``vram`` it names first (pytest would otherwise say only that
    a fixture 'benchmark' is not found, for a test that may not name it)."""
    if _uses_our_vram(item) and not _benchmark_plugin_active(item.config):
        pytest.fail(_BENCHMARK_NOT_ACTIVE, pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Memory beside time, after pytest-benchmark's table. The module is imported only by a test
    that used the vram fixture, so a session without one imports nothing here."""
    module = sys.modules.get(_BENCHMARK_IMPL)
    if module is not None:
        module.terminal_summary(terminalreporter)
