"""The temporaries CUDA's attention backward kernels make, on a meta capture (sdpa_backward_cuda)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import vramkit.trace as vt  # noqa: E402
from vramkit.trace.capturing.cuda_choices import CudaChoices  # noqa: E402
from vramkit.trace.capturing.sdpa_backward_cuda import (  # noqa: E402
    efficient_kernel,
    efficient_workspace_bytes,
    flash_buffers,
)

H100 = (9, 0)
HISTORY = Path("gpu-histories/h100-2026-11-27/sdpa_fp32_learned_bias.pickle")
# max_memory_allocated of that recording (its README.md): two steps of `sdpa_step` on one H100
# 80GB HBM3, torch 2.11.0+cu130. Before sdpa_backward_cuda a meta capture predicted 387,188,736.
REAL_MAX_ALLOCATED = 421_571_072


def history_file() -> Path | None:
    root = Path(__file__).resolve().parents[2]  # the repository (or worktree) root
    for shared in (root.parent / "shared", Path("/work/shared")):
        if (shared / HISTORY).is_file():
            return shared / HISTORY
    return None


def sdpa_step():
    """The recorded step (README.md beside the history): fp32, an additive bias that requires
    grad, dropout; the memory-efficient backend on an H100."""
    torch.manual_seed(0)
    B, H, L, D = 16, 8, 512, 64
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    bias = torch.nn.Parameter(torch.zeros(1, H, L, L))

    def step():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(B, H, L, L),
                                                             dropout_p=0.1)
        o.sum().backward()

    return step


def capture_sdpa_step() -> vt.Trace:
    return vt.capture(sdpa_step, device="meta", steps=2, cuda=vt.gpu_profile("H100-80GB").cuda_choices())


def test_shared_history_step_is_predicted_within_one_percent():
    if history_file() is None:
        pytest.skip(f"the recorded H100 history ({HISTORY}) is not beside the repository")
    pred = vt.replay(capture_sdpa_step(), vt.gpu_profile("H100-80GB"))
    assert abs(pred.peak_allocated / REAL_MAX_ALLOCATED - 1) < 0.01, pred.peak_allocated


def real_second_backward_allocations(path: Path) -> list[int]:
    """The allocations the recorded run made in its second step's backward: those without a
    Python frame (autograd's thread) after the second `_make_grads` (backward's first
    allocation, the ones-like gradient of the loss), up to the next one with a frame."""
    from vramkit.report.sites import device_trace
    from vramkit.trace.formats.snapshot_import import read_snapshot_file

    snap, _ = read_snapshot_file(str(path))
    events = [e for e in device_trace(snap, 0) if e["action"] == "alloc"]
    starts = [i for i, e in enumerate(events) if any(f.get("name") == "_make_grads" for f in e.get("frames") or [])]
    assert len(starts) == 2, starts  # two steps
    sizes = []
    for e in events[starts[1] + 1:]:
        if e.get("frames"):
            break
        sizes.append(int(e["size"]))
    return sizes


def captured_second_backward_allocations(t: vt.Trace) -> list[int]:
    step = phase = -1
    sizes = []
    for i in range(t.num_events):
        kind = int(t.kind[i])
        if kind == vt.STEP:
            step = int(t.id[i])
        elif kind == vt.PHASE:
            phase = int(t.id[i])
        elif kind == vt.ALLOC and step == 1 and vt.PHASES[phase] == "backward":
            sizes.append(int(t.size[i]))
    return sizes


def test_backward_allocations_match_the_recorded_run_in_size_and_order():
    path = history_file()
    if path is None:
        pytest.skip(f"the recorded H100 history ({HISTORY}) is not beside the repository")
    real = real_second_backward_allocations(path)
    MiB = 1 << 20
    # grad_out copy, grad_q/k/v, grad_bias, delta's product, row sums and delta, the workspace,
    # and bias.grad's reduction to (1, H, L, L): read off the recording, not from our formulas
    assert real == [16 * MiB, 16 * MiB, 16 * MiB, 16 * MiB, 128 * MiB, 16 * MiB, 256 << 10, 256 << 10, 16_793_600,
                    8 * MiB]
    assert captured_second_backward_allocations(capture_sdpa_step()) == real


def test_with_attention_off_the_backward_makes_only_its_gradients():
    t = vt.capture(sdpa_step, device="meta", steps=2, cuda=CudaChoices(attention=False, arch=H100))
    ops = {t.name_of("ops", int(t.alloc_op[i])) for i in range(t.num_allocations)}
    assert not any("efficient_attention" in op for op in ops)  # the CPU's chooser: math on CPU


# ------------------------------------------------------------------------------------ flash


def test_flash_buffers_on_a_hand_computed_example():
    # bf16, no mask, sm90: B=2, H=16, L=1000, D=64
    b, h, L, d = 2, 16, 1000, 64
    bufs = flash_buffers(b, h, h, L, L, d, torch.bfloat16)
    assert [(name, shape, dtype) for name, shape, dtype in bufs] == [
        ("softmax_d", (2, 16, 1024), torch.float32),  # rows rounded up to 128
        ("dq_accum", (2, 1024, 16, 64), torch.float32)]  # head size 64 is already a multiple of 32
    nbytes = [torch.Size(shape).numel() * 4 for _, shape, _ in bufs]
    assert nbytes == [131_072, 8_388_608]
    # head size 72 (padded from 66..72) rounds to 96 in dq_accum; 160 to 192 (multiples of 64 above 128)
    assert flash_buffers(b, h, h, L, L, 72, torch.bfloat16)[1][1] == (2, 1024, 16, 96)
    assert flash_buffers(b, h, h, L, L, 160, torch.bfloat16)[1][1] == (2, 1024, 16, 192)
    # grouped-query attention (4 key/value heads): dk and dv made for all 16 heads, in bf16
    gqa = flash_buffers(b, h, 4, L, L, d, torch.bfloat16)
    assert gqa[2:] == [("dk_expanded", (2, 1000, 16, 64), torch.bfloat16),
                       ("dv_expanded", (2, 1000, 16, 64), torch.bfloat16)]
    # deterministic: one zeroed dq_accum per split
    assert flash_buffers(b, h, h, L, L, d, torch.bfloat16, deterministic=True, splits=5)[1][1] == (5, 2, 1024, 16, 64)


def flash_builder(contiguous_grad: bool):
    def build():
        torch.manual_seed(0)
        b, h, L, d = 2, 4, 64, 32
        q, k, v = (torch.randn(b, h, L, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def step():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            # a (B, L, H*D) layout, as a model's out projection reads it, or o.sum()'s expanded grad
            (o.transpose(1, 2).reshape(b, L, h * d).float().square().mean() if contiguous_grad
             else o.sum()).backward()

        return step

    return build


def backward_ops(t: vt.Trace) -> list[tuple[str, int]]:
    phase = t.phase_at()
    backward = vt.PHASES.index("backward")
    return [(t.name_of("ops", int(t.alloc_op[t.id[i]])), int(t.size[i])) for i in range(t.num_events)
            if t.kind[i] == vt.ALLOC and phase[i] == backward]


@pytest.mark.parametrize("contiguous_grad", [True, False])
def test_flash_backward_on_an_h100_makes_its_float32_accumulators(contiguous_grad):
    # cuDNN 9.10 (torch's CUDA 12 wheels): flash first (above 9.15.0 cuDNN's attention is)
    t = vt.capture(flash_builder(contiguous_grad), device="meta", steps=1, cuda=CudaChoices(arch=H100, cudnn=91000))
    b, h, L, d = 2, 4, 64, 32
    ops = backward_ops(t)
    grads = [i for i, (op, _) in enumerate(ops) if op == "aten::_scaled_dot_product_flash_attention_backward"]
    assert len(grads) == 3
    after = ops[grads[-1] + 1:grads[-1] + 3]
    assert after == [("aten::empty", b * h * 128 * 4), ("aten::empty", b * 128 * h * 32 * 4)]
    copies = [size for op, size in ops[:grads[0]] if op == "aten::clone"]
    assert copies == ([] if contiguous_grad else [b * L * h * d * 2])  # grad_out made contiguous


# --------------------------------------------------------------------------- memory-efficient


def test_efficient_workspace_of_the_recorded_step():
    # fp32 on an H100: the 64x64 kernel for head size 64; no grad_k/grad_v staging (fp32 output),
    # grad_q's tiles: 512 / 64 row blocks, one column block, 4 header + 64 * 64 floats each
    kernel = efficient_kernel(torch.float32, H100, 64, dropout=True)
    assert (kernel.block_i, kernel.block_j, kernel.max_k, kernel.computes_delta) == (64, 64, 64, False)
    assert efficient_workspace_bytes(kernel, 16, 8, 512, 512, 64, 64) == 16 * 8 * 8 * (4 + 64 * 64) * 4 == 16_793_600


def test_efficient_workspace_for_half_precision():
    # bf16 head 128 on an H100: the 128x128 kernel keeps grad_k/grad_v in registers, so only grad_q's tiles
    k = efficient_kernel(torch.bfloat16, H100, 128, dropout=False)
    assert (k.block_i, k.block_j, k.output_in_rf, k.computes_delta) == (128, 128, True, True)
    assert efficient_workspace_bytes(k, 2, 4, 256, 256, 128, 128) == 2 * 4 * (2 * 1 * (4 + 128 * 128)) * 4
    # on an sm89 (less shared memory) the 64x64 kernel: grad_k and grad_v staged in float32,
    # split over keys: ceil(256 / 64) = 4 splits, capped at 200 // (2 * 4) = 25
    k = efficient_kernel(torch.bfloat16, (8, 9), 128, dropout=False)
    assert (k.block_i, k.block_j, k.output_in_rf) == (64, 64, False)
    per_head = 4 * 64 * 128 * 2 + 4 * 2 * (4 + 64 * 64)
    assert efficient_workspace_bytes(k, 2, 4, 256, 256, 128, 128) == 2 * 4 * per_head * 4
    assert efficient_workspace_bytes(k, 2, 4, 256, 256, 128, 128, deterministic=True) == \
        2 * 4 * (64 * 128 * 2 + 4 * 2 * (4 + 64 * 64)) * 4


# -------------------------------------------------------------------------------------- cuDNN


@pytest.mark.parametrize("contiguous_grad", [True, False])
def test_cudnn_backward_re_lays_out_a_grad_out_whose_last_dim_is_strided(contiguous_grad):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        t = vt.capture(flash_builder(contiguous_grad), device="meta", steps=1, cuda=CudaChoices(arch=H100))
    b, h, L, d = 2, 4, 64, 32
    ops = backward_ops(t)
    grads = [i for i, (op, _) in enumerate(ops) if op == "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert len(grads) == 3
    # o.sum()'s gradient is expanded (stride 0 everywhere): copied into out's layout, live beside
    # dq, dk, dv and the plan's workspace (made here just before them; the kernel makes it just after)
    relaid = [i for i, (op, _) in enumerate(ops) if op == "aten::empty_like"]
    if contiguous_grad:
        assert relaid == []
    else:
        assert relaid == [grads[0] - 1] and ops[relaid[0]] == ("aten::empty_like", b * h * L * d * 2)
    # then the workspace (cudnn_attention; H200-measured sizes in test_trace_cudnn_attention.py)
    assert ops[grads[-1] + 1][0] == "cudnn attention workspace (estimated)"
