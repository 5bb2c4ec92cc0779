"""torch.autocast on meta captures (vramkit/trace/autocast_meta.py): the emulation with autocast's
CPU op lists against the real torch.autocast("cpu") on a CPU run, and the CUDA lists'
policies."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_models import GPTConfig, gpt_builder, resnet_builder  # noqa: E402

from vramkit import trace as vt  # noqa: E402

MODELS = {
    "gpt-sdpa": lambda amp: gpt_builder(GPTConfig(), amp=amp),
    "gpt-matmul-attention": lambda amp: gpt_builder(GPTConfig(sdpa=False), amp=amp),
    "gpt-checkpointed": lambda amp: gpt_builder(GPTConfig(checkpoint=True), amp=amp),
    "resnet": lambda amp: resnet_builder(amp=amp),
}


def canonical(t: vt.Trace) -> tuple[np.ndarray, np.ndarray]:
    """The event columns with each run of consecutive frees sorted by id. Autocast clears its
    cast cache (a C++ unordered_map keyed by TensorImpl address) at the end of the region, in
    an order that depends on addresses; nothing is allocated in between, so the order of those
    frees changes neither the peaks nor the segments."""
    kind, ids = t.kind.copy(), t.id.copy()
    i, n = 0, len(kind)
    while i < n:
        j = i
        while j < n and kind[j] == vt.FREE:
            j += 1
        if j > i:
            ids[i:j] = np.sort(ids[i:j])
            i = j
        else:
            i += 1
    return kind, ids


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch", [1, 3])
def test_meta_emulation_equals_real_cpu_autocast(name, batch):
    build = MODELS[name]("cpu")  # the step runs under torch.autocast("cpu", dtype=torch.bfloat16)
    meta = vt.capture(build, batch, device="meta", steps=2, cuda=False)  # emulated: no meta autocast in torch
    cpu = vt.capture(build, batch, device="cpu", steps=2)  # the real CPU autocast
    for a, b in zip(canonical(meta), canonical(cpu)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(meta.alloc_size, cpu.alloc_size)
    for col in ("alloc_dtype", "alloc_category", "alloc_module", "alloc_op"):
        np.testing.assert_array_equal(getattr(meta, col), getattr(cpu, col), err_msg=col)
    assert meta.dtypes == cpu.dtypes and "bfloat16" in meta.dtypes
    a = vt.replay(meta, "1GiB", overheads=vt.NO_OVERHEADS)
    b = vt.replay(cpu, "1GiB", overheads=vt.NO_OVERHEADS)
    assert (a.peak_allocated, a.peak_reserved) == (b.peak_allocated, b.peak_reserved)
    # And autocast changed something: the fp32 step allocates differently.
    plain = vt.capture(MODELS[name](None), batch, device="meta", steps=2)
    assert vt.peak_live_bytes(plain) != vt.peak_live_bytes(meta)


def dtypes_by_op(t: vt.Trace) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for i in range(t.num_allocations):
        out.setdefault(t.name_of("ops", int(t.alloc_op[i])), set()).add(t.name_of("dtypes", int(t.alloc_dtype[i])))
    return out


def test_cuda_lists_on_meta():
    cfg = GPTConfig(seq=128, dim=128)
    t = vt.capture(gpt_builder(cfg, amp="cuda"), 4, device="meta", steps=2)
    ops = dtypes_by_op(t)
    assert ops["aten::addmm"] == {"bfloat16"}  # linear: lower precision
    # cuDNN attention, as an H100 with torch 2.11's cuDNN 9.19 runs bf16 attention (flash below
    # cuDNN 9.15.1): the output in bfloat16, its log-sum-exp row in float32, the philox seed and
    # offset (int64).
    assert ops["aten::_scaled_dot_product_cudnn_attention"] == {"bfloat16", "float32", "int64"}
    assert ops["aten::native_layer_norm"] == {"float32"}  # layer_norm: fp32 on CUDA (not on CPU)
    assert "float32" in ops["aten::_log_softmax"]  # cross_entropy: fp32
    # Parameters are cast once per region (the cast cache), not once per use.
    casts = sum(1 for i in range(t.num_allocations) if t.name_of("ops", int(t.alloc_op[i])) == "aten::_to_copy"
                and t.name_of("dtypes", int(t.alloc_dtype[i])) == "bfloat16"
                and vt.PHASES[int(t.phase_at()[t.alloc_index[i]])] == "forward")
    lowered = [p for n, p in _gpt_params(cfg) if n.endswith(("qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
                                                              "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
                                                              "mlp.2.bias", "head.weight"))]
    # fp32 activations cast: the inputs of qkv and mlp.0 (layer norm outputs, fp32 on CUDA) in
    # every layer, and of the head; proj and mlp.2 get bfloat16 inputs already.
    activations_cast = 2 * cfg.layers + 1
    assert casts == 2 * (len(lowered) + activations_cast), casts  # two steps
    # Mixed precision lowers the activation peak of a big enough batch.
    plain = vt.capture(gpt_builder(cfg), 16, device="meta", steps=2)
    amp = vt.capture(gpt_builder(cfg, amp="cuda"), 16, device="meta", steps=2)
    assert vt.peak_live_bytes(amp) < vt.peak_live_bytes(plain)


def _gpt_params(cfg):
    from trace_models import GPT

    with torch.device("meta"):
        return list(GPT(cfg).named_parameters())


def test_capture_autocast_option_wraps_the_forward():
    cfg = GPTConfig()
    option = vt.capture(gpt_builder(cfg), 2, device="meta", steps=2, autocast=torch.bfloat16)
    written = vt.capture(gpt_builder(cfg, amp="cuda", amp_loss=False), 2, device="meta", steps=2)
    for a, b in zip(canonical(option), canonical(written)):
        np.testing.assert_array_equal(a, b)
    assert option.meta["autocast"] == "bfloat16"
    with pytest.raises(ValueError, match="autocast must be torch.bfloat16, torch.float16 or None"):
        vt.capture(gpt_builder(cfg), 2, autocast="bf16")


def test_autocast_is_restored_after_a_capture():
    from torch.amp import autocast_mode

    before = (autocast_mode.autocast.__init__, autocast_mode.autocast.__enter__, autocast_mode.autocast.__exit__)

    def raising(batch_size):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            raise RuntimeError("inside the region")

    with pytest.raises(vt.CaptureError, match="inside the region"):
        vt.capture(raising, 1, device="meta")
    vt.capture(gpt_builder(GPTConfig(), amp="cuda"), 1, device="meta")
    after = (autocast_mode.autocast.__init__, autocast_mode.autocast.__enter__, autocast_mode.autocast.__exit__)
    assert before == after
    x = torch.randn(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the real CPU autocast still works
        assert (x @ x).dtype == torch.bfloat16
