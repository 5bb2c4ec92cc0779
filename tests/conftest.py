"""Shared test setup.

Tests import the installed vramkit; when the extension has been built in place
(`python setup.py build_ext --inplace`), the source tree's python/ directory is used instead,
unless VRAMKIT_TEST_INSTALLED=1 (CI's sanitizer run sets it to test its own build).
After every test the cpu and default pools are returned to a clean state and their
invariants are checked, so a test that corrupts the allocator fails where it happened.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_PACKAGE = os.path.join(REPO, "python")
if (os.environ.get("VRAMKIT_TEST_INSTALLED") != "1" and glob.glob(os.path.join(SOURCE_PACKAGE, "vramkit", "_C*.so"))
        and SOURCE_PACKAGE not in sys.path):
    sys.path.insert(0, SOURCE_PACKAGE)

# The allocator model in tests/stress is shared with the CUDA tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stress"))

pytest_plugins = ["pytester"]

import vramkit  # noqa: E402


def pytest_report_header(config):
    return f"vramkit {vramkit.__version__} from {os.path.dirname(vramkit.__file__)} (CUDA compiled: " \
           f"{vramkit._C.CUDA_COMPILED}, CUDA devices: {vramkit.device_count('cuda')})"


def pytest_collection_modifyitems(config, items):
    if vramkit.is_available("cuda"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_pools():
    """Leave the shared pools as each test found them, and prove they are still consistent."""
    default = vramkit.current_device()
    yield
    try:
        import vramkit.numpy as vnp

        while vnp.is_installed():
            vnp.uninstall()
    except ImportError:
        pass
    for device in {"cpu", default}:
        vramkit.record_memory_history(False, device=device)
        vramkit.set_memory_limit(None, device=device)
        vramkit.set_per_process_memory_fraction(1.0, device=device)
        vramkit.synchronize(device)
        vramkit.pool_check(device)
        vramkit.empty_cache(device)
    vramkit.set_device(default)


@pytest.fixture
def sim():
    """A fresh 8 GiB simulated device for one test."""
    return vramkit.sim.create(8 << 30)


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread: tiny matmuls on a busy 2-core machine are ~20x slower with two."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons that must import the same vramkit as the tests."""
    env = dict(os.environ)
    if SOURCE_PACKAGE in sys.path:
        env["PYTHONPATH"] = SOURCE_PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def hang_guard():
    """``hang_guard(limit_s, fn, *args, **kwargs)``: fn's return value (or its exception), fn
    having run on a daemon thread; the test fails if fn has not returned after ``limit_s``
    seconds, and the failure shows where fn was stuck. A hang guard, not a speed check: the
    limit is one that only a hang (or quadratic blow-up) reaches, sanitizer builds included.
    Speed targets live in benchmarks/, never in tests. A thread, not SIGALRM: it also cuts off
    a wait inside C++ code that releases the GIL (a store's wait, a socket), where a Python
    signal handler would not run until the wait ended."""
    import threading
    import traceback

    def run(limit_s: float, fn, *args, **kwargs):
        box: dict = {}

        def target() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # re-raised in the test's thread, for pytest.raises
                box["error"] = exc

        name = getattr(fn, "__name__", repr(fn))
        thread = threading.Thread(target=target, name=f"hang guard: {name}", daemon=True)
        thread.start()
        thread.join(limit_s)
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident)
            stack = traceback.extract_stack(frame) if frame is not None else []
            inner = [i for i, f in enumerate(stack) if f.filename == __file__ and f.name == "target"]
            stack = stack[inner[-1] + 1:] if inner else stack
            where = "".join(traceback.format_list(stack)) if stack else f"  in {name} itself (not Python code)\n"
            pytest.fail(f"hang guard: {name} has not returned after {limit_s} s (a hang, or something "
                        f"pathological); it is still running at:\n{where}", pytrace=False)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    return run
