"""The ``vram`` fixture of vramkit's pytest plugin with the real pytest-benchmark
(python/vramkit_pytest/: __init__.py, benchmark_vram.py): pytest sessions run through pytest's
pytester, their ``--benchmark-json`` read back, the figures compared with ones known without the
fixture (the pool's documented rounding, or the same function measured directly)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pytest_benchmark")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

# pytester runs pytest in this process and afterwards drops the modules imported since it was
# set up; torch cannot be imported twice in one process, so everything the inner runs import is
# imported here, at collection.
try:
    import torch
    import vramkit.torch.meters  # noqa: F401
except ImportError:
    torch = None
import numpy as np  # noqa: E402
import pytest_benchmark.plugin  # noqa: E402,F401
import vramkit  # noqa: E402
import vramkit.numpy as vnp  # noqa: E402
import vramkit.report.sites  # noqa: E402,F401
import vramkit._core.sizes  # noqa: E402,F401

sys.path.insert(0, os.path.join(REPO, "tests", "unit"))
from test_pytest_plugin import plugin_under_test  # noqa: E402  (the source tree's plugin, entry point blocked)

FAST = ("--benchmark-max-time=0.002", "--benchmark-min-rounds=2", "--benchmark-warmup=off")


@pytest.fixture
def run(pytester, pytestconfig):
    """Run pytest on a test file with the plugin and pytest-benchmark; returns (result, JSON
    benchmarks by test name; None when no JSON was asked for or written)."""
    args, plugins = plugin_under_test(pytestconfig)

    # The JSON's machine and commit description (py-cpuinfo, git) takes seconds and is not
    # what these tests are about; the figures come from pytest-benchmark as usual.
    pytester.makeconftest("""
        import pytest

        @pytest.hookimpl(optionalhook=True)  # optional: some runs disable pytest-benchmark
        def pytest_benchmark_generate_machine_info(config):
            return {"node": "pytester"}

        @pytest.hookimpl(optionalhook=True)
        def pytest_benchmark_generate_commit_info(config):
            return {}
    """)

    def go(source: str, *extra: str, json_out: bool = True):
        pytester.makepyfile(test_sample=textwrap.dedent(source))
        out = pytester.path / "bench.json"
        options = [*FAST, f"--benchmark-json={out}"] if json_out else []
        # hypothesis's plugin imports hypothesis at the end of each inner run (a second apiece)
        result = pytester.runpytest(*args, "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *options, *extra,
                                    plugins=plugins)
        benchmarks = None
        if out.exists() and out.stat().st_size:  # pytest-benchmark leaves it empty when nothing ran
            benchmarks = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
        return result, benchmarks

    return go


def rounded(nbytes: int) -> int:
    """docs/architecture.md, Policy: requests round up to 512 B."""
    return -(-nbytes // 512) * 512


def direct_peak(function, *, numpy: bool = False) -> tuple[int, int]:
    """The function's peak allocated and reserved on the cpu pool, one call measured by hand."""
    vramkit.empty_cache("cpu")
    base = vramkit.memory_allocated("cpu"), vramkit.memory_reserved("cpu")
    vramkit.reset_peak_memory_stats("cpu")
    if numpy:
        with vnp.caching():
            function()
    else:
        function()
    return vramkit.max_memory_allocated("cpu") - base[0], vramkit.max_memory_reserved("cpu") - base[1]


# ---------------------------------------------------------------------------- vramkit's pool


def test_raw_alloc_peaks_are_the_pool_rounding(run):
    """A large-pool request (3 MiB + 1000 B: a 20 MiB segment below 10 MiB), a small one (1000 B:
    a 2 MiB segment) and nothing; the JSON's extra_info and vram.peaks agree."""
    result, benchmarks = run("""
        import vramkit

        def alloc(n):
            vramkit.raw_free(vramkit.raw_alloc(n, "cpu"))

        def test_large(benchmark, vram):
            benchmark(alloc, 3 * 2**20 + 1000)
            assert vram.peaks == benchmark.extra_info

        def test_small(benchmark, vram):
            benchmark(alloc, 1000)

        def test_nothing(benchmark, vram):
            benchmark(lambda: None)
    """)
    result.assert_outcomes(passed=3)
    large, small, nothing = (benchmarks[n]["extra_info"] for n in ("test_large", "test_small", "test_nothing"))
    assert large["vram_device"] == "cpu"
    assert (large["vram_peak_allocated"], large["vram_peak_reserved"]) == (rounded(3 * MiB + 1000), 20 * MiB)
    assert (small["vram_peak_allocated"], small["vram_peak_reserved"]) == (rounded(1000), 2 * MiB)
    assert (nothing["vram_peak_allocated"], nothing["vram_peak_reserved"]) == (0, 0)


def test_peak_is_over_every_round(run):
    """A function that keeps one more 1 MiB buffer each call: the peak is the last call's total,
    so it covers all of pytest-benchmark's calls (the test counts them)."""
    result, benchmarks = run("""
        import vramkit
        kept = []

        def test_grows(benchmark, vram):
            benchmark(lambda: kept.append(vramkit.empty(2**20, device="cpu")))
            benchmark.extra_info["calls"] = len(kept)
            kept.clear()
    """)
    result.assert_outcomes(passed=1)
    info = benchmarks["test_grows"]["extra_info"]
    assert info["calls"] >= 3
    assert info["vram_peak_allocated"] == info["calls"] * MiB


def test_pedantic_setup_inputs_are_not_counted(run):
    """benchmark.pedantic(setup=...): each round measured above the level after its setup (an
    8 MiB input), so only the target's 1 MiB counts."""
    result, benchmarks = run("""
        import vramkit

        def setup():
            return (vramkit.empty(8 * 2**20, device="cpu"),), {}

        def target(data):
            scratch = vramkit.empty(2**20, device="cpu")

        def test_rounds(benchmark, vram):
            benchmark.pedantic(target, setup=setup, rounds=4, warmup_rounds=1)
    """)
    result.assert_outcomes(passed=1)
    assert benchmarks["test_rounds"]["extra_info"]["vram_peak_allocated"] == MiB


def test_sim_device_set_at_run_time(run):
    result, benchmarks = run("""
        import vramkit

        def test_on_sim(benchmark, vram, vram_sim):
            vram.device = vram_sim
            benchmark(lambda: vramkit.raw_free(vramkit.raw_alloc(5 * 2**20, vram_sim)))
            assert vram.peaks["vram_device"] == vram_sim
    """)
    result.assert_outcomes(passed=1)
    info = benchmarks["test_on_sim"]["extra_info"]
    assert info["vram_device"].startswith("sim:")
    assert (info["vram_peak_allocated"], info["vram_peak_reserved"]) == (5 * MiB, 20 * MiB)


# ---------------------------------------------------------------------------- NumPy and torch


NUMPY_TESTS = """
    import numpy as np, pytest
    import vramkit.numpy as vnp

    handlers = []

    def make():
        handlers.append(vnp.is_installed())
        return np.ones(2**19)          # 4 MiB of float64

    def test_default_allocator(benchmark, vram):
        handlers.clear()
        benchmark(make)
        # the extra call (the first) used vramkit's handler; every timed call NumPy's allocator
        assert handlers.count(True) == 1 and handlers[0] and len(handlers) > 2, handlers

    @pytest.mark.vram_benchmark(numpy=False)
    def test_not_counted(benchmark, vram):
        handlers.clear()
        benchmark(make)
        assert not any(handlers), handlers

    def test_handler_installed_by_the_test(benchmark, vram):
        handlers.clear()
        with vnp.caching():
            benchmark(make)
        assert all(handlers), handlers   # every call counted, the timed ones too
"""


def test_numpy_arrays_measured_in_one_extra_call(run):
    result, benchmarks = run(NUMPY_TESTS)
    result.assert_outcomes(passed=3)
    expected = direct_peak(lambda: np.ones(2**19), numpy=True)
    assert expected[0] >= 4 * MiB
    for name in ("test_default_allocator", "test_handler_installed_by_the_test"):
        info = benchmarks[name]["extra_info"]
        assert (info["vram_peak_allocated"], info["vram_peak_reserved"]) == expected, name
    off = benchmarks["test_not_counted"]["extra_info"]
    assert (off["vram_peak_allocated"], off["vram_peak_reserved"]) == (0, 0)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_cpu_tensors(run):
    """torch on cpu: the vramkit.torch meter in the extra call counts the storage's bytes; the
    timed calls run without it (the test checks the dispatch mode was off in all but one)."""
    result, benchmarks = run("""
        import torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        modes = []

        def make():
            modes.append(_get_current_dispatch_mode() is not None)
            return torch.empty(3 * 2**20 + 7, dtype=torch.uint8)

        def test_tensor(benchmark, vram):
            benchmark(make)
            assert modes.count(True) == 1 and modes[0], modes

        def test_no_tensor(benchmark, vram):
            benchmark(lambda: None)
    """)
    result.assert_outcomes(passed=2)
    info = benchmarks["test_tensor"]["extra_info"]
    assert info["torch_peak_allocated"] == 3 * MiB + 7
    assert info["vram_peak_allocated"] == 0     # torch's tensors are not vramkit's
    assert benchmarks["test_no_tensor"]["extra_info"]["torch_peak_allocated"] == 0


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_cuda_counters_read_around_the_calls(run):
    """On cuda:N torch's own counters are read before and after (no GPU here: torch.cuda's
    counter functions are replaced by a model of them for the inner test; 1 MiB is live before
    the benchmark, each call holds 3 MiB in a 4 MiB reservation)."""
    result, benchmarks = run("""
        import pytest, torch

        class Cuda:
            allocated = reserved = peak_allocated = peak_reserved = 0

            def take(self, n, reserve):
                self.allocated += n
                self.reserved = max(self.reserved, self.allocated + reserve)
                self.peak_allocated = max(self.peak_allocated, self.allocated)
                self.peak_reserved = max(self.peak_reserved, self.reserved)

        cuda = Cuda()

        @pytest.fixture(autouse=True)
        def model_of_torch_cuda(monkeypatch):
            for name, value in {
                "is_available": lambda: True, "device_count": lambda: 1, "is_initialized": lambda: True,
                "memory_allocated": lambda i: cuda.allocated, "memory_reserved": lambda i: cuda.reserved,
                "max_memory_allocated": lambda i: cuda.peak_allocated,
                "max_memory_reserved": lambda i: cuda.peak_reserved,
                "empty_cache": lambda: setattr(cuda, "reserved", cuda.allocated),
                "reset_peak_memory_stats": lambda i: (setattr(cuda, "peak_allocated", cuda.allocated),
                                                      setattr(cuda, "peak_reserved", cuda.reserved)),
            }.items():
                monkeypatch.setattr(torch.cuda, name, value)
            cuda.take(2**20, 2**20)  # live before the benchmark, and 1 MiB cached

        def step():
            cuda.take(3 * 2**20, 2**20)
            cuda.take(-3 * 2**20, 0)

        @pytest.mark.vram_benchmark(device="cuda:0")
        def test_on_cuda(benchmark, vram):
            benchmark(step)
    """)
    result.assert_outcomes(passed=1)
    info = benchmarks["test_on_cuda"]["extra_info"]
    assert info["vram_device"] == "cuda:0"
    assert (info["torch_peak_allocated"], info["torch_peak_reserved"]) == (3 * MiB, 4 * MiB)
    assert info.get("vram_peak_allocated", 0) == 0  # vramkit's pool, where it has cuda:0, held nothing


# ---------------------------------------------------------------------------- table, modes, errors


def test_memory_table_after_pytest_benchmarks(run):
    result, _ = run("""
        import pytest, vramkit

        @pytest.mark.benchmark(group="g1")
        def test_three(benchmark, vram):
            benchmark(lambda: vramkit.raw_free(vramkit.raw_alloc(3 * 2**20, "cpu")))

        @pytest.mark.benchmark(group="g2")
        def test_nothing(benchmark, vram):
            benchmark(lambda: None)

        @pytest.mark.benchmark(group="g2")
        def test_plain_benchmark(benchmark):
            benchmark(lambda: None)
    """)
    result.assert_outcomes(passed=3)
    lines = result.outlines
    title = next(i for i, line in enumerate(lines) if "vram: peak memory per benchmark" in line)
    assert title > max(i for i, line in enumerate(lines) if line.startswith("test_plain_benchmark"))
    header = lines[title + 1].split()
    assert header[:4] == ["Name", "Min", "Mean", "Device"]
    row = re.split(r"\s{3,}", next(line for line in lines[title:] if line.startswith("test_three")))
    assert row[3:6] == ["cpu", "3.00 MiB", "20.00 MiB"]
    assert not any(line.startswith("test_plain_benchmark") for line in lines[title:])
    assert lines[title + 3:title + 7:2] == ["[g1]", "[g2]"]  # pytest-benchmark's groups, in its order
    nothing = re.split(r"\s{3,}", lines[title + 6])
    assert nothing[0] == "test_nothing" and nothing[3:6] == ["cpu", "0 B", "0 B"]


def test_no_table_without_vram_benchmarks(run):
    result, _ = run("""
        def test_plain(benchmark):
            benchmark(lambda: None)
    """)
    result.assert_outcomes(passed=1)
    assert "vram: peak memory" not in result.stdout.str()


def test_benchmark_disable_runs_once_without_figures(run):
    result, _ = run("""
        calls = []

        def test_once(benchmark, vram):
            benchmark(lambda: calls.append(1))
            assert calls == [1] and vram.peaks == {} and "vram_peak_allocated" not in benchmark.extra_info
    """, "--benchmark-disable", json_out=False)
    result.assert_outcomes(passed=1)
    assert "vram: peak memory" not in result.stdout.str()


@pytest.mark.parametrize("order", ["benchmark, vram", "vram, benchmark", "vram"])
def test_without_pytest_benchmark_an_error_at_setup(run, order):
    """-p no:benchmark: the test errors at setup with one message, whatever it names first."""
    result, _ = run(f"""
        def test_needs_benchmark({order}):
            pass

        def test_other():
            pass
    """, "-p", "no:benchmark", json_out=False)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([("*the vram fixture puts memory beside pytest-benchmark's timings, but pytest-benchmark "
                                  "is not active here (not installed, or disabled with -p no:benchmark)*")])


@pytest.mark.parametrize(("marker", "message"), [
    ("vram_benchmark(device='gpu')", "bad device 'gpu': unknown device 'gpu'"),
    ("vram_benchmark(devices='cpu')", "unknown argument(s) devices; the arguments are device='cpu'"),
    ("vram_benchmark(numpy='yes')", "numpy must be True or False, got 'yes'"),
    ("vram_benchmark(torch=1)", "torch must be True or False, got 1"),
    ("vram_benchmark('cpu', device='cpu')", "takes one device, given positionally or as device=..."),
    ("vram_benchmark(device='sim:999')", "sim:999 does not exist"),
    ("vram_limit('1 GiB')", "cannot measure cpu in a test marked vram_limit on the same device"),
])
def test_bad_input_names_what_is_wrong(run, marker, message):
    result, _ = run(f"""
        import pytest

        @pytest.mark.{marker}
        def test_marked(benchmark, vram):
            benchmark(lambda: None)
    """, json_out=False)
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*{message}*"])


# ---------------------------------------------------------------------------- benchmarks/ suite


def test_benchmark_suite_smoke(tmp_path):
    """benchmarks/test_bench_alloc_vram.py as a user runs it (its own pytest process), in a
    short mode: every benchmark has figures, and they are the ones its docstring explains."""
    suite = os.path.join(REPO, "benchmarks", "test_bench_alloc_vram.py")
    if not os.path.exists(suite):
        pytest.skip("benchmarks/ is not part of this installation")
    env = dict(os.environ)
    source = os.path.join(REPO, "python")
    if glob.glob(os.path.join(source, "vramkit", "_C*.so")):  # built in place: the source tree's plugin too
        env["PYTHONPATH"] = source + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", suite, "-p", "no:cacheprovider", *FAST,
                           f"--benchmark-json={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vram: peak memory per benchmark" in proc.stdout
    info = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    assert len(info) == 12
    for label, size in (("4KiB", 4096), ("1MiB", MiB), ("16MiB", 16 * MiB)):
        for how in ("raw", "numpy_default", "numpy_vramkit"):
            assert info[f"test_alloc_free_{how}[{label}]"]["vram_peak_allocated"] == size, (how, label)
    expression, named, in_place = (info[f"test_temporaries[{form}]"]["vram_peak_allocated"]
                                   for form in ("expression", "named", "in_place"))
    assert 8 * MiB <= expression < 9 * MiB and 24 * MiB <= named < 25 * MiB and in_place < MiB
