"""vramkit.survive.find_batch_size: the largest batch size that fits, against an exhaustive
search, with the cleanup after each failed attempt checked on the pool."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import vramkit
from vramkit.survive import find_batch_size, out_of_memory_rule

MiB = 1 << 20


def buffers_step(device, per_sample=10 * MiB, fixed=0):
    """A workload whose memory grows with the batch: `fixed` bytes plus `per_sample` per sample,
    all live at once, held in a local list (so an OOM's traceback keeps them alive)."""

    def step(batch_size):
        held = [vramkit.empty(fixed, device=device)] if fixed else []
        for _ in range(batch_size):
            held.append(vramkit.empty(per_sample, device=device))
        return len(held)

    return step


def exhaustive(step, sizes):
    """The reference: try every size, in a plain loop."""
    best = 0
    for bs in sizes:
        try:
            step(bs)
            best = bs
        except vramkit.OutOfMemoryError:
            pass
        vramkit.empty_cache()
    return best


def test_sim_workload_equals_exhaustive_search():
    dev = vramkit.sim.create(1 << 30)
    step = buffers_step(dev, per_sample=10 * MiB, fixed=37 * MiB)
    vramkit.set_device(dev)
    expected = exhaustive(step, range(1, 130))
    assert 0 < expected < 129
    seen = []
    result = find_batch_size(step, device=dev, on_attempt=seen.append)
    assert result.batch_size == expected
    assert [a.batch_size for a in result.attempts] == [a.batch_size for a in seen]
    assert len(result.attempts) <= 2 * 8 + 2  # doubling then bisection, not a scan
    assert {a.outcome for a in result.attempts} == {"fits", "oom"}
    oom = [a for a in result.attempts if a.outcome == "oom"]
    assert all(a.matched == "vramkit" and "out of memory" in a.error for a in oom)
    fit = [a for a in result.attempts if a.fits]
    assert all(a.peak_reserved >= a.batch_size * 10 * MiB for a in fit)
    assert str(result).startswith(f"largest batch size that fits on {dev}: {expected}")


def test_failed_attempts_leave_the_pool_as_before():
    dev = vramkit.sim.create(256 << 20)
    step = buffers_step(dev, per_sample=4 * MiB)
    before = vramkit.memory_stats(dev)
    after_each = []

    def check(attempt):  # called after each attempt and its cleanup
        vramkit.pool_check(dev)
        after_each.append((attempt.outcome, vramkit.memory_allocated(dev)))

    result = find_batch_size(step, device=dev, on_attempt=check)
    assert {o for o, _ in after_each} == {"fits", "oom"}
    assert all(allocated == 0 for _, allocated in after_each)
    # PyTorch's policy: a 4 MiB request takes a 20 MiB segment, 5 blocks each; 12 segments fit
    # in 256 MiB (240 MiB), and no 20 MiB segment fits in the 16 MiB left: 60 samples.
    assert result.batch_size == 60
    vramkit.pool_check(dev)
    after = vramkit.memory_stats(dev)
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] == 0
    assert after["reserved_bytes.all.current"] == 0  # emptied after the last attempt
    assert all(a.leaked == 0 for a in result.attempts)


def test_the_failed_frames_are_released():
    """Without clearing the traceback's frames, the buffers the failed step held stay alive
    while the exception does: shown here by keeping one, and then by find_batch_size not."""
    dev = vramkit.sim.create(64 << 20)
    step = buffers_step(dev, per_sample=8 * MiB)
    try:
        step(100)
    except vramkit.OutOfMemoryError as exc:
        kept = exc
    assert vramkit.memory_allocated(dev) > 0  # the frame in kept.__traceback__ holds them
    del kept
    assert vramkit.memory_allocated(dev) == 0
    result = find_batch_size(step, device=dev, start=100)
    # 8 MiB requests: two per 20 MiB segment, three segments in 64 MiB: 6 samples.
    assert result.batch_size == 6 and vramkit.memory_allocated(dev) == 0
    assert result.attempts[0].batch_size == 100 and result.attempts[0].outcome == "oom"


def test_margin_keeps_a_fraction_free():
    dev = vramkit.sim.create(1 << 30)
    step = buffers_step(dev, per_sample=10 * MiB)
    result = find_batch_size(step, device=dev, margin=0.1)
    # peak = 10 MiB x batch must stay <= 0.9 x 1024 MiB = 921.6 MiB: batch 92.
    assert result.batch_size == 92
    assert any(a.outcome == "over margin" for a in result.attempts)
    assert result.margin == 0.1


def test_accumulation_keeps_the_effective_batch():
    dev = vramkit.sim.create(1 << 30)
    step = buffers_step(dev, per_sample=10 * MiB)
    result = find_batch_size(step, device=dev, effective_batch_size=240)
    # Divisors of 240 up to 102 (what fits): ..., 60, 80; 120 does not fit.
    assert result.batch_size == 80 and result.accumulation_steps == 3
    assert all(240 % a.batch_size == 0 for a in result.attempts)
    assert "effective batch 240 = 80 x 3 accumulation steps" in str(result)
    result = find_batch_size(step, device=dev, multiple_of=8, max_batch_size=1000)
    assert result.batch_size == 96 and all(a.batch_size % 8 == 0 for a in result.attempts)


def test_cap():
    dev = vramkit.sim.create(1 << 30)
    result = find_batch_size(buffers_step(dev, per_sample=MiB), device=dev, max_batch_size=50)
    assert result.batch_size == 50 and result.capped and "(the cap)" in str(result)


def test_numpy_workload_on_the_cpu_pool_with_a_limit():
    import vramkit.numpy as vnp

    vnp.install()
    vramkit.set_memory_limit(256 * MiB, "cpu")

    def step(batch_size):
        x = np.ones((batch_size, 1 << 20), dtype=np.float32)  # 4 MiB per sample
        y = x * 2  # a temporary of the same size
        return float(y[0, 0])

    with pytest.warns(RuntimeWarning, match="out of memory"):
        result = find_batch_size(step, device="cpu", max_batch_size=256)
    # Two arrays of 4 MiB x batch under a 256 MiB limit (already-reserved cpu memory counts too).
    assert 0 < result.batch_size <= 32
    assert any(a.matched == "MemoryError" for a in result.attempts)
    assert result.attempts[-1].batch_size in (result.batch_size, result.batch_size + 1)


def test_torch_out_of_memory_is_recognised_by_type():
    torch = pytest.importorskip("torch")

    def step(batch_size):
        if batch_size > 37:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return torch.zeros(batch_size)

    result = find_batch_size(step, device="cpu")
    assert result.batch_size == 37
    assert {a.matched for a in result.attempts if a.outcome == "oom"} == {"torch"}
    assert out_of_memory_rule(torch.cuda.OutOfMemoryError("x")) == "torch"


def test_cupy_out_of_memory_is_recognised_by_type(monkeypatch):
    """CuPy is not installed here: a stand-in module with CuPy's exception path
    (cupy.cuda.memory.OutOfMemoryError) checks the lookup by type."""
    import types

    class OutOfMemoryError(MemoryError):
        pass

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert out_of_memory_rule(OutOfMemoryError("Out of memory allocating 1,024 bytes")) == "cupy"
    assert out_of_memory_rule(MemoryError("plain")) == "MemoryError"


def test_text_match_is_the_documented_last_resort():
    def step(batch_size):
        if batch_size > 5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total)")

    result = find_batch_size(step, device="cpu")
    assert result.batch_size == 5
    assert {a.matched for a in result.attempts if a.outcome == "oom"} == {"message: CUDA out of memory"}
    assert out_of_memory_rule(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")) is not None
    assert out_of_memory_rule(RuntimeError("shape mismatch")) is None
    assert out_of_memory_rule(ValueError("CUDA out of memory")) is None  # only RuntimeErrors


def test_other_errors_propagate():
    calls = []

    def step(batch_size):
        calls.append(batch_size)
        if batch_size == 4:
            raise ValueError("bad data at batch 4")

    with pytest.raises(ValueError, match="bad data at batch 4"):
        find_batch_size(step, device="cpu")
    assert calls == [1, 2, 4]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(start=0), ValueError, "start must be an integer >= 1"),
    (dict(max_batch_size=-1), ValueError, "max_batch_size must be an integer >= 1"),
    (dict(start=10, max_batch_size=5), ValueError, "must not exceed max_batch_size"),
    (dict(margin=1.0), ValueError, "margin must be a fraction in \\[0, 1\\)"),
    (dict(margin=True), ValueError, "margin must be"),
    (dict(effective_batch_size=0), ValueError, "effective_batch_size must be"),
    (dict(effective_batch_size=7, multiple_of=2), ValueError, "divides effective_batch_size=7"),
    (dict(device="nowhere"), ValueError, "nowhere"),
    (dict(timeout=0), ValueError, "timeout must be a number of seconds > 0"),
    (dict(timeout=True), ValueError, "timeout must be"),
    (dict(process_group="world"), ValueError, "process_group must be 'auto', None or a torch ProcessGroup"),
])
def test_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        find_batch_size(lambda b: None, **kwargs)
    with pytest.raises(TypeError, match="step must be callable"):
        find_batch_size(None)


def test_one_process_searches_alone_whatever_process_group_says():
    """No torch.distributed job here: "auto" and None search this process alone, and a group
    given without one is refused, naming what to do."""
    gpu = vramkit.sim.create(1 << 30)

    def step(batch_size):
        vramkit.raw_free(vramkit.raw_alloc(batch_size << 24, gpu))

    for group in ("auto", None):
        result = find_batch_size(step, device=gpu, process_group=group, max_batch_size=256)
        assert result.batch_size == 64 and all(a.local_outcome == "" for a in result.attempts)
    torch = pytest.importorskip("torch")
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="torch.distributed is not initialized"):
            find_batch_size(step, device=gpu, process_group=object())


def test_a_distributed_result_shows_each_ranks_own_outcome_where_it_differs():
    from vramkit.survive import Attempt, BatchSizeResult

    result = BatchSizeResult(8, attempts=[Attempt(8, "fits", 100, 0.1, local_outcome="fits"),
                                          Attempt(16, "oom", 200, 0.1, local_outcome="fits")],
                             device="sim:0", ranks=4)
    lines = str(result).splitlines()
    assert "searched by 4 ranks together" in lines[0]
    assert lines[2].endswith("s") and "[" not in lines[2]  # the same outcome here: nothing added
    assert lines[3].endswith("[fits]")  # another rank ran out of memory; this one did not
