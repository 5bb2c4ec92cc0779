"""`vramkit run` under torchrun: one report per rank, the merged report on rank 0, `vramkit merge`,
and nothing lost when a rank fails.

Three real two-rank gloo jobs on the CPU (`python -m torch.distributed.run --nproc_per_node 2
-m vramkit run script.py`), each run once and shared by the tests that read it: one that
finishes, where rank 1 holds a known extra tensor; one where rank 1 raises while rank 0 sleeps,
so that torchrun's agent sends rank 0 SIGTERM; one where rank 1 is SIGKILLed while rank 0 waits
for its report. Expected peaks are worked out here from the tensors' shapes, not read from
vramkit. `vramkit merge` is then fed those real files, and every kind of malformed one.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SOURCE_PACKAGE = REPO / "python"
MiB = 1 << 20
SLACK = 64 << 10  # the tiny DDP model's parameters, gradients and buckets, and the input batch

DATA_MIB, EXTRA_MIB, STEP_MIB = 16, 8, 1
TRAIN = textwrap.dedent(f"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    MiB = 1 << 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.ones({DATA_MIB} * MiB // 4)                            # every rank, to the end
    extra = torch.ones({EXTRA_MIB} * MiB // 4) if rank == 1 else None  # rank 1 only, to the end
    w = torch.zeros({STEP_MIB} * MiB // 4)
    for step in range(2):
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        g = data[:{STEP_MIB} * MiB // 4] * 2   # the last step's g is freed only once this one is made
        dist.all_reduce(g)
        w.sub_(g)
    print(f"rank {{rank}}: done, w[0] = {{w[0].item()}}")
    dist.barrier()  # each rank's line printed before any rank's report starts
    dist.destroy_process_group()
""")
# Held at once at the peak, on rank 0: data, w, and two steps' g (the new one made before the old
# one is released); rank 1 holds its extra tensor on top of that the whole time.
PEAK_0 = (DATA_MIB + STEP_MIB + 2 * STEP_MIB) * MiB
PEAK_1 = PEAK_0 + EXTRA_MIB * MiB

RAISES = textwrap.dedent("""
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.ones(1 << 20)
    dist.barrier()
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    for _ in range(1200):
        time.sleep(0.1)   # rank 0 is here when torchrun stops it
""")

KILLED = textwrap.dedent("""
    import os, signal, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.ones(1 << 20)
    dist.barrier()
    if rank == 1:
        for _ in range(1200):   # until rank 0 has written its report and waits for this one's
            if os.path.exists("vramkit-rank0.json"):
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def line_of(text: str, marker: str) -> int:
    (line,) = [i for i, t in enumerate(text.splitlines(), 1) if marker in t]
    return line


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    if glob.glob(str(SOURCE_PACKAGE / "vramkit" / "_C*.so")):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_PACKAGE), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"  # torchrun's banner otherwise, and 2 cores shared by 2 ranks
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors, measured by the live-tensor meter, on any machine
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


class Job:
    """A finished torchrun job: its directory, output and the ranks' summaries (None: not written)."""

    def __init__(self, cwd: Path, proc: subprocess.CompletedProcess[str], script: str) -> None:
        self.cwd, self.proc, self.script = cwd, proc, script
        self.out, self.err = proc.stdout, proc.stderr

    def summary(self, rank: int) -> dict | None:
        path = self.cwd / f"vramkit-rank{rank}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None

    def torch_device(self, rank: int) -> dict:
        summary = self.summary(rank)
        assert summary is not None, self.out + self.err
        (device,) = [d for d in summary["devices"] if d["heading"] == "PyTorch tensors, live-tensor meter"]
        return device

    def merged(self) -> str:
        """Rank 0's merged report, as printed."""
        start = self.out.index("=== all ranks:")
        return self.out[start:self.out.index("Merge the reports again", start)]


def torchrun(tmp: Path, script: str, *run_args: str) -> Job:
    (tmp / "script.py").write_text(script)
    # --standalone: torchrun's rendezvous store, and the store the ranks share, bind port 0 and keep
    # the socket (a port found free and closed beforehand can be taken by another process meanwhile).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vramkit", "run", *run_args, "script.py"]
    proc = subprocess.run(cmd, cwd=tmp, env=child_env(), capture_output=True, text=True, timeout=180, check=False)
    return Job(tmp, proc, script)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Job:
    return torchrun(tmp_path_factory.mktemp("finished"), TRAIN, "--top", "3")


@pytest.fixture(scope="module")
def raised(tmp_path_factory) -> Job:
    return torchrun(tmp_path_factory.mktemp("raised"), RAISES)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Job:
    return torchrun(tmp_path_factory.mktemp("killed"), KILLED, "--wait-ranks", "120")


# --------------------------------------------------------------------------- a job that finishes

def test_every_rank_writes_its_own_files(finished):
    job = finished
    assert job.proc.returncode == 0, job.out + job.err
    for rank in (0, 1):
        for name in (f"vramkit-rank{rank}.json", f"vramkit-snapshot-rank{rank}.pickle",
                     f"vramkit-timeline-rank{rank}.html", f"vramkit-snapshot-rank{rank}-torch-cpu.pickle",
                     f"vramkit-timeline-rank{rank}-torch-cpu.html"):
            assert (job.cwd / name).is_file(), name
    assert not (job.cwd / "vramkit-snapshot.pickle").exists() and not (job.cwd / "vramkit.json").exists()
    assert not list(job.cwd.glob(".*.tmp"))  # every file written whole, through a rename
    summary = job.summary(1)
    assert summary["format"] == "vramkit-rank-report" and summary["version"] == 1
    assert (summary["rank"], summary["world_size"], summary["local_rank"]) == (1, 2, 1)
    assert summary["exit_status"] == 0 and summary["ended"]["how"] == "finished"
    assert summary["script"] == str(job.cwd / "script.py") and summary["host"] == socket.gethostname()
    assert summary["wall_time_s"] > 0 and summary["pid"] != job.summary(0)["pid"]
    device = job.torch_device(1)
    assert device["snapshot"] == str(job.cwd / "vramkit-snapshot-rank1-torch-cpu.pickle")
    assert device["timeline"] == str(job.cwd / "vramkit-timeline-rank1-torch-cpu.html")


def test_each_ranks_peak_is_what_its_tensors_add_up_to(finished):
    peak0, peak1 = (finished.torch_device(rank)["peak_allocated"] for rank in (0, 1))
    assert PEAK_0 <= peak0 <= PEAK_0 + SLACK, peak0
    assert PEAK_1 <= peak1 <= PEAK_1 + SLACK, peak1
    # The same program but for the extra tensor: the ranks differ by that tensor.
    assert EXTRA_MIB * MiB <= peak1 - peak0 <= EXTRA_MIB * MiB + SLACK
    # The largest site of rank 1 is `data`, then `extra`, each alive at the peak.
    sites = finished.torch_device(1)["top_sites"]
    assert [(s["label"], s["live_at_peak"]) for s in sites[:2]] == [
        (f"script.py:{line_of(TRAIN, 'data = torch.ones')} in <module>", DATA_MIB * MiB),
        (f"script.py:{line_of(TRAIN, 'extra = torch.ones')} in <module>", EXTRA_MIB * MiB)]


def test_rank_0_prints_the_merged_report_naming_rank_1_the_highest(finished):
    out, merged = finished.out, finished.merged()
    assert "=== all ranks: script.py, world size 2 (2 of 2 reported) ===" in merged
    rows = re.findall(r"^\s+(\*?)\s*(\d)\s+cpu \(torch\)\s+(\S+ \S+)\s+(\S+ \S+)\s+(\d+)\s+(\w+)$", merged, re.M)
    assert [(mark, rank, status, ended) for mark, rank, _, _, status, ended in rows] == [
        ("", "0", "0", "finished"), ("*", "1", "0", "finished")], merged
    assert "* the highest: rank 1," in merged and "more than the lowest, rank 0" in merged
    assert "allocation sites of rank 1 on cpu (torch)" in merged
    assert f"script.py:{line_of(TRAIN, 'extra = torch.ones')} in <module>" in merged
    # Only rank 0 prints the full device reports; rank 1 a short block, each line prefixed.
    assert out.count("=== cpu: PyTorch tensors, live-tensor meter ===") == 1
    rank1 = [line for line in out.splitlines() if line.startswith("[vramkit rank 1 of 2] ")]
    assert re.fullmatch(r"\[vramkit rank 1 of 2\] script\.py finished \(exit status 0\) after [0-9.]+ s", rank1[0])
    assert f"[vramkit rank 1 of 2] cpu (torch): peak allocated {PEAK_1 / MiB:.1f} MiB, peak reserved" in out
    assert rank1[-1].startswith(f"[vramkit rank 1 of 2] report: {finished.cwd / 'vramkit-rank1.json'} ")
    assert "rank 0: done" in out and "rank 1: done" in out  # the scripts' own output


def test_merge_prints_the_same_report_later(finished):
    proc = subprocess.run([sys.executable, "-m", "vramkit", "merge", "--top", "3", "vramkit-rank1.json",
                           "vramkit-rank0.json"], cwd=finished.cwd, env=child_env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == finished.merged()


def test_merge_of_some_ranks_lists_the_others_as_missing(finished):
    status, out, err = merge(finished.cwd / "vramkit-rank1.json")
    assert status == 0, err
    assert "(1 of 2 reported)" in out
    assert re.search(r"^\s+0\s+-\s+-\s+-\s+-\s+no report$", out, re.M), out
    assert "rank 0: no report (it died before writing one, or is still running)" in out
    assert "* the highest: rank 1," in out


# ------------------------------------------------------------------ rank 1 raises, rank 0 is stopped

def test_a_rank_that_raises_still_writes_its_report(raised):
    assert raised.proc.returncode != 0
    summary = raised.summary(1)
    assert summary is not None, raised.out + raised.err
    assert summary["exit_status"] == 1
    assert summary["ended"] == {
        "how": "raised", "exception": "RuntimeError", "message": "boom on rank 1", "signal": None,
        "where": {"filename": str(raised.cwd / "script.py"), "line": line_of(RAISES, "raise RuntimeError"),
                  "name": "<module>"}}
    assert 4 * MiB <= raised.torch_device(1)["peak_allocated"] <= 4 * MiB + SLACK  # `data` (and the barrier's)
    assert "RuntimeError: boom on rank 1" in raised.err  # its traceback, as python script.py shows it


def test_sigterm_from_torchrun_stops_the_other_rank_which_reports_it(raised):
    """torchrun's agent sends SIGTERM to rank 0 once rank 1 has failed; vramkit's handler turns it into an
    exception in the script (rank 0 sleeps in time.sleep, which the signal interrupts), and rank 0
    writes its report and exits with 128 + 15, which torchrun shows as its exit code."""
    summary = raised.summary(0)
    assert summary is not None, raised.out + raised.err
    assert summary["exit_status"] == 143
    assert summary["ended"]["how"] == "signal" and summary["ended"]["signal"] == "SIGTERM"
    assert summary["ended"]["where"]["line"] == line_of(RAISES, "time.sleep(0.1)")
    assert (raised.cwd / "vramkit-snapshot-rank0-torch-cpu.pickle").is_file()
    assert "closing signal SIGTERM" in raised.err  # torchrun's own log line
    assert re.search(r"exitcode\s+:\s+143", raised.err), raised.err
    assert "vramkit run: rank 0: SIGTERM received at script.py:" in raised.err


def test_the_merged_report_names_the_rank_that_failed_and_how(raised):
    merged = raised.merged()
    assert "(2 of 2 reported)" in merged
    raise_line, sleep_line = line_of(RAISES, "raise RuntimeError"), line_of(RAISES, "time.sleep(0.1)")
    first = f"rank 1 raised RuntimeError: boom on rank 1 at script.py:{raise_line} in <module> (exit status 1;"
    then = f"rank 0 killed by SIGTERM at script.py:{sleep_line} in <module> (exit status 143;"
    assert first in merged and then in merged
    assert merged.index(first) < merged.index(then)  # what brought the job down comes first
    assert re.search(r"^\s+\*?\s*1\s+cpu \(torch\)\s+4\.0 MiB\s+4\.0 MiB\s+1\s+raised RuntimeError$", merged, re.M)
    assert re.search(r"^\s+\*?\s*0\s+cpu \(torch\).*\s143\s+killed by SIGTERM$", merged, re.M), merged


# ---------------------------------------------------------------- rank 1 is SIGKILLed while rank 0 waits

def test_a_rank_killed_outright_has_no_report_and_rank_0_stops_waiting(killed):
    assert killed.summary(1) is None and not list(killed.cwd.glob("vramkit-*rank1*"))
    summary = killed.summary(0)
    assert summary is not None and summary["ended"]["how"] == "finished", killed.out + killed.err
    merged = killed.merged()
    assert "(1 of 2 reported)" in merged
    assert "rank 1: no report (it died before writing one, or is still running)" in merged
    # torchrun's SIGTERM (sent once rank 1 died) cut rank 0's 120 s wait short: rank 0 says so, and
    # it printed the merged report after its wait, so torchrun's SIGKILL (30 s after its SIGTERM) did
    # not end it. No clock: the job's subprocess timeout is only a hang guard.
    assert "Stopped waiting: SIGTERM received" in killed.out


# ------------------------------------------------------------------------------- vramkit merge: bad input

def merge(*paths: Path | str) -> tuple[int, str, str]:
    from vramkit.commands import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["merge", *map(str, paths)])
    return status, out.getvalue(), err.getvalue()


def edited(src: Path, dst: Path, edit) -> Path:
    obj = json.loads(src.read_text(encoding="utf-8"))
    edit(obj)
    dst.write_text(json.dumps(obj), encoding="utf-8")
    return dst


def set_path(obj: dict, path: str, value) -> None:
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    for p in parents:
        obj = obj[p]
    if value is DELETE:
        del obj[last]
    else:
        obj[last] = value


DELETE = object()

FIELD_CASES = [
    ("format", "vramkit-trace", "format: is a string \"vramkit-trace\", not 'vramkit-rank-report'"),
    ("version", 2, "version: an integer 2 is not supported (this vramkit reads version 1)"),
    ("version", True, "version: a boolean true is not supported"),
    ("rank", DELETE, "rank: missing"),
    ("rank", "1", "rank: expected an integer from 0 to 2**63-1, got a string \"1\""),
    ("rank", 2, "rank: 2 is not below the world size 2"),
    ("world_size", 0, "world_size: expected an integer from 1 to 2**63-1, got an integer 0"),
    ("devices.1.peak_allocated", "27 MiB", "devices[1].peak_allocated: expected an integer from 0"),
    ("devices.1.peak_reserved", -1, "devices[1].peak_reserved: expected an integer from 0 to 2**63-1, got an integer -1"),
    ("devices.1.allocations", True, "devices[1].allocations: expected an integer from 0 to 2**63-1, got a boolean true"),
    ("devices.1.top_sites.0.frames.0.line", None, "devices[1].top_sites[0].frames[0].line: expected an integer"),
    ("devices", {}, "devices: expected a list, got an object"),
    ("ended.how", "vanished", "ended.how: expected one of finished, exited, raised, signal"),
    ("ended", DELETE, "ended: missing"),
    ("wall_time_s", -1.5, "wall_time_s: expected a number >= 0"),
    ("args", [1], "args: expected a list of strings"),
    ("host", 7, "host: expected a string, got an integer 7"),
]


@pytest.mark.parametrize("field, value, message", FIELD_CASES, ids=[f"{c[0]}={c[1]!r}"[:40] for c in FIELD_CASES])
def test_merge_names_the_field_that_is_wrong(finished, tmp_path, field, value, message):
    bad = edited(finished.cwd / "vramkit-rank1.json", tmp_path / "bad.json", lambda o: set_path(o, field, value))
    status, out, err = merge(finished.cwd / "vramkit-rank0.json", bad)
    assert status == 2 and out == ""
    assert err.startswith(f"vramkit merge: error: {bad}: "), err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_merge_rejects_files_that_are_not_rank_reports(finished, tmp_path):
    good = finished.cwd / "vramkit-rank0.json"
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: nothing is read, the size is checked first
    deep = write(tmp_path / "deep.json", b"[" * 200_000 + b"]" * 200_000)
    cases = [
        (write(tmp_path / "text.json", b"rank 1 peaked at 27 MiB\n"), "not JSON (Expecting value: line 1 column 1"),
        (write(tmp_path / "latin1.json", b'{"host": "\xe9"}'), "not UTF-8 text (byte 10)"),
        (write(tmp_path / "list.json", b"[1, 2]"), "expected a JSON object, got a list"),
        (write(tmp_path / "nan.json", good.read_bytes().replace(b'"wall_time_s": ', b'"wall_time_s": NaN, "x": ')),
         "not JSON (NaN is not a JSON number)"),
        (write(tmp_path / "pickle.json", (finished.cwd / "vramkit-snapshot-rank0.pickle").read_bytes()),
         "not UTF-8 text"),
        (big, f"{(16 << 20) + 1:,} bytes is over the 16 MiB a rank report may have"),
        (deep, "JSON nested too deeply"),
        (tmp_path, "not a regular file"),
        (tmp_path / "missing.json", "cannot read it: No such file or directory"),
    ]
    for path, message in cases:
        status, out, err = merge(good, path)
        assert status == 2 and out == "", (path, err)
        assert err.startswith(f"vramkit merge: error: {path}: ") and message in err, (path, err)
        assert err.count("\n") == 1, err


def test_merge_refuses_two_files_of_one_rank_or_of_different_runs(finished, tmp_path):
    rank0, rank1 = finished.cwd / "vramkit-rank0.json", finished.cwd / "vramkit-rank1.json"
    copy = Path(shutil.copy(rank1, tmp_path / "copy.json"))
    status, _, err = merge(rank0, rank1, copy)
    assert status == 2 and f"{rank1} and {copy} are both rank 1 (one file per rank" in err
    other = edited(rank1, tmp_path / "other.json", lambda o: set_path(o, "run.master", "10.0.0.9:29500"))
    status, _, err = merge(rank0, other)
    assert status == 2 and f"{rank0} and {other} are from different runs" in err and "10.0.0.9:29500" in err
    bigger = edited(rank1, tmp_path / "bigger.json", lambda o: set_path(o, "world_size", 4))
    status, _, err = merge(rank0, bigger)
    assert status == 2 and f"{rank0} is a rank of a job of 2 ranks, {bigger} of 4" in err
    # A job of 4 of which two reported: the other two are listed as having none.
    status, out, err = merge(bigger, edited(rank0, tmp_path / "r0.json", lambda o: set_path(o, "world_size", 4)))
    assert status == 0, err
    assert "rank 2: no report" in out and "rank 3: no report" in out and "(2 of 4 reported)" in out


# --------------------------------------------------------------------- in this process: the environment

def run_here(tmp_path, monkeypatch, script: str, *args: str, **environ: str) -> tuple[int, str, str]:
    from vramkit.commands import main as cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["run", "--top", "2", *args, str(tmp_path / "job.py")])
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' is not an integer >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not an integer >= 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2 (ranks are 0 to WORLD_SIZE-1)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer >= 0"),
])
def test_a_bad_rank_environment_is_an_error(tmp_path, monkeypatch, environ, message):
    status, out, err = run_here(tmp_path, monkeypatch, "print('ran')\n", **environ)
    assert status == 2 and "ran" not in out
    assert err.startswith("vramkit run: error: the environment says this is a rank of a distributed job, but ")
    assert message in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == ["job.py"]


def test_a_job_of_one_rank_is_a_plain_run(tmp_path, monkeypatch):
    status, out, _ = run_here(tmp_path, monkeypatch, "import numpy as np\nx = np.ones(1000)\n",
                              RANK="0", WORLD_SIZE="1")
    assert status == 0 and "=== all ranks" not in out
    assert sorted(os.listdir(tmp_path)) == ["job.py", "vramkit-snapshot.pickle", "vramkit-timeline.html"]


def test_sigterm_in_the_script_is_reported_and_the_handler_restored(tmp_path, monkeypatch):
    """A rank signalled while its script runs (here it signals itself): exit status 143, a report
    that says so, and the SIGTERM handler put back as it was found."""
    before = signal.getsignal(signal.SIGTERM)
    script = """
        import os, signal, time
        import numpy as np
        x = np.ones(1 << 16)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """
    status, out, err = run_here(tmp_path, monkeypatch, script, RANK="1", WORLD_SIZE="2", MASTER_ADDR="h",
                                MASTER_PORT="1")
    assert status == 143, err
    assert signal.getsignal(signal.SIGTERM) is before
    summary = json.loads((tmp_path / "vramkit-rank1.json").read_text(encoding="utf-8"))
    assert summary["ended"]["how"] == "signal" and summary["ended"]["signal"] == "SIGTERM"
    assert summary["ended"]["where"]["line"] in (5, 6)  # the kill, or the sleep it interrupted
    assert summary["run"] == {"id": None, "restart": None, "master": "h:1"}
    (numpy_pool,) = summary["devices"]
    assert numpy_pool["peak_allocated"] >= 8 << 16
    assert out.startswith("[vramkit rank 1 of 2] job.py killed by SIGTERM at job.py:")
    assert "=== cpu" not in out  # ranks other than 0 print only their short block


def test_rank_0_that_fails_itself_does_not_wait_and_skips_reports_of_other_runs(tmp_path, monkeypatch, finished,
                                                                                hang_guard):
    """Rank 0's own failure: torchrun stops the other ranks only after rank 0 exits, so it does not
    wait. A report left by an earlier launch in the directory is not taken for this run's. Waiting
    would be a hang: the wait allowed is a day, and the hang guard cuts the run off long before."""
    shutil.copy(finished.cwd / "vramkit-rank1.json", tmp_path / "vramkit-rank1.json")  # another run's
    status, out, err = hang_guard(300, run_here, tmp_path, monkeypatch, "raise ValueError('bad batch')\n",
                                  "--wait-ranks", "86400", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT="1")
    assert status == 1
    assert "Rank 0 did not finish (exit status 1), so it does not wait for the other ranks' reports" in out
    assert "rank 0 raised ValueError: bad batch at job.py:1 in <module> (exit status 1;" in out
    assert "(1 of 2 reported)" in out
    assert f"rank 1: no report yet: {tmp_path / 'vramkit-rank1.json'} is from another run" in out
    assert "ValueError: bad batch" in err


def test_a_rank_removes_its_report_of_an_earlier_run_before_it_starts(tmp_path, monkeypatch, finished):
    shutil.copy(finished.cwd / "vramkit-rank1.json", tmp_path / "vramkit-rank1.json")
    status, _, _ = run_here(tmp_path, monkeypatch, "import os\nassert not os.path.exists('vramkit-rank1.json')\n",
                            RANK="1", WORLD_SIZE="2")
    assert status == 0
    assert json.loads((tmp_path / "vramkit-rank1.json").read_text(encoding="utf-8"))["run"]["master"] is None


def test_a_missing_rank_report_directory_is_an_error_before_the_script_runs(tmp_path, monkeypatch):
    status, out, err = run_here(tmp_path, monkeypatch, "print('ran')\n", "--rank-report", "no/such/dir/r.json",
                                RANK="1", WORLD_SIZE="2")
    assert status == 2 and "ran" not in out
    assert err == f"vramkit run: error: --rank-report: the directory {str(tmp_path / 'no/such/dir')!r} does not exist\n"


def test_report_lines_show_the_first_line_of_a_long_message():
    from vramkit.commands.rank_report import Ending
    from vramkit.report.sites import Frame

    ending = Ending("raised", 1, "RuntimeError", "x" * 500 + "\nsecond line", where=Frame("/a/t.py", 3, "f"))
    assert ending.text() == "raised RuntimeError: " + "x" * 157 + "... at t.py:3 in f"
    assert Ending("exited", 3).text() == "exited with status 3"


def nodes(obj):
    """Every (container, key) of a parsed JSON document."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield obj, key
        yield from nodes(value)


def test_mutated_reports_are_read_or_refused_never_a_traceback(finished, tmp_path):
    """Each field of a real report replaced by a value of another type (or removed): `vramkit merge`
    either prints the report or exits 2 with one error line; text that a terminal would act on is
    never printed as it is."""
    import random

    rng = random.Random(1234)
    source = json.loads((finished.cwd / "vramkit-rank1.json").read_text(encoding="utf-8"))
    values = [None, True, -1, 2 ** 70, 1.5, "", "\ud800\x1b[2J\r", [], {}, [1], {"line": 1}]
    count = sum(1 for _ in nodes(source))
    for trial in range(150):
        doc = json.loads(json.dumps(source))
        obj, key = list(nodes(doc))[rng.randrange(count) if trial else 0]
        if isinstance(obj, dict) and rng.random() < 0.2:
            del obj[key]
        else:
            obj[key] = rng.choice(values)
        path = tmp_path / f"m{trial}.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        status, out, err = merge(path)
        assert status in (0, 2), (doc, err)
        assert (status == 0 and not err) or (status == 2 and err.count("\n") == 1 and not out), (doc, out, err)
        assert "\x1b" not in out and "\r" not in out


def test_rank_0_writes_whole_lines_only():
    """Under torchrun the ranks share one unbuffered stdout, and print() writes a line's text and its
    newline in two calls; rank 0's report goes through WholeLines so that another rank's block can
    land only between its lines."""
    from vramkit.commands.run_ranks import WholeLines

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    stream = Recorder()
    lines = WholeLines(stream)
    with contextlib.redirect_stdout(lines):
        print("=== cpu: PyTorch tensors ===")
        print("a", "b", end="")
        assert stream.writes == ["=== cpu: PyTorch tensors ===\n"]
        print()
        print(("x" * 999 + "\n") * 9, end="")
    lines.write("tail")
    lines.flush()
    assert stream.getvalue() == "=== cpu: PyTorch tensors ===\na b\n" + ("x" * 999 + "\n") * 9 + "tail"
    assert all(w.endswith("\n") and len(w) <= 4096 for w in stream.writes[:-1]) and stream.writes[-1] == "tail"



OOM_RANKS = textwrap.dedent("""
    import contextlib, numpy as np, torch.distributed as dist, vramkit
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vramkit.set_memory_limit(64 << 20, "cpu")
    keep = [np.ones((8 + 8 * rank) << 20, dtype=np.uint8)]   # 8 MiB on rank 0, 16 MiB on rank 1
    with contextlib.suppress(MemoryError):
        np.ones(96 << 20, dtype=np.uint8)
    dist.barrier()
""")


def test_each_rank_writes_its_own_out_of_memory_post_mortem(tmp_path):
    job = torchrun(tmp_path, OOM_RANKS)
    assert job.proc.returncode == 0, job.out + job.err
    files = sorted(os.listdir(tmp_path / "vramkit-oom"))
    assert len(files) == 4, files  # a pickle and a timeline per rank
    for rank, held in ((0, 8), (1, 16)):
        assert f"out of memory on cpu (rank {rank}) ===" in job.err
        assert sorted(f.rsplit(".", 1)[1] for f in files if f"-rank{rank}-cpu-1." in f) == ["html", "pickle"]
        (snap,) = [f for f in files if f"-rank{rank}-cpu-1.pickle" in f]
        trace = pickle.loads((tmp_path / "vramkit-oom" / snap).read_bytes())["device_traces"][0]
        assert [e["size"] for e in trace if e["action"] == "oom"] == [96 * MiB]
        assert any(e["action"] == "alloc" and e["size"] == held * MiB for e in trace)
