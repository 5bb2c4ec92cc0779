"""The pytest plugin of vramkit, loaded by pytest through the ``pytest11`` entry point "vramkit".

It registers the markers ``vram_limit``, ``vram_no_leak`` and ``vram_sim`` and the fixture
``vram_sim``; the work is in ``vramkit.survive.pytest_plugin`` (see its docstring), imported only when a
marked test runs or the fixture is used, so that loading the plugin does not import vramkit.
"""

from __future__ import annotations

from typing import Any

import pytest

_MARKERS = (
    "vram_limit(limit, device='cpu', numpy=True): fail if the test's peak allocated memory on the device exceeds "
    "limit (bytes or a size like '512 MiB'); vramkit's pool and torch tensors are each checked, and on 'cpu' NumPy "
    "arrays count (vramkit's NumPy handler is installed for the test; numpy=False leaves NumPy's own)",
    "vram_no_leak(runs=5, warmup=2, tolerance=0, device='cpu', numpy=True): run the test body warmup + runs times "
    "and fail if memory grows on every measured run (a unittest.TestCase method reruns with setUp and tearDown)",
    "vram_sim(capacity='8 GiB'): the capacity of the vram_sim fixture's simulated device",
)


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
    from vramkit.survive.pytest_plugin import run_marked

    return run_marked(pyfuncitem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """Marked items that do not run through pytest_pyfunc_call (unittest.TestCase methods) are
    measured by wrapping their runtest() for the call phase: the markers never pass silently."""
    if not _marked(item) or _runs_through_pyfunc_call(item):
        yield
        return
    from vramkit.survive.pytest_plugin import run_marked

    original = item.runtest
    item.runtest = lambda: run_marked(item, original)
    try:
        yield
    finally:
        del item.runtest  # the instance attribute; the class's runtest shows through again


@pytest.fixture
def vram_sim(request: Any) -> str:
    """A fresh simulated device ("sim:N") for this test: 8 GiB, or @pytest.mark.vram_sim("24 GiB")."""
    from vramkit.survive.pytest_plugin import make_sim

    return make_sim(request)
