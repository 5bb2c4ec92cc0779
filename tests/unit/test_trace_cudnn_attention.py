"""cuDNN attention on a meta capture (issue 34): when torch prefers it, what its backward's
workspace takes, and the attention-mask layout that sends a call to the math path.

The expected figures are an H200's (torch 2.11.0+cu130, cuDNN 9.19.0, sm_90), read with
``benchmarks/gpu/attention_probe.py`` and ``benchmarks/gpu/predict_vs_gpu.py`` on 2026-11-28
(``benchmarks/gpu/results/h200-2026-11-28/``): torch's own choice (``torch._fused_sdp_choice``)
and the allocator's history of each call.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import vramkit.trace as vt  # noqa: E402
from vramkit.trace.formats.file_format import ALLOC  # noqa: E402
from vramkit.trace.capturing.sdpa_rules import cuda_backend, cudnn_preferred  # noqa: E402
from vramkit.trace.target.dispatch import CudaChoices  # noqa: E402

H200 = (9, 0)
CUDNN_9_19 = 91900

# name: (batch, query heads, key/value heads, sequence, head size, dtype, causal, additive mask with grad),
# torch's choice on the H200, and the cuDNN backward's workspace there (bytes, None: not cuDNN).
PROBED = {
    "bf16 causal d64": ((4, 16, 16, 512, 64, torch.bfloat16, True, False), "cudnn", 8_519_936),
    "bf16 causal d128": ((4, 16, 16, 512, 128, torch.bfloat16, True, False), "cudnn", 16_908_544),
    "bf16 causal d128 s2048": ((2, 16, 16, 2048, 128, torch.bfloat16, True, False), "cudnn", 33_816_832),
    "bf16 causal GQA 16/4 d64": ((4, 16, 4, 512, 64, torch.bfloat16, True, False), "cudnn", 16_908_544),
    "bf16 causal GQA 14/2 d64 s1024": ((4, 14, 2, 1024, 64, torch.bfloat16, True, False), "cudnn", 29_589_760),
    "fp16 causal d64": ((4, 12, 12, 512, 64, torch.float16, True, False), "cudnn", 6_390_016),
    "bf16 bias-with-grad d64": ((8, 8, 8, 256, 64, torch.bfloat16, False, True), "efficient", None),
    "fp32 bias-with-grad d64": ((8, 8, 8, 256, 64, torch.float32, False, True), "efficient", None),
    "fp32 plain d64": ((4, 12, 12, 512, 64, torch.float32, False, False), "efficient", None),
}


def inputs(shape, device="meta"):
    b, hq, hkv, s, d, dtype, causal, bias = shape
    q = torch.empty(b, hq, s, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.empty(b, hkv, s, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.empty(b, hkv, s, d, dtype=dtype, device=device, requires_grad=True)
    mask = torch.empty(1, hq, s, s, dtype=dtype, device=device, requires_grad=True) if bias else None
    return q, k, v, mask, causal, hq != hkv


@pytest.mark.parametrize("name", list(PROBED))
def test_backend_is_the_one_torch_chose_on_the_h200(name):
    shape, chosen, _ = PROBED[name]
    q, k, v, mask, causal, gqa = inputs(shape)
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, H200, grad=True, cudnn=CUDNN_9_19) == chosen


def test_cudnn_preference_follows_version_architecture_and_environment(monkeypatch):
    q, k, v, mask, causal, gqa = inputs(PROBED["bf16 causal d64"][0])
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, H200, grad=True, cudnn=91500) == "flash"  # not above 9.15.0
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, (8, 0), grad=True, cudnn=CUDNN_9_19) == "flash"  # an A100
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, (10, 0), grad=True, cudnn=CUDNN_9_19) == "cudnn"  # sm100
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, H200, grad=True, cudnn=None) == "flash"  # no cuDNN
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not cudnn_preferred(H200, CUDNN_9_19)
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, H200, grad=True, cudnn=CUDNN_9_19) == "flash"


def test_cudnn_refusals():
    q, k, v, _, causal, gqa = inputs(PROBED["bf16 causal d64"][0])
    # dropout not a multiple of 1/16 (0.1): the next backend
    assert cuda_backend(q, k, v, None, 0.1, causal, gqa, H200, grad=True, cudnn=CUDNN_9_19) == "flash"
    assert cuda_backend(q, k, v, None, 0.125, causal, gqa, H200, grad=True, cudnn=CUDNN_9_19) == "cudnn"
    # cuDNN 9.11-9.13 take no dropout at all
    assert cuda_backend(q, k, v, None, 0.125, causal, gqa, H200, grad=True, cudnn=91300) == "flash"
    # head size 256: above cuDNN 9.19's 128; above 9.22 forward and backward take 256
    q2, k2, v2, _, _, _ = inputs((2, 4, 4, 128, 256, torch.bfloat16, True, False))
    assert cuda_backend(q2, k2, v2, None, 0.0, True, False, H200, grad=True, cudnn=CUDNN_9_19) == "flash"
    assert cuda_backend(q2, k2, v2, None, 0.0, True, False, H200, grad=True, cudnn=92300) == "cudnn"
    # head size 160 above 9.22: a forward, but no backward (check_cudnn_d256_bprop_head_dim)
    q3, k3, v3, _, _, _ = inputs((2, 4, 4, 128, 160, torch.bfloat16, True, False))
    assert cuda_backend(q3, k3, v3, None, 0.0, True, False, H200, grad=True, cudnn=92300) == "flash"
    assert cuda_backend(q3, k3, v3, None, 0.0, True, False, H200, grad=False, cudnn=92300) == "cudnn"


def test_a_mask_with_a_strided_last_dim_sends_the_call_to_math():
    """T5's relative position bias, permuted from (query, key, heads) to (1, heads, query, key):
    on the H200 its self-attention ran the math path, its cross-attention (a contiguous mask)
    the memory-efficient one."""
    b, h, s, d = 8, 8, 256, 64
    q, k, v = (torch.empty(b, s, h, d, device="meta").transpose(1, 2) for _ in range(3))
    bias = torch.empty(s, s, h, device="meta", requires_grad=True).permute(2, 0, 1).unsqueeze(0)
    assert bias.stride(-1) != 1
    assert cuda_backend(q, k, v, bias, 0.1, False, False, H200, grad=True, cudnn=CUDNN_9_19) == "math"
    assert cuda_backend(q, k, v, bias.contiguous(), 0.1, False, False, H200, grad=True, cudnn=CUDNN_9_19) == "efficient"


def workspaces_of(shape) -> tuple[list[int], vt.Trace]:
    def build():
        q, k, v, mask, causal, gqa = inputs(shape, device=None)  # (on the capture's device)

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                   enable_gqa=gqa)
            out.backward(torch.ones_like(out))

        return step

    trace = vt.capture(build, device="meta", steps=1, cuda=CudaChoices(arch=H200, cudnn=CUDNN_9_19))
    sizes = [int(trace.size[j]) for j in range(len(trace.kind)) if trace.kind[j] == ALLOC
             and trace.ops[trace.alloc_op[trace.id[j]]].startswith("cudnn attention workspace")]
    return sizes, trace


@pytest.mark.parametrize("name", [n for n, (_, chosen, _) in PROBED.items() if chosen == "cudnn"])
def test_cudnn_backward_workspace_is_the_h200s(name):
    shape, _, workspace = PROBED[name]
    sizes, trace = workspaces_of(shape)
    assert sizes == [workspace]
    assert "cudnn_attention_workspaces" in trace.meta["estimated_bytes"]


def test_no_cudnn_workspace_where_another_backend_runs():
    sizes, trace = workspaces_of(PROBED["fp32 plain d64"][0])
    assert sizes == []
    assert "cudnn_attention_workspaces" not in trace.meta.get("estimated_bytes", {})


# T5-small (d_model 512, 6+6 layers, 8 heads), batch 8, sequence 256, fp32, AdamW, two steps on the
# H200 with transformers 5.17, whose create_position_bias_mask hands SDPA the permuted bias as it
# is: torch.cuda.max_memory_allocated / max_memory_reserved. Before the mask-layout rule vramkit
# predicted 2,811,225,088 B allocated (0.869).
T5_REAL_ALLOCATED = 3_236_471_296
T5_REAL_RESERVED = 3_556_769_792


def test_t5_with_a_permuted_position_bias_is_predicted_within_one_percent(monkeypatch):
    transformers = pytest.importorskip("transformers")
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    if not hasattr(sdpa, "create_position_bias_mask"):
        pytest.skip("this transformers builds no position-bias mask for SDPA")

    def as_in_5_17(position_bias, attention_mask, is_causal, query, key):
        # transformers 5.17: the mask keeps the bias's layout (later versions make it contiguous)
        min_dtype = torch.finfo(key.dtype).min
        if attention_mask is None:
            if not is_causal:
                return position_bias
            ql, kl = query.shape[2], key.shape[2]
            causal = (torch.arange(ql, device=key.device)[:, None] >= torch.arange(kl, device=key.device)[None, :])
            return torch.where(causal.view(1, 1, ql, kl), position_bias, min_dtype)
        if attention_mask.dtype == torch.bool:
            return torch.where(attention_mask, position_bias, min_dtype)
        return position_bias + attention_mask

    monkeypatch.setattr(sdpa, "create_position_bias_mask", as_in_5_17)
    cfg = transformers.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
                                decoder_start_token_id=0, pad_token_id=0)

    def build():
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, cfg.vocab_size, (8, 256))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    profile = vt.gpu_profile("H200-141GB")
    pred = vt.replay(vt.capture(build, device="meta", steps=2, cuda=profile.cuda_choices()), gpu=profile)
    assert abs(pred.peak_allocated / T5_REAL_ALLOCATED - 1) < 0.01, pred.peak_allocated
    assert abs(pred.peak_reserved / T5_REAL_RESERVED - 1) < 0.02, pred.peak_reserved
