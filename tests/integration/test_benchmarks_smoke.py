"""Smoke test of the benchmark suite: `benchmarks/report.py --quick` runs end to end.

It checks that every benchmark produces figures (positive and finite) and that the
correctness checks inside the benchmarks pass (NumPy gives equal results with and without
vramkit's handler, and the handler really was used). It makes NO timing or ratio assertions:
speed and memory targets are reported by benchmarks/report.py and recorded in
docs/benchmarks.md, never asserted in tests.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(REPO, "benchmarks", "report.py")
AMP_BENCH = os.path.join(REPO, "benchmarks", "amp.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    source = os.path.join(REPO, "python")
    if glob.glob(os.path.join(source, "vramkit", "_C*.so")):  # built in place: use the source tree
        env["PYTHONPATH"] = source + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def quick_report() -> dict:
    if not os.path.exists(REPORT):
        pytest.skip("benchmarks/ is not part of this installation")
    proc = subprocess.run([sys.executable, REPORT, "--quick", "--json"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"report.py --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


def test_every_benchmark_reports_rows(quick_report):
    names = [row["benchmark"] for row in quick_report["rows"]]
    for prefix in ("alloc:", "numpy:", "numpy pressure:", "fragmentation:", "amp:"):
        assert any(n.startswith(prefix) for n in names), f"no {prefix} rows in {names}"
    assert quick_report["quick"] is True
    assert quick_report["machine"]["cpu"]


def test_every_figure_is_positive_and_finite(quick_report):
    for row in quick_report["rows"]:
        for key in ("vramkit", "peer", "ratio"):
            value = row[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (row["benchmark"], key, value)
        assert row["met"] in (True, False, None)
        assert row["target"]


def test_numpy_results_equal_with_and_without_vramkit(quick_report):
    numpy_rows = [row for row in quick_report["rows"] if row["benchmark"].startswith("numpy:")]
    assert numpy_rows
    for row in numpy_rows:
        assert row["checks"]["results_equal"] is True, row
        assert row["checks"]["vramkit_pool_used"] is True, row


def test_all_correctness_checks_pass(quick_report):
    failed = [(row["benchmark"], k) for row in quick_report["rows"] for k, ok in row["checks"].items() if not ok]
    assert not failed


def test_markdown_table_renders():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        from _common import Row, format_table
    finally:
        sys.path.pop(0)
    row = Row("x: y", 1.0, "1 ns", "peer", 2.0, "2 ns", 2.0, "2.00x faster", "<= 1 ns", True)
    table = format_table([row], markdown=True).splitlines()
    assert table[0].startswith("| benchmark |") and table[1].startswith("|---")
    assert "2.00x faster" in table[2] and "yes" in table[2]


# ---- benchmarks/amp.py: the fused loss-scaling kernels ----------------------------------------

AMP_CHECKS = {"results_equal": True, "inf_nan_found": True, "norm_matches": True}


def test_amp_rows_in_report_verified(quick_report):
    amp_rows = [row for row in quick_report["rows"] if row["benchmark"].startswith("amp:")]
    assert amp_rows
    for row in amp_rows:
        assert row["checks"] == AMP_CHECKS, row["benchmark"]


def test_amp_benchmark_quick_prints_expected_rows():
    """benchmarks/amp.py --quick alone: exit 0 (it asserts vramkit == NumPy == torch bit for bit
    before timing, so a mismatch is a traceback and a non-zero exit) and every expected row."""
    if not os.path.exists(AMP_BENCH):
        pytest.skip("benchmarks/ is not part of this installation")
    proc = subprocess.run([sys.executable, AMP_BENCH, "--quick"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"amp.py --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    expected = []
    for dtype in ("fp32", "fp16"):
        expected += [f"amp: unscale_ {dtype} vs copy", f"amp: unscale_ {dtype} vs NumPy",
                     f"amp: unscale_and_norm_ {dtype} vs NumPy", f"amp: unscale_ {dtype}, 1 thread, "]
    if importlib.util.find_spec("torch") is not None:
        expected += ["amp: unscale_ fp32 vs torch", "amp: unscale_and_norm_ fp16 vs torch",
                     "amp: unscale_ bf16 vs copy", "amp: unscale_ bf16 vs torch"]
    for name in expected:
        assert name in out, f"no row {name!r} in:\n{out}"
    assert "GB/s" in out and "FAILED CHECKS" not in out


def test_amp_benchmark_refuses_to_time_a_wrong_result(monkeypatch):
    """The pre-timing check has teeth: one flipped bit in vramkit's output makes verify() raise."""
    if not os.path.exists(AMP_BENCH):
        pytest.skip("benchmarks/ is not part of this installation")
    import numpy as np

    saved_path = list(sys.path)
    try:  # a private module name: benchmarks/amp.py must not shadow anything called "amp"
        spec = importlib.util.spec_from_file_location("_vramkit_bench_amp", AMP_BENCH)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path[:] = saved_path
    arrays = bench.make_grads(bench.tensor_sizes(20_000, 20), np.dtype(np.float16))
    checks, rel = bench.verify("fp16", arrays, None)
    assert checks == AMP_CHECKS and rel <= 1e-5

    real = bench.amp.unscale_

    def one_bit_off(grads, inv):
        found = real(grads, inv)
        grads[-1].view(np.uint16)[0] ^= 1
        return found

    monkeypatch.setattr(bench.amp, "unscale_", one_bit_off)
    with pytest.raises(AssertionError, match="vramkit != NumPy"):
        bench.verify("fp16", arrays, None)


def _run_quick(script: str) -> str:
    """Run benchmarks/SCRIPT --quick as a user would; its stdout (it must exit 0)."""
    bench = os.path.join(REPO, "benchmarks", script)
    if not os.path.exists(bench):
        pytest.skip("benchmarks/ is not part of this installation")
    proc = subprocess.run([sys.executable, bench, "--quick"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, f"{script} --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "FAILED CHECKS" not in proc.stdout, proc.stdout
    return proc.stdout


def test_trace_replay_benchmark_quick():
    """benchmarks/trace_replay.py --quick: its own check (the Python loop's reserved bytes equal
    the C replay's) passes and it prints its three rows. No speed assertions."""
    out = _run_quick("trace_replay.py")
    for name in ("trace_replay: C loop, 200k events, no outputs", "trace_replay: C loop, 200k events, 3 output columns",
                 "the peer's events"):
        assert name in out, out


def test_snapshot_import_benchmark_quick():
    """benchmarks/snapshot_import.py --quick: its checks (events, allocations, attribution, the
    recorded peak) pass and it prints its four rows. No speed assertions: the linearity the
    import's test used to time is this benchmark's to report."""
    out = _run_quick("snapshot_import.py")
    for stacks in ("shared stacks", "own stacks"):
        for what in ("per entry", "against unpickling"):
            assert f"snapshot_import: 30k entries, {stacks}, {what}" in out, out


def test_predict_benchmark_quick():
    """benchmarks/predict.py --quick: captures the 1.42B example on meta and checks the
    capture's parameter bytes; no speed assertions."""
    pytest.importorskip("torch")
    assert "predict: gpt_fit.py (1.42B), batch 8" in _run_quick("predict.py")


def test_gpu_alloc_benchmark_dry_run_on_a_simulated_device():
    """benchmarks/gpu/alloc.py without a GPU: its vramkit sides on a sim device (the peers need a
    GPU and say 'not available'); the table has every row and positive figures."""
    bench = os.path.join(REPO, "benchmarks", "gpu", "alloc.py")
    if not os.path.exists(bench):
        pytest.skip("benchmarks/ is not part of this installation")
    proc = subprocess.run([sys.executable, bench, "--device", "sim", "--quick"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and " ns |" in line and not line.startswith("| case")]
    assert [r[0].lstrip("| ") for r in rows] == ["C pair, realistic mix"] + ["Python pair, realistic mix"] * 3
    assert all(float(r[1].split()[0]) > 0 for r in rows)


def test_gpu_fit_boundary_dry_run_and_its_verdicts():
    """benchmarks/gpu/fit_boundary.py without a GPU: fit's half on the H100-80GB profile limited
    to 6 GiB (two models), each with a largest batch; and the table and exit rule the GPU run
    uses, on made-up results (fit's answer that does not run, or below 97 % of the real one,
    fails the run)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    bench = os.path.join(REPO, "benchmarks", "gpu", "fit_boundary.py")
    if not os.path.exists(bench):
        pytest.skip("benchmarks/ is not part of this installation")
    proc = subprocess.run([sys.executable, bench, "--dry-run", "--quick"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "(" in line
            and not line.startswith("| model")]
    assert len(rows) == 2 and all(int(r[3]) > 0 for r in rows)
    spec = importlib.util.spec_from_file_location("fit_boundary", bench)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    made_up = [{"case": "a", "cap_gib": 6.0, "real_largest": 40, "fit_largest": 39, "fit_runs": True, "real_s": 1.0,
                "fit_s": 2.0},
               {"case": "b", "cap_gib": 6.0, "real_largest": 40, "fit_largest": 41, "fit_runs": False, "real_s": 1.0,
                "fit_s": 2.0}]
    lines = mod.table(made_up)
    assert "| a | 6 | 40 | 39 | 0.975 | yes |" in lines[2] and "| NO |" in lines[3]
    assert mod.failed(made_up) == ["b"]
    assert mod.failed([dict(made_up[0], fit_largest=38)]) == ["a"]  # 0.95 of the real largest


def test_gpu_benchmarks_run_each_case_in_a_child(tmp_path):
    """benchmarks/gpu/children.py, which predict_vs_gpu, sharded_gpu and fit_boundary share: a
    case's last stdout line is its result; a child that fails is named with its error."""
    gpu_dir = os.path.join(REPO, "benchmarks", "gpu")
    if not os.path.exists(os.path.join(gpu_dir, "children.py")):
        pytest.skip("benchmarks/ is not part of this installation")
    sys.path.insert(0, gpu_dir)
    try:
        import children
    finally:
        sys.path.remove(gpu_dir)
    script = tmp_path / "case.py"
    script.write_text("import json, sys\ncase = sys.argv[2]\nif case == 'bad':\n    raise SystemExit('no GPU here')\n"
                      "print('noise')\nprint(json.dumps({'case': case, 'extra': sys.argv[3:]}))\n")
    results = children.run_children(str(script), ["good", "bad"], ["--out", "x"], timeout=60)
    assert results[0] == {"case": "good", "extra": ["--out", "x"]}
    assert results[1]["case"] == "bad" and "no GPU here" in results[1]["error"]


# ---- benchmarks/amp_host.py: loss scaling's host cost against torch's (issue 35) ----------------


def test_amp_host_benchmark_checks_bits_and_times_both_sides():
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("_vramkit_bench_amp_host",
                                                  os.path.join(REPO, "benchmarks", "amp_host.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for strided in (False, True):
        bench.check_bits(20, torch.float16, strided, "cpu")  # raises SystemExit on any difference from torch
        mine, theirs = bench.per_call(20, torch.bfloat16, strided, "cpu", reps=10)
        assert mine > 0 and theirs > 0
    mine, theirs = bench.mlp_step_times(3, "cpu", reps=4)
    assert mine > 0 and theirs > 0


# ---- benchmarks/torch_glue.py and loop_costs.py: vramkit in the training loop (issue 35) -----------


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"_vramkit_bench_{name}", os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_glue_measures_three_layers_and_leaves_the_route_on_the_real_devices():
    import vramkit
    from vramkit.torch.allocator import hooks

    r = _bench("torch_glue").measure("sim", 200, 2)
    assert 0 < r["direct"] and 0 < r["hooks"] and 0 < r["hooks_and_bookkeeping"]
    assert r["device"].startswith("sim:")
    # the bench routes cuda:0 to the simulated device for its loops only; afterwards a request
    # for cuda:0 goes to the real devices again (none here: it fails, naming CUDA)
    lib = hooks()
    import ctypes

    out = ctypes.c_void_p()
    status = lib.vram_torch_malloc(64, 0, None, ctypes.byref(out))
    assert status != 0 and b"cuda" in lib.vram_last_error().lower()
    assert vramkit.memory_allocated(r["device"]) == 0  # every pair freed what it took
    with pytest.raises(ValueError, match="simulated device"):
        from vramkit import _C

        _C.bench_torch_glue_pairs("cpu", bytes(8), 1)


def test_loop_costs_prints_one_row_per_target():
    pytest.importorskip("torch")
    bench = _bench("loop_costs")
    rows = bench.glue_rows(quick=True)
    assert [r["part"] for r in rows] == ["3 allocator", "3 allocator"]
    assert rows[0]["cost"] > 0 and rows[0]["met"] in (True, False) and rows[1]["met"] is None
    assert bench.gpu_rows(quick=True) == []  # no GPU here: no GPU rows, and no failure either


def test_view_benchmark_quick():
    """benchmarks/view_open.py --quick: a generated snapshot opened, summarized, zoomed at the
    server (and in Chromium when it is installed); it prints its rows. No speed assertions."""
    out = _run_quick("view_open.py")
    for name in ("read the file whole (s)", "open after the summary (s)", "server: zoom/pan, max (ms)",
                 "server: allocation under cursor, max (ms)"):
        assert name in out, out


def test_view_benchmark_data_is_a_snapshot_vramkit_and_python_read_alike(tmp_path):
    """The generator writes opcodes itself: Python's unpickler and vramkit's importer must read
    it as the snapshot it claims to be, and the viewer's C reader as the importer does."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        from view_data import write_snapshot
    finally:
        sys.path.pop(0)
    from vramkit._core.plain_pickle import loads_plain
    from vramkit.trace.formats.snapshot_import import from_torch_snapshot
    from vramkit.view import load_history

    path = str(tmp_path / "s.pickle")
    facts = write_snapshot(path, 5000, seed=3)
    snap = loads_plain(open(path, "rb").read())
    entries = snap["device_traces"][0]
    assert len(entries) == facts["entries"] and {e["action"] for e in entries} == {"alloc", "free_requested",
                                                                                    "free_completed"}
    assert all(isinstance(e["frames"], list) and e["frames"] for e in entries)
    trace = from_torch_snapshot(path)
    hist = load_history(path, cache=False)
    assert len(trace.kind) == facts["memory_events"] == hist.events
    assert hist.ev_id.tolist() == trace.id.tolist()
