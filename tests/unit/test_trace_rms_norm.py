"""``nn.RMSNorm`` in a meta capture for a GPU (``CudaChoices.rms_norm``, issue 34): CUDA runs
``_fused_rms_norm``, one kernel that allocates the output and one float32 ``rstd`` per row,
saves the input, ``rstd`` and the weight, and whose backward allocates the two gradients; on
meta and CPU the op decomposes and saves a float32 copy and the normalized product besides."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vramkit import trace as vt  # noqa: E402

B, T, C = 4, 128, 256


def norm_step(dtype=torch.bfloat16):
    def build():
        torch.manual_seed(0)
        norm = torch.nn.Sequential(torch.nn.RMSNorm(C, dtype=dtype))  # (the norm's path: "0")
        x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)

        def step():
            norm(x).float().sum().backward()

        return step

    return build


def _allocations(trace: vt.Trace, module: str) -> list[tuple[str, int]]:
    """(op, bytes) of every allocation a module made in the step (not its parameters), in order."""
    out = []
    parameter = vt.CATEGORIES.index("parameter")
    for i in range(len(trace.alloc_size)):
        if trace.alloc_category[i] == parameter:
            continue
        if trace.alloc_module[i] >= 0 and trace.modules[trace.alloc_module[i]].startswith(module):
            out.append((trace.ops[trace.alloc_op[i]], int(trace.alloc_size[i])))
    return out


def test_rms_norm_allocates_what_cudas_fused_kernel_does():
    trace = vt.capture(norm_step(), device="meta", steps=1)
    made = [size for _, size in _allocations(trace, "0")]
    # by hand: the forward's output (B*T*C bf16) and rstd (B*T float32); the backward's input
    # and weight gradients (bf16)
    assert made == [B * T * C * 2, B * T * 4, B * T * C * 2, C * 2], made
    assert trace.meta["cuda_choices"]["rms_norm"] is True


def test_the_decomposition_holds_more_and_is_what_a_cpu_run_allocates():
    choices = vt.gpu_profile("H100-80GB").cuda_choices()
    fused = vt.capture(norm_step(), device="meta", steps=1, cuda=choices)
    decomposed = vt.capture(norm_step(), device="meta", steps=1, cuda=dataclasses.replace(choices, rms_norm=False))
    cpu = vt.capture(norm_step(), device="cpu", steps=1)
    # off, the meta capture takes the CPU's path, allocation for allocation
    assert np.array_equal(decomposed.alloc_size, cpu.alloc_size)
    gpu = "1GiB"
    held = {name: vt.replay(t, gpu, overheads=vt.NO_OVERHEADS).peak_allocated
            for name, t in (("fused", fused), ("decomposed", decomposed))}
    # the decomposition's float32 copy of the input (2x its bf16 bytes) at least is never made
    assert held["decomposed"] - held["fused"] >= 2 * B * T * C * 2, held


def test_a_weight_of_another_dtype_takes_the_composite_as_on_cuda():
    def build():
        norm = torch.nn.Sequential(torch.nn.RMSNorm(C))  # float32 weight
        x = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
        return lambda: norm(x).float().sum().backward()

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns once that it cannot fuse mismatched dtypes
        trace = vt.capture(build, device="meta", steps=1)
    ops = {op for op, _ in _allocations(trace, "0")}
    assert "aten::pow" in ops and "aten::empty_like" not in ops, ops


def test_a_compiled_rms_norm_is_left_to_inductor():
    """Inside a torch.compile'd region dynamo traces the op on fake tensors: the composite, and
    the compiled graph's buffers are inductor's (issue 33), not the eager kernel's."""
    def build():
        torch.manual_seed(0)
        norm = torch.nn.Sequential(torch.nn.RMSNorm(C, dtype=torch.bfloat16))
        x = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
        compiled = torch.compile(norm)
        return lambda: compiled(x).float().sum().backward()

    torch._dynamo.reset()
    trace = vt.capture(build, device="meta", steps=1)
    [region] = trace.meta["compiled_regions"]
    assert region["how"] == "compiled" and region["fused"] is True and region["graphs"] == 2
