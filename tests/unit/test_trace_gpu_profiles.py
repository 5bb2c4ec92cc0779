"""GPU profiles (vramkit.trace.target.gpu_profiles) and the line items a replay adds: a profile sets
the capacity, the CUDA context, the cuBLAS workspaces and the architecture of the capture's
dispatch choices; a PyTorch snapshot recorded on a GPU gets no workspace it already holds."""

from __future__ import annotations

import pytest

import vramkit.trace as vt
from vramkit.trace.target.gpu_profiles import PROFILES, GpuProfile, gpu_profile
from vramkit.trace.formats.snapshot_import import from_torch_snapshot

MiB = 1 << 20

from torch_snapshots import alloc, block, free, live, segment, segment_alloc, snapshot

HOPPER_WS = 4096 * 8 * 1024  # CublasHandlePool.cpp: 32 MiB on compute capability 9.x
OTHER_WS = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" elsewhere
HOPPER_LT = 1 << 20  # cuBLASLt's own workspace, seen on an H200 at the first fp32 Linear with a bias
HOPPER_CONTEXT = 685 << 20  # outside the allocator after the first matmul, measured on an H200


@pytest.mark.parametrize("name, expected", [
    ("H100-80GB", "H100-80GB"), ("h100", "H100-80GB"), ("A100_40GB", "A100-40GB"), ("a100-80gb", "A100-80GB"),
    ("l4", "L4"), ("RTX-4090", "RTX-4090"), ("rtx4090", "RTX-4090"),
    ("h200", "H200-141GB"),
])
def test_profile_names(name, expected):
    assert gpu_profile(name).name == expected


def test_profile_facts():
    h100, a100, l4 = PROFILES["H100-80GB"], PROFILES["A100-40GB"], PROFILES["L4"]
    assert h100.compute_capability == (9, 0) and h100.bf16 and h100.flash_attention
    assert h100.cublas_workspace == 2 * HOPPER_WS and h100.cublaslt_workspace == HOPPER_LT  # forward's, autograd's
    assert h100.cuda_context == PROFILES["H200-141GB"].cuda_context == HOPPER_CONTEXT
    assert a100.capacity == 42_505_273_344 and a100.cublas_workspace == 2 * OTHER_WS
    assert l4.compute_capability == (8, 9) and l4.cuda_choices().arch == (8, 9)
    old = GpuProfile("T4", 15 << 30, (7, 5))
    assert not old.bf16 and not old.flash_attention
    for p in PROFILES.values():  # below the marketing size, as totalGlobalMem is
        marketed = int(p.name.split("-")[-1].rstrip("GB")) if p.name[-2:] == "GB" else 24
        assert 0.9 * marketed * 1e9 < p.capacity < marketed * (1 << 30) or p.name == "L4"


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="H100-80GB, H200-141GB, A100-80GB"):
        gpu_profile("B200")
    with pytest.raises(ValueError, match="A100-80GB or A100-40GB"):
        gpu_profile("a100")  # two sizes: no guess
    with pytest.raises(TypeError):
        gpu_profile(80)


def test_current_without_a_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert gpu_profile("current").capacity == torch.cuda.get_device_properties(0).capacity
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            gpu_profile("current")


def eight_mib_snapshot() -> dict:
    """One 8 MiB block allocated and freed, as a GPU run records it."""
    a = 0x7F00_0000_0000
    return snapshot([[segment_alloc(a, 8 * MiB), alloc(a, 8 * MiB), free(a, 8 * MiB)]],
                    [segment(a, [block(8 * MiB)])])


def test_a_recorded_gpu_snapshot_gets_no_workspace_line_item():
    t = from_torch_snapshot(eight_mib_snapshot())
    for gpu in ("80GiB", vt.resolve_target("H100-80GB", capacity="80GiB")):
        pred = vt.replay(t, gpu)
        assert pred.peak_allocated == 8 * MiB  # not 8 MiB + the cuBLAS workspace
        assert pred.overheads.cublas_workspace == pred.overheads.cublaslt_workspace == 0
        assert pred.overheads.cuda_context == vt.resolve_target(gpu).overheads.cuda_context  # (outside: kept)
    # A workspace the caller sets is kept, even for a GPU recording.
    pred = vt.replay(t, "80GiB", overheads={"cublas_workspace": 4 * MiB})
    assert pred.peak_allocated == 12 * MiB


def test_a_capture_gets_the_profiles_line_items():
    torch = pytest.importorskip("torch")

    def build():
        w = torch.empty(1 << 20)

        def step():
            (w * 2).sum()

        return step

    t = vt.capture(build, device="meta")
    bare = vt.replay(t, "80GiB", overheads=vt.NO_OVERHEADS)
    h100 = vt.replay(t, gpu="H100-80GB")
    assert h100.capacity == PROFILES["H100-80GB"].capacity
    assert h100.usable == h100.capacity - HOPPER_CONTEXT  # the CUDA context, outside the allocator
    assert h100.peak_allocated == bare.peak_allocated + 2 * HOPPER_WS + HOPPER_LT
    l4 = vt.replay(t, vt.resolve_target("L4", capacity="20GiB"))  # a capacity given overrides the profile's
    assert l4.capacity == 20 << 30 and l4.peak_allocated == bare.peak_allocated + 2 * OTHER_WS
    with pytest.raises(vt.TargetError, match="say which GPU: gpu=NAME"):
        vt.replay(t, None)
