"""Bad input on the command line: one line naming the problem, exit 2 (bad input), 1 (the
script failed) or 130 (Ctrl-C), never a traceback. Each case here printed a traceback, exited
with the wrong status or said the wrong thing before it was fixed."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import subprocess_env

TESTS = Path(__file__).resolve().parents[1]


def vramkit_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramkit", *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def saved_trace(tmp_path: Path) -> Path:
    from vramkit import trace as vt

    t = vt.Trace.from_columns(kind=[vt.ALLOC, vt.ALLOC, vt.FREE], id=[0, 1, 0], size=[1 << 20, 4 << 20, 1 << 20])
    return Path(t.save(tmp_path / "t.vktrace"))


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ---------------------------------------------------------------------------------- vramkit replay


@pytest.mark.parametrize("args, message", [
    (["replay", "adir", "--device-memory", "1GiB"], "vramkit replay: error: 'adir' is a directory; TRACE is a "
                                                    ".vktrace file or a snapshot pickle"),
    (["replay", "t.vktrace", "--device-memory", "1GiB", "--cuda-context-mib", "inf"],
     "argument --cuda-context-mib: expected a number of MiB from 0 to 1,073,741,824 (1 PiB), got 'inf'"),
    (["replay", "t.vktrace", "--device-memory", "1GiB", "--cublas-workspace-mib", "1e300"],
     "argument --cublas-workspace-mib: expected a number of MiB from 0"),
    (["replay", "t.vktrace", "--device-memory", "1GiB", "--cuda-context-mib", "nan"], "got 'nan'"),
    (["replay", "--device", "0", "t.vktrace", "--device-memory", "1GiB"],
     "--device picks one device of a snapshot pickle; 't.vktrace' is a .vktrace file"),
    (["replay", "--device", "-1", "s.pickle", "--device-memory", "1GiB"], "argument --device: expected an integer >= 0"),
    (["replay", "t.vktrace", "--device-memory", "1GiB", "--html", "nodir/out.html"],
     "--html 'nodir/out.html': the directory"),
    (["replay", "t.vktrace", "--device-memory", "1GiB", "--html", "adir"], "--html 'adir' is a directory"),
    (["replay", "evil.pickle", "--device-memory", "1GiB"], "contains a class reference"),
    (["replay", "renamed.vktrace", "--device-memory", "1GiB"], "named .vktrace but holds a pickle"),
])
def test_replay_bad_input(tmp_path, args, message):
    saved_trace(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "s.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    evil = pickle.dumps({"segments": [], "device_traces": [[{"action": _Touch(str(tmp_path / "pwned"))}]]})
    (tmp_path / "evil.pickle").write_bytes(evil)
    (tmp_path / "renamed.vktrace").write_bytes(evil)
    proc = vramkit_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # One error line (argparse's own errors come after its usage summary, as every argparse tool's do)
    assert sum("error:" in line for line in error_lines(proc.stderr)) == 1, proc.stderr
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "vramkit-predict.html").exists()


def test_replay_that_cannot_write_its_timeline_says_so_and_exits_2(tmp_path, monkeypatch):
    """A write that fails late (disk full) after the checks passed: "vramkit replay: error",
    exit 2, and no partial page."""
    from vramkit.commands import main as cli
    from vramkit.report import timeline

    path = saved_trace(tmp_path)

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(timeline, "write_atomically", disk_full)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["replay", str(path), "--device-memory", "1GiB", "--html", str(tmp_path / "out.html")])
    assert status == 2
    assert err.getvalue().strip() == (f"vramkit replay: error: cannot write the timeline "
                                      f"{str(tmp_path / 'out.html')!r}: No space left on device")
    assert os.listdir(tmp_path) == ["t.vktrace"]


# ---------------------------------------------------------------------------------- vramkit fit

BUILDER = textwrap.dedent("""
    import os, signal, sys
    import torch

    def vramkit_step(batch_size):
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch_size, 8)
        def step():
            model(x).sum().backward()
            opt.step()
        return step

    def exits(batch_size):
        sys.exit(5)

    def interrupted(batch_size):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the builder runs
        return vramkit_step(batch_size)
""")


@pytest.mark.parametrize("args, status, message", [
    (["fit", "adir", "--device-memory", "24GiB"], 2, "'adir' is a directory; SCRIPT is a Python file"),
    (["fit", "train.py", "--device-memory", "24GiB", "--entry", "nosuchmod:f"], 2,
     "--entry 'nosuchmod:f': no module named 'nosuchmod'"),
    (["fit", "train.py", "--device-memory", "24GiB", "--entry", ":f"], 2, "expected a function name, or module:function"),
    (["fit", "train.py", "--device-memory", "24GiB", "--html", "nodir/x.html"], 2, "the directory"),
    (["fit", "train.py", "--device-memory", "24GiB", "--trace", "adir"], 2, "--trace 'adir' is a directory"),
    (["fit", "train.py", "--device-memory", "24GiB", "--entry", "exits"], 1,
     "vramkit fit: error: the builder exits() called sys.exit(5)"),
    (["fit", "exits_on_load.py", "--device-memory", "24GiB"], 1,
     "vramkit fit: error: loading exits_on_load.py called sys.exit('no GPU here')"),
    (["fit", "train.py", "--device-memory", "24GiB", "--entry", "interrupted"], 130, "vramkit fit: interrupted"),
])
def test_fit_bad_input(tmp_path, args, status, message):
    pytest.importorskip("torch")
    (tmp_path / "adir").mkdir()
    (tmp_path / "train.py").write_text(BUILDER)
    (tmp_path / "exits_on_load.py").write_text("import sys\nsys.exit('no GPU here')\n")
    proc = vramkit_cli(*args, cwd=tmp_path)
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in error_lines(proc.stderr) if not line.startswith(("capturing ", "  batch size"))]
    assert len(lines) == 1, proc.stderr
    assert not (tmp_path / "vramkit-predict.html").exists()


def test_a_module_that_imports_something_missing_is_the_scripts_failure(tmp_path):
    """--entry mod:f where mod exists but itself imports a missing module: the script failed
    (exit 1, its traceback shown), not bad input."""
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(BUILDER)
    (tmp_path / "mymod.py").write_text("import no_such_dependency\n")
    proc = vramkit_cli("fit", "train.py", "--device-memory", "24GiB", "--entry", "mymod:f", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "No module named 'no_such_dependency'" in proc.stderr
