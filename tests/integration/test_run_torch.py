"""`vramkit run` on PyTorch scripts (issue 11): the script's tensors, measured by torch itself.

Without a GPU, two things are checked for real: the CPU live-tensor meter, end to end in a child
Python as a user runs it (figures against byte counts worked out by hand from the tensors'
shapes), and that a script which never imports torch gets no torch at all. The CUDA path (torch's
own caching allocator) runs in this process against torch's CUDA entry points replaced by fakes
that keep torch's contract: history queued on the lazy-init list, started by the first CUDA use,
then a `_snapshot()` in PyTorch's format (hand-built with tests/unit/torch_snapshots.py). The real
thing on a GPU is in tests/unit/test_cuda.py::test_vramkit_run_reports_torch_cuda_memory.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from test_run_cli import load_snapshot, run_vramkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import torch_snapshots as ts  # noqa: E402

MiB = 1 << 20

TENSORS = textwrap.dedent("""
    import sys
    import torch

    MiB = 1 << 20


    def make(n):
        return torch.empty(n * MiB, dtype=torch.uint8)


    a = make(8)                       # 8 MiB
    b = torch.ones(MiB)               # 4 MiB of float32
    c = a.float()                     # 32 MiB; 44 MiB live: the peak
    del c
    d = b * 2                         # 4 MiB
    view = d[:10]                     # a view: no new storage
    print("torch imported:", "torch" in sys.modules)
""")


def line_of(text: str, marker: str) -> int:
    """The 1-based line of `text` that holds `marker` (as Python numbers the script's lines)."""
    (line,) = [i for i, t in enumerate(text.splitlines(), 1) if marker in t]
    return line


LINE_MAKE, LINE_ONES = line_of(TENSORS, "return torch.empty"), line_of(TENSORS, "torch.ones(")
LINE_FLOAT, LINE_TIMES2 = line_of(TENSORS, "a.float()"), line_of(TENSORS, "b * 2")


def test_cpu_tensors_are_reported_from_the_live_tensor_meter(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("with a GPU, torch scripts are reported from torch's CUDA allocator instead")
    script = tmp_path / "tensors.py"
    script.write_text(TENSORS)

    proc = run_vramkit("run", "--top", "4", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    start = out.index("=== cpu: PyTorch tensors, live-tensor meter ===")
    # the device that held the most first: torch's 44 MiB before the NumPy pool's few KiB
    assert start < out.index("=== cpu: NumPy arrays, vramkit's cpu pool ===")
    section = out[start:out.index("\n===", start + 1)]
    # 8 + 4 + 32 MiB live together; at the end a, b and d: 8 + 4 + 4 MiB.
    assert "Peak allocated: 44.0 MiB   Peak reserved: 44.0 MiB   Allocations: 4" in section
    assert "live now: 16.0 MiB in 3 storages" in section
    rows = re.findall(r"^\s+\d+\s+(\S+ \S+)\s+(\S+ \S+)\s+(\d+)\s+(tensors\.py:\d+ in \S+)$", section, re.M)
    assert rows == [
        ("32.0 MiB", "32.0 MiB", "1", f"tensors.py:{LINE_FLOAT} in <module>"),
        ("8.0 MiB", "8.0 MiB", "1", f"tensors.py:{LINE_MAKE} in make"),
        ("4.0 MiB", "4.0 MiB", "1", f"tensors.py:{LINE_ONES} in <module>"),
        ("0 B", "4.0 MiB", "1", f"tensors.py:{LINE_TIMES2} in <module>"),
    ], section

    snap_path = tmp_path / "vramkit-snapshot-torch-cpu.pickle"
    assert f"Snapshot (cpu, PyTorch tensors, live-tensor meter): {snap_path}" in out
    snapshot = load_snapshot(snap_path)
    trace = snapshot["device_traces"][0]
    allocs = [(e["size"], [f["line"] for f in e["frames"] if f["filename"] == str(script)][0])
              for e in trace if e["action"] == "alloc" and any(f["filename"] == str(script) for f in e["frames"])]
    assert allocs == [(8 * MiB, LINE_MAKE), (4 * MiB, LINE_ONES), (32 * MiB, LINE_FLOAT), (4 * MiB, LINE_TIMES2)]
    freed = [e for e in trace if e["action"] == "free_requested"]
    assert [e["size"] for e in freed] == [32 * MiB]
    assert sorted(s["total_size"] for s in snapshot["segments"]) == [4 * MiB, 4 * MiB, 8 * MiB]
    page = (tmp_path / "vramkit-timeline-torch-cpu.html").read_text(encoding="utf-8")
    assert "<svg" in page and "44.0 MiB" in page and f"tensors.py:{LINE_FLOAT}" in page


def test_a_script_without_torch_never_imports_it(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "plain.py"
    script.write_text("import sys\nimport numpy as np\nx = np.ones(1 << 20)\n"
                      "print('torch imported:', 'torch' in sys.modules)\n")
    proc = run_vramkit("run", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torch imported: False" in proc.stdout
    assert "PyTorch" not in proc.stdout and not (tmp_path / "vramkit-snapshot-torch-cpu.pickle").exists()


def test_failing_torch_script_is_still_reported(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "fails.py"
    script.write_text("import torch\nkept = torch.zeros(1 << 20)\nraise ValueError('boom')\n")
    proc = run_vramkit("run", str(script), cwd=tmp_path)
    assert proc.returncode == 1 and "ValueError: boom" in proc.stderr
    if "=== cpu: PyTorch tensors" in proc.stdout:  # (with a GPU, the CPU meter is off)
        assert "Peak allocated: 4.0 MiB" in proc.stdout and "fails.py:2 in <module>" in proc.stdout


def test_allocator_vramkit_without_cuda_torch_is_a_usage_error(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    proc = run_vramkit("run", "--allocator", "vramkit", str(script), cwd=tmp_path)
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert "--allocator vramkit: vramkit.torch.use_as_cuda_allocator() needs a CUDA build of PyTorch" in proc.stderr


# --- torch's CUDA caching allocator, through fakes of its entry points --------------------------

HERE = "/home/user/train.py"
FRAMES_W = [ts.frame(HERE, 12, "build"), ts.frame(HERE, 30, "<module>")]
FRAMES_ACT = [ts.frame("/site-packages/torch/nn/modules/linear.py", 125, "forward"), ts.frame(HERE, 20, "step")]


def torch_snapshot() -> dict:
    """What torch.cuda.memory._snapshot() would return after: weights 6 MiB allocated (kept), an
    activation of 10 MiB allocated then freed, in one 20 MiB segment of device 0; device 1 idle."""
    base = 0x7F00_0000_0000
    trace = ts.flatten([
        ts.segment_alloc(base, 20 * MiB),
        ts.alloc(base, 6 * MiB, frames=FRAMES_W),
        ts.alloc(base + 6 * MiB, 10 * MiB, frames=FRAMES_ACT),
        ts.free(base + 6 * MiB, 10 * MiB),
    ])
    seg = ts.segment(base, [ts.live(6 * MiB, 6 * MiB, FRAMES_W), ts.block(14 * MiB)])
    return ts.snapshot([trace, []], [seg])


class FakeTorchCuda:
    """torch.cuda's contract, as vramkit run uses it: calls queued with _lazy_call run when the
    script first uses CUDA (torch.cuda.init() here, standing for the first CUDA tensor, which then
    makes 2 allocations on device 0); memory figures and the snapshot are fixed."""

    def __init__(self) -> None:
        self.initialized = False
        self.queued: list = []
        self.history_calls: list[dict] = []
        self.allocations = {0: 0, 1: 0}
        self.snapshot = torch_snapshot()

    def lazy_call(self, fn) -> None:
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def init(self) -> None:
        self.initialized = True
        for fn in self.queued:
            fn()
        self.queued.clear()
        self.allocations[0] += 2

    def record(self, enabled="all", **kwargs) -> None:
        self.history_calls.append({"enabled": enabled, **kwargs, "initialized": self.initialized})

    def stats(self, device=None) -> dict:
        return {"allocation.all.allocated": self.allocations[device]}


@pytest.fixture
def fake_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    fake = FakeTorchCuda()
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: fake.initialized)
    monkeypatch.setattr(cuda, "_lazy_call", fake.lazy_call)
    monkeypatch.setattr(cuda, "init", fake.init)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_stats", fake.stats)
    monkeypatch.setattr(cuda, "memory_summary", lambda device=None, abbreviated=False: f"[torch summary of {device}]")
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 16 * MiB)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: 20 * MiB)
    monkeypatch.setattr(cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda device=None: fake.snapshot)
    return fake


def run_in_process(tmp_path, monkeypatch, body: str, *args: str) -> tuple[int, str]:
    from vramkit.commands import main as cli

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    status = cli.main(["run", *args, str(script)])
    return status, script


def test_cuda_script_is_reported_from_torchs_own_allocator(tmp_path, monkeypatch, capsys, fake_cuda):
    status, _ = run_in_process(tmp_path, monkeypatch, """
        import torch
        assert not torch.cuda.is_initialized()
        torch.cuda.init()   # stands for the first CUDA tensor
    """, "--max-entries", "777")
    out = capsys.readouterr().out
    assert status == 0, out
    # Recording started with CUDA (not at import), with Python stacks, and was stopped afterwards.
    assert fake_cuda.history_calls == [
        {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 777, "initialized": True},
        {"enabled": None, "initialized": True},
    ]
    section = out[out.index("=== cuda:0: PyTorch's caching allocator ==="):]
    assert section.startswith("=== cuda:0: PyTorch's caching allocator ===\n[torch summary of 0]\n")
    assert "Peak allocated: 16.0 MiB   Peak reserved: 20.0 MiB   Allocations: 2" in section
    assert "cuda:1" not in out  # the idle GPU is not reported
    # Sites from the snapshot's frames: torch's own frames skipped, the user's line named.
    rows = re.findall(r"^\s+\d+\s+(\S+ \S+)\s+(\S+ \S+)\s+(\d+)\s+(train\.py:\d+ in \S+)$", section, re.M)
    assert rows == [("10.0 MiB", "10.0 MiB", "1", "train.py:20 in step"),  # both live at the 16 MiB peak
                    ("6.0 MiB", "6.0 MiB", "1", "train.py:12 in build")], section
    # The snapshot is torch's, written as it is (memory_viz opens it), with the timeline beside it.
    assert load_snapshot(tmp_path / "vramkit-snapshot-cuda0.pickle") == fake_cuda.snapshot
    page = (tmp_path / "vramkit-timeline-cuda0.html").read_text(encoding="utf-8")
    assert "<svg" in page and "train.py:12" in page and "16.0 MiB" in page


def test_script_that_never_uses_cuda_does_not_start_it(tmp_path, monkeypatch, capsys, fake_cuda):
    status, _ = run_in_process(tmp_path, monkeypatch, "import torch\nx = 1\n")
    out = capsys.readouterr().out
    assert status == 0
    assert not fake_cuda.initialized and fake_cuda.history_calls == [] and "cuda:0" not in out
    # The start left on torch's lazy-init list does nothing if CUDA starts after the run.
    fake_cuda.init()
    assert fake_cuda.history_calls == []


def test_failed_history_start_never_breaks_cuda_init(tmp_path, monkeypatch, capsys, fake_cuda):
    torch = pytest.importorskip("torch")

    def broken(**kwargs):
        raise RuntimeError("recordHistory is not supported")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", broken)
    status, _ = run_in_process(tmp_path, monkeypatch, "import torch\ntorch.cuda.init()\nprint('after init')\n")
    out = capsys.readouterr().out
    assert status == 0 and "after init" in out
    assert "Note: torch.cuda.memory._record_memory_history failed: RuntimeError: recordHistory is not supported" in out
    assert "cuda:0" not in out
