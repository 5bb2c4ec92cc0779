"""gpu/attention_probe — which attention backend this GPU's torch picks, and what each one allocates.

For a set of attention shapes a training step meets (bf16 causal self-attention at head sizes 64
and 128, grouped-query attention, an additive mask that requires grad as T5's position biases
do, fp32), on this GPU:

* the backend ``torch._fused_sdp_choice`` names (torch's own ``select_sdp_backend``), and the
  aten ops that ``F.scaled_dot_product_attention`` dispatches to in forward and in backward;
* for the default choice and for each backend forced with ``torch.nn.attention.sdpa_kernel``:
  every allocation and free of torch's allocator during forward and during backward (sizes in
  order, from its recorded history), or the error when the backend refuses the inputs.

The JSON (``--out DIR``/attention_probe.json) is read without a GPU, against vramkit's capture
of the same attention on meta with that GPU's CUDA choices (issue 34: cuDNN attention, which
newer torch prefers on sm90/sm100; each backend's backward temporaries).

    python benchmarks/gpu/attention_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

SHAPES = {
    # name: (batch, query heads, key/value heads, sequence, head size, dtype, causal, additive mask with grad)
    "bf16 causal d64": (4, 16, 16, 512, 64, "bfloat16", True, False),
    "bf16 causal d128": (4, 16, 16, 512, 128, "bfloat16", True, False),
    "bf16 causal d128 s2048": (2, 16, 16, 2048, 128, "bfloat16", True, False),
    "bf16 causal GQA 16/4 d64": (4, 16, 4, 512, 64, "bfloat16", True, False),
    "bf16 causal GQA 14/2 d64 s1024": (4, 14, 2, 1024, 64, "bfloat16", True, False),
    "bf16 bias-with-grad d64": (8, 8, 8, 256, 64, "bfloat16", False, True),
    "fp32 bias-with-grad d64": (8, 8, 8, 256, 64, "float32", False, True),
    "fp32 plain d64": (4, 12, 12, 512, 64, "float32", False, False),
    "fp16 causal d64": (4, 12, 12, 512, 64, "float16", True, False),
}
MARK = 777 * 512  # a marker allocation between forward and backward, found by its size


def inputs(shape):
    import torch

    b, hq, hkv, s, d, dtype, causal, bias = shape
    dt = getattr(torch, dtype)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dt, requires_grad=True)
    mask = torch.randn(1, hq, s, s, device="cuda", dtype=dt, requires_grad=True) if bias else None
    return q, k, v, mask, causal, hq != hkv


def events_of(fn) -> list[list]:
    """[action, size] of every allocator event while fn runs (alloc, free_completed, segment_*)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, context=None, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    return [[e["action"], e["size"]] for e in trace if e["action"] in
            ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap")]


def one(shape, backend) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v, mask, causal, gqa = inputs(shape)
    kwargs = {"attn_mask": mask, "is_causal": causal, "enable_gqa": gqa}
    ops: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    result: dict = {}
    ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default" else contextlib.nullcontext()
    try:
        with ctx:
            holder = {}

            def fwd():
                holder["out"] = F.scaled_dot_product_attention(q, k, v, **kwargs)
                holder["mark"] = torch.empty(MARK, dtype=torch.uint8, device="cuda")

            def bwd():
                holder["out"].backward(torch.randn_like(holder["out"]))

            events = events_of(lambda: (fwd(), bwd()))
            holder.clear()
            with Log():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                out.backward(torch.randn_like(out))
        cut = next(i for i, e in enumerate(events) if e == ["alloc", MARK])
        result.update(forward=events[:cut], backward=events[cut + 1:],
                      ops=[o for o in ops if "attention" in o or "bmm" in o or "softmax" in o or "matmul" in o])
    except Exception as e:  # noqa: BLE001 - a backend refusing these inputs is a result
        result["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    args = parser.parse_args()
    import torch

    os.makedirs(args.out, exist_ok=True)
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                    "capability": list(torch.cuda.get_device_capability()), "gpu": torch.cuda.get_device_name(),
                    "TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
                    "shapes": {}}
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    for name, shape in SHAPES.items():
        q, k, v, mask, causal, gqa = inputs(shape)
        try:
            choice = names.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=gqa)), "?")
        except Exception as e:  # noqa: BLE001
            choice = f"error: {e}"
        del q, k, v, mask
        entry = {"shape": shape, "fused_sdp_choice": choice}
        for backend in ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            entry[backend] = one(shape, backend)
            torch.cuda.empty_cache()
        report["shapes"][name] = entry
        default_ops = sorted({o for o in entry["default"].get("ops", ()) if "attention" in o})
        print(f"{name}: choice {choice}; default ops {default_ops}", flush=True)
    with open(os.path.join(args.out, "attention_probe.json"), "w") as f:
        json.dump(report, f)
    print(json.dumps({k: report[k] for k in ("torch", "cuda", "cudnn", "capability", "gpu")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
