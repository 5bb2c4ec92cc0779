"""The pytest plugin of vramkit, loaded by pytest through the ``pytest11`` entry point "vramkit".

It registers the markers ``vram_limit``, ``vram_no_leak`` and ``vram_sim`` and the fixture
``vram_sim``; the work is in ``vramkit.pytest_plugin`` (see its docstring), imported only when a
marked test runs or the fixture is used, so that loading the plugin does not import vramkit.
"""

from __future__ import annotations

from typing import Any

import pytest

_MARKERS = (
    "vram_limit(limit, device='cpu'): fail if the test's peak allocated memory on the device exceeds limit "
    "(bytes or a size like '512 MiB'); vramkit's pool and torch tensors are each checked",
    "vram_no_leak(runs=5, warmup=2, tolerance=0, device='cpu'): run the test body warmup + runs times and fail "
    "if memory grows on every measured run",
    "vram_sim(capacity='8 GiB'): the capacity of the vram_sim fixture's simulated device",
)


def pytest_configure(config: Any) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Any:
    if pyfuncitem.get_closest_marker("vram_limit") is None and pyfuncitem.get_closest_marker("vram_no_leak") is None:
        return None
    import inspect

    if inspect.iscoroutinefunction(pyfuncitem.obj) or inspect.isasyncgenfunction(pyfuncitem.obj):
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: vram_limit / vram_no_leak cannot measure an async test "
                                "(its body runs in the event loop of an async plugin, not in this call)")
    from vramkit.pytest_plugin import run_marked

    return run_marked(pyfuncitem)


@pytest.fixture
def vram_sim(request: Any) -> str:
    """A fresh simulated device ("sim:N") for this test: 8 GiB, or @pytest.mark.vram_sim("24 GiB")."""
    from vramkit.pytest_plugin import make_sim

    return make_sim(request)
