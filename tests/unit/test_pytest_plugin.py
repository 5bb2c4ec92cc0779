"""vramkit's pytest plugin (python/vramkit_pytest/: __init__.py, markers.py), run through pytest's own
pytester: passing and failing tests, and the failure messages."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pytester runs pytest in this process and afterwards drops the modules imported since it was
# set up; torch cannot be imported twice in one process, so it is imported here, at collection.
try:
    import torch  # noqa: F401
except ImportError:
    pass
import vramkit  # noqa: E402
import vramkit.numpy  # noqa: E402,F401  (likewise: the inner runs use them; keep one copy)
import vramkit.report.sites  # noqa: E402,F401
import vramkit._core.sizes  # noqa: E402,F401


def plugin_under_test(pytestconfig) -> tuple[list[str], list]:
    """pytest arguments and plugin objects that load the plugin of the vramkit under test.

    The pytest11 entry point loads the installed vramkit_pytest at start-up; when the tests run
    the source tree's vramkit (tests/conftest.py), an installed copy may be another version, so
    the source tree's vramkit_pytest package is loaded instead (under another name, its
    markers and benchmark_vram modules with it) and the entry point blocked."""
    import importlib.util

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(vramkit.__file__))), "vramkit_pytest")
    source = os.path.join(folder, "__init__.py")
    loaded = sys.modules.get("vramkit_pytest")
    if not os.path.exists(source) or (loaded is not None and os.path.abspath(loaded.__file__) == source):
        return ([] if pytestconfig.pluginmanager.has_plugin("vramkit") else ["-p", "vramkit_pytest"]), []
    name = "vramkit_pytest_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, source, submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return ["-p", "no:vramkit"], [sys.modules[name]]


@pytest.fixture
def run(pytester, pytestconfig):
    """Run pytest on a test file, with the plugin loaded as an installed vramkit would load it."""
    args, plugins = plugin_under_test(pytestconfig)

    def go(source: str, *extra: str):
        pytester.makepyfile(test_sample=textwrap.dedent(source))
        return pytester.runpytest(*args, "-p", "no:cacheprovider", *extra, plugins=plugins)

    return go


def line_of(source: str, text: str) -> int:
    """1-based line of `text` in the file pytester writes from `source`."""
    lines = textwrap.dedent(source).strip("\n").splitlines()  # pytester strips blank edge lines
    return next(i for i, line in enumerate(lines, 1) if text in line)


NUMPY_TESTS = """
    import numpy as np, pytest
    import vramkit.numpy as vnp

    @pytest.fixture(autouse=True)
    def handler():
        vnp.install()
        yield
        vnp.uninstall()

    @pytest.mark.vram_limit("64 MiB", device="cpu")
    def test_small():
        a = np.ones(1 << 20)              # 8 MiB

    @pytest.mark.vram_limit("64 MiB", device="cpu")
    def test_big():
        a = np.ones(1 << 24)              # 128 MiB
        b = a * 2                         # another 128 MiB

    CACHE = []

    @pytest.mark.vram_no_leak(runs=4, warmup=1)
    def test_leaky():
        CACHE.append(np.ones(1 << 18))    # 2 MiB kept per run

    MEMO = {}

    @pytest.mark.vram_no_leak(runs=4, warmup=2)
    def test_cache_that_plateaus():
        if len(MEMO) < 2:                  # fills during the warm-up, then stays
            MEMO[len(MEMO)] = np.ones(1 << 18)

    @pytest.mark.vram_no_leak(runs=3)
    def test_clean():
        x = np.ones(1 << 18)

    def teardown_module():
        CACHE.clear(), MEMO.clear()  # what the leaks kept goes back to the pool the outer tests share
"""


def test_numpy_limits_and_leaks(run):
    result = run(NUMPY_TESTS)
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    assert "vram_limit(64.00 MiB, device='cpu') exceeded" in out
    assert "vramkit's cpu pool peaked at 256.00 MiB allocated" in out
    assert f"128.0 MiB  test_sample.py:{line_of(NUMPY_TESTS, 'a = np.ones(1 << 24)')} in test_big" in out
    assert f"128.0 MiB  test_sample.py:{line_of(NUMPY_TESTS, 'b = a * 2')} in test_big" in out
    assert "grew on every one of 4 runs after 1 warm-up runs, by 2.00 MiB per run" in out
    assert "4.00 MiB -> 6.00 MiB -> 8.00 MiB -> 10.00 MiB" in out
    assert f"test_sample.py:{line_of(NUMPY_TESTS, 'CACHE.append')} in test_leaky" in out
    result.stdout.no_fnmatch_line("*test_cache_that_plateaus FAILED*")


TORCH_TESTS = """
    import pytest, torch

    def make(n):
        return torch.ones(n)

    @pytest.mark.vram_limit("1 MiB")
    def test_over():
        a = make(1 << 20)                 # 4 MiB
        b = a + 1

    @pytest.mark.vram_limit("16 MiB")
    def test_under():
        a = make(1 << 20)

    LOSSES = []

    @pytest.mark.vram_no_leak(runs=3)
    def test_total_loss_keeps_graphs():
        w = torch.ones(256, 256, requires_grad=True)
        loss = (torch.ones(64, 256) @ w).sum()
        LOSSES.append(loss)               # total_loss += loss: every graph stays alive

    @pytest.mark.vram_no_leak(runs=3)
    def test_item_is_clean():
        w = torch.ones(256, 256, requires_grad=True)
        LOSSES.append((torch.ones(64, 256) @ w).sum().item())
"""


def test_torch_limits_and_the_accumulated_loss(run):
    pytest.importorskip("torch")
    result = run(TORCH_TESTS)
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "torch tensors on cpu peaked at 8.00 MiB of live storages" in out
    assert f"4.00 MiB  test_sample.py:{line_of(TORCH_TESTS, 'return torch.ones(n)')} (make)" in out
    assert f"test_sample.py:{line_of(TORCH_TESTS, 'b = a + 1')} (test_over)" in out
    assert "torch tensors on cpu (live storages) grew on every one of 3 runs" in out
    assert f"test_sample.py:{line_of(TORCH_TESTS, 'loss = (torch.ones(64, 256) @ w)')} (test_total_loss_keeps_graphs)" in out


def test_vram_sim_fixture(run):
    result = run("""
        import pytest, vramkit

        def test_default(vram_sim):
            assert vram_sim.startswith("sim:") and vramkit.mem_get_info(vram_sim)[1] == 8 << 30

        @pytest.mark.vram_sim("24 GiB")
        def test_sized(vram_sim):
            assert vramkit.mem_get_info(vram_sim)[1] == 24 << 30

        def test_fresh(vram_sim):
            assert vramkit.memory_reserved(vram_sim) == 0
    """)
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("marker, message", [
    ("vram_limit()", "vram_limit needs a limit"),
    ("vram_limit('24 GB')", "ambiguous"),
    ("vram_limit('1 MiB', device='nowhere')", "bad device 'nowhere'"),
    ("vram_no_leak(runs=1)", "runs must be an integer >= 2"),
    ("vram_limit('1 MiB', numpy='yes')", "numpy must be True or False, got 'yes'"),
    ("vram_no_leak(numpy=None)", "numpy must be True or False, got None"),
])
def test_bad_markers_are_usage_errors(run, marker, message):
    result = run(f"""
        import pytest

        @pytest.mark.{marker}
        def test_x():
            pass
    """)
    assert result.ret != 0
    assert message in result.stdout.str() + result.stderr.str()


def test_entry_point_is_declared():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["entry-points"]["pytest11"] == {"vramkit": "vramkit_pytest"}
    assert "vramkit_pytest" in project["tool"]["setuptools"]["packages"]
    # Loading the plugin does not import vramkit (a checkout's conftest picks which one).
    import subprocess

    # The source tree's package (PYTHONPATH comes before an installed copy's finder).
    code = "import sys, vramkit_pytest; print(vramkit_pytest.__file__); print('vramkit' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    where, imported = out.stdout.split()
    assert where == os.path.join(REPO, "python", "vramkit_pytest", "__init__.py")
    assert imported == "False"


UNITTEST_TESTS = """
    import unittest
    import pytest
    import vramkit

    KEPT = []
    SETUPS = []

    class TestLimits(unittest.TestCase):
        @pytest.mark.vram_limit("16 MiB", device="cpu")
        def test_over(self):
            self.buffer = vramkit.empty(32 << 20, device="cpu")      # 32 MiB

        @pytest.mark.vram_limit("64 MiB", device="cpu")
        def test_under(self):
            buffer = vramkit.empty(8 << 20, device="cpu")            # 8 MiB

    class TestLeaks(unittest.TestCase):
        def setUp(self):
            SETUPS.append(self._testMethodName)

        @pytest.mark.vram_no_leak(runs=3, warmup=1)
        def test_leaky(self):
            KEPT.append(vramkit.empty(1 << 20, device="cpu"))        # 1 MiB kept per run

        @pytest.mark.vram_no_leak(runs=3, warmup=1)
        def test_clean(self):
            buffer = vramkit.empty(1 << 20, device="cpu")

        @pytest.mark.vram_no_leak(runs=3, warmup=1)
        def test_fails_on_its_second_run(self):
            self.assertLess(SETUPS.count("test_fails_on_its_second_run"), 2, "second run")

    def test_each_run_had_its_own_setup():
        assert SETUPS.count("test_leaky") == 4 and SETUPS.count("test_clean") == 4
        assert SETUPS.count("test_fails_on_its_second_run") == 2   # the failure stops the runs

    def teardown_module():
        KEPT.clear()  # what the leak kept goes back to the pool the outer tests share
"""


def test_markers_on_unittest_methods(run):
    """pytest runs TestCase methods without pytest_pyfunc_call; the markers measure them anyway."""
    result = run(UNITTEST_TESTS, "-v")
    result.assert_outcomes(passed=3, failed=3)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*TestLimits::test_over FAILED*", "*TestLimits::test_under PASSED*",  # by name
                                 "*TestLeaks::test_clean PASSED*", "*TestLeaks::test_fails_on_its_second_run FAILED*",
                                 "*TestLeaks::test_leaky FAILED*"])
    assert "vram_limit(16.00 MiB, device='cpu') exceeded" in out
    assert "vramkit's cpu pool peaked at 32.00 MiB allocated" in out
    assert f"test_sample.py:{line_of(UNITTEST_TESTS, 'self.buffer = vramkit.empty')} in test_over" in out
    assert "vramkit's cpu pool (allocated) grew on every one of 3 runs after 1 warm-up runs, by 1.00 MiB" in out
    assert f"test_sample.py:{line_of(UNITTEST_TESTS, 'KEPT.append')} in test_leaky" in out
    assert "AssertionError: 2 not less than 2 : second run" in out


NUMPY_WITHOUT_INSTALL = """
    import numpy as np, pytest
    import vramkit.numpy as vnp

    @pytest.mark.vram_limit("64 MiB")
    def test_big():
        a = np.ones(1 << 24)              # 128 MiB

    @pytest.mark.vram_limit("64 MiB")
    def test_small():
        a = np.ones(1 << 20)              # 8 MiB

    @pytest.mark.vram_limit("64 MiB", numpy=False)
    def test_opted_out():
        a = np.ones(1 << 24)              # not counted: the handler stays NumPy's

    KEPT = []

    @pytest.mark.vram_no_leak(runs=3, warmup=1)
    def test_leaky():
        KEPT.append(np.ones(1 << 18))     # 2 MiB kept per run

    def test_handler_is_only_installed_for_marked_tests():
        assert not vnp.is_installed()

    def teardown_module():
        KEPT.clear()  # what the leak kept goes back to the pool the outer tests share
"""


def test_numpy_arrays_count_without_install(run):
    result = run(NUMPY_WITHOUT_INSTALL, "-v")
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*test_big FAILED*", "*test_small PASSED*", "*test_opted_out PASSED*",
                                 "*test_leaky FAILED*"])
    assert "vramkit's cpu pool peaked at 128.00 MiB allocated" in out
    assert f"test_sample.py:{line_of(NUMPY_WITHOUT_INSTALL, 'a = np.ones(1 << 24)')} in test_big" in out
    assert "grew on every one of 3 runs after 1 warm-up runs, by 2.00 MiB per run" in out


def test_a_handler_installed_by_the_test_stays_installed(run):
    """The markers restore the handler the test had before it: a fixture's install() survives."""
    result = run("""
        import numpy as np, pytest
        import vramkit.numpy as vnp

        @pytest.fixture
        def handler():
            vnp.install()
            yield
            assert vnp.is_installed()
            vnp.uninstall()

        @pytest.mark.vram_limit("64 MiB")
        def test_installed(handler):
            a = np.ones(1 << 20)
            assert vnp.is_installed()
    """)
    result.assert_outcomes(passed=1)
