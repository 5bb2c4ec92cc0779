"""`python -m vramkit run` end to end, in a child Python, as a user would run it."""

from __future__ import annotations

import glob
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_PACKAGE = REPO / "python"


def run_vramkit(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m vramkit ARGS`; the source tree's vramkit when it is built in place, else the installed one."""
    env = dict(os.environ)
    if glob.glob(str(SOURCE_PACKAGE / "vramkit" / "_C*.so")):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_PACKAGE), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "vramkit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def load_snapshot(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def test_bundled_example(tmp_path):
    proc = run_vramkit("run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "vramkit memory summary, device cpu" in out
    assert "loss" in out  # the example's own output
    # The mixed-precision step: the scaler starts too high on purpose, so it backs off and skips steps.
    m = re.search(r"mixed precision: loss scale (\S+) -> (\S+), (\d+) of (\d+) steps skipped", out)
    assert m, out
    assert float(m.group(2)) < float(m.group(1)) and 0 < int(m.group(3)) < int(m.group(4))
    assert "Peak allocated:" in out and "Peak reserved:" in out
    assert "numpy_pipeline.py:" in out  # allocation sites point into the example
    check_checkpoint_part(out)
    assert "https://pytorch.org/memory_viz" in out
    snapshot_path, html_path = tmp_path / "vramkit-snapshot.pickle", tmp_path / "vramkit-timeline.html"
    assert str(snapshot_path) in out and str(html_path) in out
    snapshot = load_snapshot(snapshot_path)
    assert set(snapshot) >= {"segments", "device_traces"}
    trace = snapshot["device_traces"][0]
    assert len(trace) > 100 and {"alloc", "free_requested", "segment_alloc"} <= {e["action"] for e in trace}
    assert snapshot["segments"]
    page = html_path.read_text(encoding="utf-8")
    assert "<svg" in page and "numpy_pipeline.py" in page
    # the command it points at reads the snapshot it wrote, every allocation with its stack
    # (the snapshot of the device that held the most: torch's, when the example trains with torch)
    pointed = re.search(r"Explore a snapshot: vramkit view (\S+)", out)
    assert pointed and pointed.group(1) in out.split("Explore a snapshot")[0], out
    from vramkit.view import load_history

    history = load_history(snapshot_path, cache=False)
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert history.events >= len(allocs) and history.info()["peak_bytes"] > 0
    assert any("numpy_pipeline.py" in label for label in history.groupings["site"].labels)
    assert load_history(pointed.group(1), cache=False).events > 0


def check_checkpoint_part(out: str) -> None:
    """The example's second part: a torch MLP trained with a planned checkpoint schedule."""
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "activation checkpointing part skipped: PyTorch is not installed" in out
        return
    assert "activation checkpointing: 24 residual MLP blocks" in out, out
    assert re.search(r"plan \(profiled and planned in [0-9.]+ s\): Schedule\(optimal, 24 stages", out), out
    m = re.search(r"(\d+) stage forwards recomputed; predicted peak ([0-9.]+) MiB within a budget of ([0-9.]+) MiB",
                  out)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) <= float(m.group(3))
    m = re.search(r"store everything: activation peak ([0-9.]+) MiB", out)
    full = float(m.group(1))
    m = re.search(r"vramkit plan: +activation peak ([0-9.]+) MiB", out)
    assert float(m.group(1)) <= 0.3 * full * 1.02  # within the 30 % budget (the budget is the prediction's)
    m = re.search(r"measured peak ([0-9,]+) B vs predicted ([0-9,]+) B; largest loss difference from storing "
                  r"everything (\S+)", out)
    measured, predicted = (int(g.replace(",", "")) for g in m.groups()[:2])
    assert 0.9 * predicted <= measured <= predicted
    assert float(m.group(3)) < 1e-4  # the same training, only recomputed


BIG_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np

    def make_big():
        return np.ones(40_000_000 // 8)          # 40 MB

    def make_small(n):
        return [np.zeros(250_000) for _ in range(n)]   # 2 MB each

    print("argv:", sys.argv[1:])
    small = make_small(4)
    big = make_big()
    tmp = [np.arange(1000) * 2 for _ in range(10)]
    del big
    if "--fail" in sys.argv:
        raise RuntimeError("boom from the script")
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0)
""")


@pytest.fixture
def big_script(tmp_path) -> Path:
    path = tmp_path / "big.py"
    path.write_text(BIG_SCRIPT)
    return path


def test_custom_script_sites_and_argv(tmp_path, big_script):
    proc = run_vramkit("run", "--top", "3", "--html", "out/t.html", "--snapshot", "s.pickle",
                       str(big_script), "--flag", "x y", cwd=tmp_path)
    assert proc.returncode == 1  # the missing out/ directory cannot hold the page...
    assert "cannot write" in proc.stderr
    (tmp_path / "out").mkdir()
    proc = run_vramkit("run", "--top", "3", "--html", "out/t.html", "--snapshot", "s.pickle",
                       str(big_script), "--flag", "x y", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "argv: ['--flag', 'x y']" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("1 "))
    assert "big.py:6 in make_big" in lines[first]
    assert "40000000" not in lines[first] and "38.1 MiB" in lines[first]  # 40 MB live at the peak
    assert "big.py:9 in <listcomp>" in out  # make_small's arrays are the next site
    assert not any(line.lstrip().startswith("4 ") for line in lines[first:])  # --top 3
    snapshot = load_snapshot(tmp_path / "s.pickle")
    sizes = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert max(sizes) >= 40_000_000
    assert (tmp_path / "out" / "t.html").read_text(encoding="utf-8").count("make_big") >= 1


def test_failing_script_still_reports(tmp_path, big_script):
    proc = run_vramkit("run", str(big_script), "--fail", cwd=tmp_path)
    assert proc.returncode == 1
    assert "RuntimeError: boom from the script" in proc.stderr
    assert 'File "' + str(big_script) + '"' in proc.stderr
    assert "runpy" not in proc.stderr  # the traceback starts in the script, as with `python big.py`
    assert "vramkit memory summary, device cpu" in proc.stdout
    assert load_snapshot(tmp_path / "vramkit-snapshot.pickle")["device_traces"][0]
    assert (tmp_path / "vramkit-timeline.html").exists()


def test_exit_status_is_propagated(tmp_path, big_script):
    proc = run_vramkit("run", str(big_script), "--exit", "3", cwd=tmp_path)
    assert proc.returncode == 3
    assert "vramkit memory summary, device cpu" in proc.stdout
    assert (tmp_path / "vramkit-timeline.html").exists()


def test_missing_script_is_a_usage_error(tmp_path):
    proc = run_vramkit("run", "no_such_script.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no_such_script.py" in proc.stderr and "not found" in proc.stderr
    assert not (tmp_path / "vramkit-timeline.html").exists()
    proc = run_vramkit("run", "--top", "many", cwd=tmp_path)
    assert proc.returncode == 2 and "--top" in proc.stderr


def test_in_process_run_reports_other_devices_only_when_used(tmp_path, monkeypatch, capsys):
    """main() in this process, with two extra devices standing in for GPUs: one used, one idle."""
    import vramkit
    import vramkit.numpy
    from vramkit.commands import main as cli
    from vramkit.commands import run as run_command

    used, idle = vramkit.sim.create(1 << 30), vramkit.sim.create(1 << 30)
    monkeypatch.setattr(run_command, "_devices", lambda: ["cpu", used, idle])
    script = tmp_path / "gpu_like.py"
    script.write_text(textwrap.dedent("""
        import sys
        import vramkit

        def load_weights(device):
            return vramkit.empty(24 << 20, device=device)  # a Buffer: freed on its own device when dropped

        weights = load_weights(sys.argv[1])
        del weights
    """))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--top", "2", str(script), used]) == 0
    out = capsys.readouterr().out
    assert f"vramkit memory summary, device {used}" in out
    assert f"device {idle}" not in out
    assert "gpu_like.py:6 in load_weights" in out
    suffix = used.replace(":", "")
    assert (tmp_path / f"vramkit-timeline-{suffix}.html").exists()
    snapshot = load_snapshot(tmp_path / f"vramkit-snapshot-{suffix}.pickle")
    assert snapshot["vramkit_device"] == used
    assert not (tmp_path / f"vramkit-timeline-{idle.replace(':', '')}.html").exists()
    assert not vramkit.numpy.is_installed()  # the process is left as it was found


OOM_SCRIPT = textwrap.dedent("""\
    import numpy as np
    import vramkit
    vramkit.set_memory_limit(64 << 20, "cpu")
    keep = [np.ones(8 << 20, dtype=np.uint8) for _ in range(4)]
    try:
        np.ones(48 << 20, dtype=np.uint8)
    except MemoryError:
        print("caught")
    """)


def test_an_out_of_memory_under_run_writes_its_post_mortem(tmp_path):
    """On by default under vramkit run: the screen on stderr, a snapshot and a timeline in
    vramkit-oom/; --oom-dir '' turns it off."""
    (tmp_path / "oom.py").write_text(OOM_SCRIPT)
    proc = run_vramkit("run", "oom.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "caught" in proc.stdout
    assert "=== vramkit: out of memory on cpu ===" in proc.stderr
    assert "asked for 48.0 MiB" in proc.stderr and "oom.py:4 in <listcomp> (4 allocations)" in proc.stderr
    files = sorted(os.listdir(tmp_path / "vramkit-oom"))
    assert [f.rsplit(".", 1)[1] for f in files] == ["html", "pickle"], files
    snap = load_snapshot(tmp_path / "vramkit-oom" / files[1])
    assert any(e["action"] == "oom" and e["size"] == 48 << 20 for e in snap["device_traces"][0])
    off = tmp_path / "off"
    off.mkdir()
    (off / "oom.py").write_text(OOM_SCRIPT)
    proc = run_vramkit("run", "--oom-dir", "", "oom.py", cwd=off)
    assert proc.returncode == 0 and "caught" in proc.stdout
    assert "out of memory on cpu ===" not in proc.stderr and not (off / "vramkit-oom").exists()
