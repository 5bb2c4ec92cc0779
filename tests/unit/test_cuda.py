"""CUDA device tests: real cudaMalloc'd segments, real streams and events, interop with
torch and CuPy. Marked `cuda`; skipped where no GPU is usable."""

from __future__ import annotations

import random

import pytest

import vramkit
from vramkit import _C

pytestmark = pytest.mark.cuda
MiB = 1 << 20


@pytest.fixture
def gpu():
    device = "cuda:0"
    vramkit.empty_cache(device)
    yield device
    vramkit.set_memory_limit(None, device)
    vramkit.synchronize(device)
    vramkit.pool_check(device)
    vramkit.empty_cache(device)


def test_blocks_never_overlap_on_the_device(gpu):
    """Stamp every live block with its own seed on the GPU; any overlap corrupts a stamp."""
    rng = random.Random(3)
    live = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            ptr = rng.choice(list(live))
            nbytes, seed = live.pop(ptr)
            assert _C._cuda_count_mismatches(ptr, nbytes, seed, 0) == 0
            vramkit.raw_free(ptr)
        else:
            nbytes = 4 * (1 + rng.randrange(1 << rng.randrange(24)) // 4)
            ptr = vramkit.raw_alloc(nbytes, gpu)
            _C._cuda_fill_pattern(ptr, nbytes, step, 0)
            live[ptr] = (nbytes, step)
        if step % 100 == 0:
            vramkit.pool_check(gpu)
    for ptr, (nbytes, seed) in live.items():
        assert _C._cuda_count_mismatches(ptr, nbytes, seed, 0) == 0
        vramkit.raw_free(ptr)
    vramkit.pool_check(gpu)


def test_counters_and_device_memory(gpu):
    free0, total = vramkit.mem_get_info(gpu)
    assert 0 < free0 <= total
    p = vramkit.raw_alloc(100 * MiB, gpu)
    assert vramkit.memory_allocated(gpu) == 100 * MiB and vramkit.memory_reserved(gpu) == 100 * MiB
    free1, _ = vramkit.mem_get_info(gpu)
    assert free0 - free1 >= 100 * MiB - 2 * MiB  # cudaMemGetInfo sees the segment
    vramkit.raw_free(p)
    assert vramkit.empty_cache(gpu) == 100 * MiB
    assert "vramkit memory summary, device cuda:0" in vramkit.memory_summary(gpu)


def test_oom_message_matches_pytorch_shape(gpu):
    vramkit.set_memory_limit(64 * MiB, gpu)
    with pytest.raises(vramkit.OutOfMemoryError) as info:
        vramkit.raw_alloc(100 * MiB, gpu)
    msg = str(info.value)
    assert msg.startswith("CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of ")
    assert "64.00 MiB allowed; Of the allocated memory" in msg and info.value.device == "cuda:0"
    vramkit.set_memory_limit(None, gpu)
    _, total = vramkit.mem_get_info(gpu)
    with pytest.raises(vramkit.OutOfMemoryError):  # more than the card has: cudaMalloc itself fails
        vramkit.raw_alloc(2 * total, gpu)
    p = vramkit.raw_alloc(MiB, gpu)  # and the device is still usable
    vramkit.raw_free(p)


def test_buffer_exports_cuda_array_interface_and_dlpack(gpu):
    import numpy as np

    buf = vramkit.empty((128, 64), dtype=np.float32, device=gpu)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False) and cai["shape"] == (128, 64)
    assert cai["typestr"] == "<f4" and buf.__dlpack_device__() == (2, 0)
    with pytest.raises(TypeError, match="device memory"):
        memoryview(buf)
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(buf)
    assert t.is_cuda and t.data_ptr() == buf.ptr and t.shape == (128, 64)
    t.fill_(3.0)
    torch.cuda.synchronize()
    assert float(t.sum()) == 3.0 * 128 * 64
    before = vramkit.memory_allocated(gpu)
    del buf
    assert vramkit.memory_allocated(gpu) == before  # torch still holds it
    del t
    assert vramkit.memory_allocated(gpu) == before - 128 * 64 * 4


def test_cupy_reads_through_cuda_array_interface(gpu):
    cupy = pytest.importorskip("cupy")
    import numpy as np

    buf = vramkit.empty(1000, dtype=np.int32, device=gpu)
    arr = cupy.asarray(buf)
    arr[:] = cupy.arange(1000, dtype=cupy.int32)
    assert arr.data.ptr == buf.ptr and int(arr.sum()) == sum(range(1000))


def test_record_stream_waits_for_real_work(gpu):
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    p = vramkit.raw_alloc(MiB, gpu, stream=0)
    vramkit.record_stream(p, side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy (~0.1 s)
    vramkit.raw_free(p)
    q = vramkit.raw_alloc(MiB, gpu, stream=0)
    assert q != p  # the side stream may still be using p
    side.synchronize()
    vramkit.synchronize(gpu, stream=side)
    r = vramkit.raw_alloc(MiB, gpu, stream=0)
    assert r == p
    vramkit.raw_free(q)
    vramkit.raw_free(r)


@pytest.mark.slow
def test_cuda_differential(gpu):
    from allocator_model import AllocatorModel  # tests/stress is on sys.path via conftest

    model = AllocatorModel(gpu, touch_memory=False)
    rng = random.Random(11)
    for op in range(20_000):
        r = rng.random()
        if r < 0.5 and len(model.live) < 150:
            model.alloc(1 + rng.randrange(1 << rng.randrange(27)), 0)
        elif model.live:
            model.free(rng.choice(list(model.live)), None)
        model.check(f"op {op}")
        assert not model.violations, model.violations[:5]
    model.drain()
    assert not model.violations


@pytest.mark.slow
def test_cuda_expandable_differential(gpu):
    """expandable_segments on a real GPU: the differential model with every live block stamped
    on the device (an unmapped page under a live block would fault or lose the stamp), and
    cudaMemGetInfo following reserved bytes as pages are mapped and unmapped."""
    from allocator_model import AllocatorModel

    vramkit.configure(gpu, expandable_segments=True)
    try:
        free0, _ = vramkit.mem_get_info(gpu)
        model = AllocatorModel(gpu, touch_memory=False, expandable=True)
        stamps = {}
        rng = random.Random(12)
        for op in range(20_000):
            r = rng.random()
            if r < 0.5 and len(model.live) < 150:
                nbytes = 4 * (1 + rng.randrange(1 << rng.randrange(27)) // 4)
                before = set(model.live)
                model.alloc(nbytes, 0)
                for ptr in set(model.live) - before:
                    _C._cuda_fill_pattern(ptr, nbytes, op, 0)
                    stamps[ptr] = (nbytes, op)
            elif r < 0.98 and model.live:
                ptr = rng.choice(list(model.live))
                nbytes, seed = stamps.pop(ptr)
                assert _C._cuda_count_mismatches(ptr, nbytes, seed, 0) == 0
                model.free(ptr, None)
            else:
                model.empty_cache()
            model.check(f"op {op}")
            assert not model.violations, model.violations[:5]
            if op % 1000 == 0:  # the device sees the mapped pages (driver granularity aside)
                free, _ = vramkit.mem_get_info(gpu)
                assert abs((free0 - free) - vramkit.memory_reserved(gpu)) <= 64 * MiB
        for ptr, (nbytes, seed) in stamps.items():
            assert _C._cuda_count_mismatches(ptr, nbytes, seed, 0) == 0
        model.drain()
        assert not model.violations
        free, _ = vramkit.mem_get_info(gpu)
        assert vramkit.memory_reserved(gpu) == 0 and abs(free - free0) <= 64 * MiB
    finally:
        vramkit.configure(gpu, expandable_segments=False)


TORCH_LOOP = r"""
import gc, json, sys
import torch
import vramkit, vramkit.torch as vt
if sys.argv[1] == "vramkit":
    vt.use_as_cuda_allocator()
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
model = torch.nn.TransformerEncoder(layer, 2).cuda()
opt = torch.optim.Adam(model.parameters(), 1e-3)
x = torch.randn(8, 32, 64, device="cuda")
losses = []
for step in range(50):
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
del loss
torch.cuda.synchronize()
gc.collect()
storages = {}
for obj in gc.get_objects():
    if isinstance(obj, torch.Tensor) and obj.is_cuda:
        s = obj.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
out = {"losses": losses, "live": sum(storages.values())}
if sys.argv[1] == "vramkit":
    s = vramkit.memory_stats("cuda:0")
    out.update(requested=s["requested_bytes.all.current"], allocated=s["allocated_bytes.all.current"],
               summary_ok="vramkit memory summary" in vramkit.memory_summary("cuda:0"))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_torch_training_on_vramkit_memory(tmp_path):
    """A small transformer trained 50 steps with vramkit as torch's CUDA allocator: the same
    losses as with torch's own allocator, and vramkit's counters hold the live tensors."""
    pytest.importorskip("torch")
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    script = tmp_path / "loop.py"
    script.write_text(TORCH_LOOP)
    runs = {}
    for which in ("torch", "vramkit"):
        out = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=300,
                             env=subprocess_env())
        assert out.returncode == 0, out.stderr
        runs[which] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["vramkit"]["losses"] == runs["torch"]["losses"]
    v = runs["vramkit"]
    assert v["summary_ok"]
    # Live tensors are vramkit's; beyond them only torch's own workspaces may be held: a cuBLAS
    # workspace per thread that ran a matmul (this one and autograd's engine thread; 32 MiB each
    # on Hopper) and cuBLASLt's 1 MiB. An H200 held 65 MiB beyond the live tensors here.
    assert v["live"] <= v["requested"] <= v["live"] + 2 * 32 * MiB + 2 * MiB


def test_cupy_arrays_on_vramkit_memory(gpu):
    cupy = pytest.importorskip("cupy")
    import gc

    import vramkit.cupy as vcupy

    before = vramkit.memory_allocated(gpu)
    vcupy.install()
    try:
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        assert vramkit.memory_allocated(gpu) - before >= 4 * MiB
        assert float(a.sum()) == float((1 << 20) * ((1 << 20) - 1) / 2)
        del a
        gc.collect()
        assert vramkit.memory_allocated(gpu) == before
    finally:
        vcupy.uninstall()


RUN_SCRIPT = r"""
import torch
MiB = 1 << 20
def weights():
    return torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
w = weights()
x = torch.ones(8 * MiB, device="cuda")        # 32 MiB
y = x * 2                                      # 32 MiB more: the peak
del y
torch.cuda.synchronize()
try:
    print("PEAK", torch.cuda.max_memory_allocated())
except RuntimeError:  # a pluggable allocator (--allocator vramkit) has no torch-side statistics
    pass
"""


@pytest.mark.parametrize("allocator", ["torch", "vramkit"])
def test_vramkit_run_reports_torch_cuda_memory(tmp_path, allocator):
    """`vramkit run` on a torch CUDA script: torch's own allocator's figures and sites, or with
    --allocator vramkit vramkit's cuda:0 pool holding the same tensors (128 MiB at the peak)."""
    pytest.importorskip("torch")
    import re
    import subprocess
    import sys

    from conftest import subprocess_env

    script = tmp_path / "gpu_script.py"
    script.write_text(RUN_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "vramkit", "run", "--allocator", allocator, str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    heading = "PyTorch's caching allocator" if allocator == "torch" else "vramkit's pool"
    section = out[out.index(f"=== cuda:0: {heading} ==="):]
    assert "Peak allocated: 128.0 MiB" in section
    if allocator == "torch":
        assert f"PEAK {128 * MiB}" in out  # torch's own counter agrees
    assert re.search(r"64\.0 MiB\s+64\.0 MiB\s+1\s+gpu_script\.py:5 in weights", section), section
    assert (tmp_path / "vramkit-snapshot-cuda0.pickle").exists() and (tmp_path / "vramkit-timeline-cuda0.html").exists()
