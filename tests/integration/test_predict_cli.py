"""`vramkit fit` and `vramkit replay` end to end, in a child Python, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import subprocess_env

pytest.importorskip("torch")
TESTS = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    from trace_models import GPTConfig, gpt_builder

    vramkit_step = gpt_builder(GPTConfig(vocab=1000, seq=128, dim=128, heads=4, layers=2))
    other_name = vramkit_step

    if __name__ == "__main__":
        raise SystemExit("the training loop must not run under vramkit fit")
""")


def vramkit_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramkit", *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_fit_finds_the_largest_batch_and_writes_the_timeline(tmp_path, script):
    from vramkit import trace as vt

    sys.path.insert(0, str(TESTS))
    from trace_models import GPTConfig, gpt_builder

    proc = vramkit_cli("fit", "train.py", "--device-memory", "160MiB", "--cuda-context-mib", "0",
                   "--cublas-workspace-mib", "0", "--trace", "best.vktrace", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("largest batch size that fits: "), proc.stdout
    best = int(first.split(": ")[1].split()[0])
    # Independent check through the library: best fits, best + 1 does not.
    build = gpt_builder(GPTConfig(vocab=1000, seq=128, dim=128, heads=4, layers=2))
    assert vt.replay(vt.capture(build, best, steps=2), "160MiB", overheads=vt.NO_OVERHEADS).fits
    assert not vt.replay(vt.capture(build, best + 1, steps=2), "160MiB", overheads=vt.NO_OVERHEADS).fits
    assert "batch size 2: fits" in proc.stderr  # progress, one line per probe (1 is not probed when 2 fits)
    page = (tmp_path / "vramkit-predict.html").read_text()
    assert "<svg" in page and "layers.0" in page
    saved = vt.load(tmp_path / "best.vktrace")
    assert saved.meta["batch_size"] == best


def test_fit_of_a_batch_that_does_not_fit_exits_3_with_the_verdict_first(tmp_path, script):
    proc = vramkit_cli("fit", "train.py", "--device-memory", "672MiB", "--batch-size", "64", "--no-search",
                   "--entry", "other_name", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.startswith("batch size 64: OOM at "), proc.stdout
    assert "gradient accumulation:" in proc.stdout


@pytest.mark.parametrize("args, status, message", [
    (["missing.py", "--device-memory", "24GiB"], 2, "script 'missing.py' not found"),
    (["train.py", "--device-memory", "24 GB"], 2, "ambiguous"),
    (["train.py", "--device-memory", "lots"], 2, "is not a size"),
    (["train.py", "--device-memory", "24GiB", "--entry", "nope"], 2, "defines no function nope(batch_size)"),
    (["train.py", "--device-memory", "24GiB", "--no-search"], 2, "--no-search needs --batch-size"),
    (["broken.py", "--device-memory", "24GiB"], 1, "the step vramkit_step() raised ValueError: bad shape"),
    (["raises_on_load.py", "--device-memory", "24GiB"], 1, "loading raises_on_load.py raised ModuleNotFoundError"),
])
def test_fit_bad_input(tmp_path, script, args, status, message):
    (tmp_path / "broken.py").write_text("def vramkit_step(batch_size):\n    def build():\n"
                                        "        raise ValueError('bad shape')\n    return build()\n")
    (tmp_path / "raises_on_load.py").write_text("import no_such_module_here\n")
    proc = vramkit_cli("fit", *args, cwd=tmp_path)
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "vramkit-predict.html").exists()


def test_fit_and_replay_with_a_gpu_profile(tmp_path, script):
    from vramkit import trace as vt

    proc = vramkit_cli("fit", "train.py", "--gpu", "A100-40GB", "--batch-size", "2", "--no-search",
                       "--trace", "t.vktrace", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "on A100-40GB (39.59 GiB)" in proc.stderr
    t = vt.load(tmp_path / "t.vktrace")
    assert t.meta["cuda_choices"]["arch"] == "8.0"
    expected = vt.replay(t, gpu="A100-40GB")
    assert proc.stdout.splitlines()[0] == "batch size 2: " + expected.verdict()
    replayed = vramkit_cli("replay", "t.vktrace", "--gpu", "a100_40gb", cwd=tmp_path)
    assert replayed.returncode == 0 and replayed.stdout.splitlines()[0] == expected.verdict()
    for args, message in ((["--gpu", "B200"], "unknown GPU 'B200'"), ([], "say which GPU: --gpu NAME")):
        bad = vramkit_cli("fit", "train.py", *args, cwd=tmp_path)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_replay_of_a_saved_trace(tmp_path, script):
    from vramkit import trace as vt

    sys.path.insert(0, str(TESTS))
    from trace_models import GPTConfig, gpt_builder

    t = vt.capture(gpt_builder(GPTConfig()), 2, steps=2)
    t.save(tmp_path / "t.vktrace")
    expected = vt.replay(t, "1GiB")
    proc = vramkit_cli("replay", "t.vktrace", "--device-memory", "1GiB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == expected.verdict()
    proc = vramkit_cli("replay", "t.vktrace", "--device-memory", "600MiB", "--cuda-context-mib", "599", cwd=tmp_path)
    assert proc.returncode == 3 and proc.stdout.startswith("OOM at "), proc.stdout + proc.stderr
    (tmp_path / "cut.vktrace").write_bytes((tmp_path / "t.vktrace").read_bytes()[:-10])
    proc = vramkit_cli("replay", "cut.vktrace", "--device-memory", "1GiB", cwd=tmp_path)
    assert proc.returncode == 2 and "truncated" in proc.stderr
    proc = vramkit_cli("replay", "nothing.vktrace", "--device-memory", "1GiB", cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_replay_of_a_recorded_snapshot_reproduces_its_figures(tmp_path):
    """A run recorded by vramkit on a simulated device (same pickle format as
    torch.cuda.memory._dump_snapshot) replays with the recorded peaks and final totals."""
    import random

    import vramkit

    dev = vramkit.sim.create(4 << 30)
    vramkit.record_memory_history(True, device=dev)
    rng = random.Random(7)
    live = []
    try:
        for _ in range(2000):
            if live and rng.random() < 0.45:
                vramkit.raw_free(live.pop(rng.randrange(len(live))))
            else:
                live.append(vramkit.raw_alloc(rng.choice([100, 4096, 700_000, 3 << 20, 12 << 20, 40 << 20]), dev))
        vramkit.dump_snapshot(str(tmp_path / "run.pickle"), device=dev)
        peak_alloc, peak_res = vramkit.max_memory_allocated(dev), vramkit.max_memory_reserved(dev)
        final_alloc, final_res = vramkit.memory_allocated(dev), vramkit.memory_reserved(dev)
    finally:
        for p in live:
            vramkit.raw_free(p)
        vramkit.record_memory_history(False, device=dev)
        vramkit.empty_cache(dev)
    from vramkit import trace as vt

    t = vt.load(tmp_path / "run.pickle")
    assert t.meta["recorded_peak_reserved"] == peak_res and t.meta["recorded_reserved"] == final_res
    pred = vt.replay(t, 4 << 30, overheads=vt.NO_OVERHEADS)
    assert (pred.peak_allocated, pred.peak_reserved) == (peak_alloc, peak_res)
    proc = vramkit_cli("replay", "run.pickle", "--device-memory", "4GiB", "--cuda-context-mib", "0",
                       "--cublas-workspace-mib", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == pred.verdict()
    assert f"recorded on {dev}: " in proc.stdout
    small = vramkit_cli("replay", "run.pickle", "--device-memory", "256MiB", "--cuda-context-mib", "0",
                        "--cublas-workspace-mib", "0", cwd=tmp_path)
    assert small.returncode == (0 if peak_alloc <= 256 << 20 and vt.replay(t, 256 << 20, overheads=vt.NO_OVERHEADS).fits
                                else 3)


SHARDED = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS / "unit")!r})
    import sharded_models

    def vramkit_step(batch_size):
        return sharded_models.builder("gpt", "fsdp2", batch=batch_size)()

    def zero_step(batch_size):
        return sharded_models.builder("gpt", "zero", batch=batch_size)()

    def ddp_step(batch_size):
        return sharded_models.builder("gpt", "ddp", batch=batch_size)()
""")


def test_fit_per_rank_of_a_sharded_job(tmp_path):
    """--world-size: the verdict first, then each captured rank's peaks; the figures are the
    library's predict_ranks and the saved trace is the highest rank's."""
    from vramkit import trace as vt

    sys.path.insert(0, str(TESTS / "unit"))
    import sharded_models

    (tmp_path / "sharded.py").write_text(SHARDED)
    proc = vramkit_cli("fit", "sharded.py", "--world-size", "4", "--gpu", "H100-80GB", "--batch-size", "2",
                       "--no-search", "--entry", "zero_step", "--trace", "t.vktrace", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("batch size 2: fits"), proc.stdout
    assert "world size 4, batch size 2 per rank (8 in all)" in proc.stdout
    report = vt.predict_ranks(lambda bs: sharded_models.builder("gpt", "zero", batch=bs)(), 2, world_size=4,
                              gpu="H100-80GB")
    assert len(report.predictions) == 4  # ZeroRedundancyOptimizer: ranks differ, so every rank is captured
    for rank, pred in report.predictions.items():
        row = next(line for line in lines if line.split()[:1] == [str(rank)])
        assert vt.format_size(pred.peak_allocated) in row, (row, pred.peak_allocated)
    saved = vt.load(tmp_path / "t.vktrace")
    assert saved.meta["distributed"]["world_size"] == 4
    assert saved.meta["distributed"]["rank"] == report.worst_rank
    assert "nccl" in proc.stdout and "650.00 MiB" in proc.stdout


def test_fit_sharded_answers_the_fewest_gpus_and_what_to_change(tmp_path):
    """A batch that does not fit on 2 GPUs: the smallest world size that fits it (FSDP2), and for
    a DDP script that more GPUs do not help, with FSDP2 among the changes and its communication.
    The figures are the library's (smallest_world_size and fit, checked against exhaustive
    searches and the scripts written with each strategy in the unit tests)."""
    from vramkit import trace as vt
    from vramkit.trace.fitting.sharded_fit import smallest_world_size

    sys.path.insert(0, str(TESTS / "unit"))
    import sharded_models

    (tmp_path / "sharded.py").write_text(SHARDED)
    no_overheads = ["--cuda-context-mib", "0", "--cublas-workspace-mib", "0", "--nccl-mib", "0"]

    def build(strategy):
        return lambda bs: sharded_models.builder("gpt", strategy, batch=bs)()

    traces = {n: vt.predict_ranks(build("fsdp2"), 4, world_size=n, gpu="1GiB", overheads=vt.NO_OVERHEADS,
                                  ranks=[0]).traces[0] for n in (2, 4)}

    def fits(n: int, capacity: int) -> bool:
        return vt.replay(traces[n], capacity, overheads=vt.NO_OVERHEADS).fits

    # The smallest GPU (in 2 MiB steps) on which 4 ranks fit: a GPU smaller than a step's peak
    # reserved on a large one can fit it (the allocator frees its cache, the side streams'
    # included, and retries), so the peaks on 1 GiB do not give it.
    capacity = vt.replay(traces[4], "1GiB", overheads=vt.NO_OVERHEADS).peak_allocated
    while not fits(4, capacity):
        capacity += 2 << 20
    assert not fits(2, capacity)
    cap = str(capacity)
    proc = vramkit_cli("fit", "sharded.py", "--world-size", "2", "--device-memory", cap, "--batch-size", "4",
                       "--no-search", "--max-world-size", "16", *no_overheads, cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    answer = smallest_world_size(build("fsdp2"), 4, gpu=int(cap), limit=16, overheads=vt.NO_OVERHEADS,
                                 known=vt.predict_ranks(build("fsdp2"), 4, world_size=2, gpu=int(cap),
                                                        overheads=vt.NO_OVERHEADS))
    assert answer.world_size == 4 and answer.line() in proc.stdout, proc.stdout

    ddp = vt.predict_ranks(build("ddp"), 4, world_size=2, gpu="1GiB", overheads=vt.NO_OVERHEADS, ranks=[0])
    cap = str(ddp.predictions[0].peak_reserved - 1)
    proc = vramkit_cli("fit", "sharded.py", "--entry", "ddp_step", "--world-size", "2", "--device-memory", cap,
                       "--batch-size", "4", "--no-search", *no_overheads, cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "more GPUs do not make batch size 4 per rank fit: the script replicates the model" in proc.stdout
    assert "  - FSDP2 instead of DDP" in proc.stdout and "this rank sends" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--rank", "1"], "--rank 1 needs --world-size N with N > 1"),
    (["--world-size", "2", "--rank", "2"], "--rank 2 needs --world-size N with N > 2"),
    (["--world-size", "0"], "--world-size: expected a positive integer, got 0"),
])
def test_fit_sharded_bad_input(tmp_path, args, message):
    (tmp_path / "sharded.py").write_text(SHARDED)
    proc = vramkit_cli("fit", "sharded.py", "--device-memory", "24GiB", "--batch-size", "2", "--no-search", *args,
                       cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
