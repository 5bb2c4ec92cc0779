"""gpu/predict_vs_gpu — vramkit's meta prediction against a real GPU's own counters.

For each case, a child Python runs two real training steps on the GPU (the model built on
cuda from nothing, torch's caching allocator fresh) and reads `torch.cuda.max_memory_allocated`
and `max_memory_reserved`; the same child captures the same builder on `meta` with the CUDA
choices of the GPU it is on (`gpu_profile("current")`) and replays it on that profile
(`vramkit.trace.replay(trace, gpu="current")`). It also records the allocator history of the
real run (a memory_viz snapshot, python stacks) so that a difference can be read afterwards
without a GPU.

Cases: Hugging Face models from their configs with random weights (GPT-2 124M, BERT-base, a
Llama of 8 layers at width 1024 with grouped-query attention, fp32 and bf16 autocast, ViT-B/16,
ResNet-50), and the bundled 1.3B GPT (examples/gpt_fit.py: fp32, bf16 autocast, checkpointed).

    PYTHONPATH=python python benchmarks/gpu/predict_vs_gpu.py [--quick] [--out DIR]

Also measured once: what the CUDA context and cuBLAS take outside the allocator (total - free -
reserved after the first matmul), the figure GPU profiles use as their "CUDA context" line.
Needs a CUDA GPU and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def hf_builder(name: str, batch: int, amp: bool, compile_mode: str | None = None):
    """batch's training step (AdamW) of a Hugging Face model built from its config; with
    `compile_mode`, the model is ``torch.compile(model, mode=compile_mode)``d ("default" for none)."""
    import torch
    import transformers as T

    configs = {
        "gpt2": (T.GPT2LMHeadModel, lambda: T.GPT2Config(bos_token_id=0, eos_token_id=0), "lm", 512),
        "bert": (T.BertForMaskedLM, T.BertConfig, "mlm", 128),
        "llama": (T.LlamaForCausalLM, lambda: T.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                                              num_hidden_layers=8, num_attention_heads=16,
                                                              num_key_value_heads=4, vocab_size=32000), "lm", 512),
        "vit": (T.ViTForImageClassification, T.ViTConfig, "image", 0),
        "resnet": (T.ResNetForImageClassification, T.ResNetConfig, "image", 0),
        "t5": (T.T5ForConditionalGeneration, lambda: T.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8,
                                                                vocab_size=32128, decoder_start_token_id=0,
                                                                pad_token_id=0), "seq2seq", 256),
        # the shape of Qwen2-0.5B (issue 33's 0.5B causal LM)
        "qwen2-0.5b": (T.Qwen2ForCausalLM, lambda: T.Qwen2Config(hidden_size=896, intermediate_size=4864,
                                                                 num_hidden_layers=24, num_attention_heads=14,
                                                                 num_key_value_heads=2, vocab_size=151936,
                                                                 tie_word_embeddings=True), "lm", 1024),
    }
    cls, make_cfg, kind, seq = configs[name]
    cfg = make_cfg()

    def build():
        torch.manual_seed(0)
        model = cls(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        if compile_mode is not None:
            model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
        if kind == "image":
            x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 2, (batch,))
            call = lambda: model(pixel_values=x, labels=y)  # noqa: E731
        else:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            extra = {"use_cache": False} if kind == "lm" else {}
            call = lambda: model(input_ids=ids, labels=ids, **extra)  # noqa: E731

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = call().loss
            loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def gpt_builder(entry: str, batch: int):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_fit", os.path.join(REPO, "examples", "gpt_fit.py"))
    gpt_fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt_fit)
    build = getattr(gpt_fit, entry)
    return lambda: build(batch)


CASES = {
    # name: (kind, args)
    "GPT-2 124M x4 seq512": ("hf", ("gpt2", 4, False)),
    "BERT-base x16 seq128": ("hf", ("bert", 16, False)),
    "Llama 8x1024 GQA x4 seq512": ("hf", ("llama", 4, False)),
    "Llama 8x1024 GQA x4 seq512 bf16 autocast": ("hf", ("llama", 4, True)),
    "ViT-B/16 x8": ("hf", ("vit", 8, False)),
    "ResNet-50 x8": ("hf", ("resnet", 8, False)),
    "gpt_fit 1.3B x2 fp32": ("gpt", ("vramkit_step", 2)),
    "gpt_fit 1.3B x4 bf16 autocast": ("gpt", ("vramkit_step_amp", 4)),
    "gpt_fit 1.3B x8 checkpointed": ("gpt", ("vramkit_step_checkpointed", 8)),
    "T5-small x8 seq256": ("hf", ("t5", 8, False)),
}
# torch.compile'd steps (issue 33): not in the default list (each compiles twice: for the GPU, and
# for the capture on meta); run with --cases.
COMPILED = {
    "Llama 8x1024 GQA x4 seq512 bf16 autocast, compiled": ("hf", ("llama", 4, True, "default")),
    "GPT-2 124M x4 seq512, compiled": ("hf", ("gpt2", 4, False, "default")),
    "Qwen2-0.5B x8 seq1024 bf16 autocast": ("hf", ("qwen2-0.5b", 8, True)),
    "Qwen2-0.5B x8 seq1024 bf16 autocast, compiled": ("hf", ("qwen2-0.5b", 8, True, "default")),
    "Llama 8x1024 GQA x4 seq512 bf16 autocast, reduce-overhead": ("hf", ("llama", 4, True, "reduce-overhead")),
}
QUICK = ["GPT-2 124M x4 seq512", "Llama 8x1024 GQA x4 seq512 bf16 autocast", "gpt_fit 1.3B x2 fp32"]


def builder_for(case: str):
    kind, args = {**CASES, **COMPILED}[case]
    return hf_builder(*args) if kind == "hf" else gpt_builder(*args)


def run_case(case: str, out: str) -> dict:
    """In a fresh child: the real steps first (so the allocator is untouched), then the prediction."""
    import torch

    import vramkit.trace as vt

    build = builder_for(case)
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    t0 = time.perf_counter()
    with torch.device("cuda"):
        step = build()
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    real_s = time.perf_counter() - t0
    measured_alloc, measured_res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    stats = torch.cuda.memory_stats()
    safe = "".join(c if c.isalnum() else "_" for c in case)
    torch.cuda.memory._dump_snapshot(os.path.join(out, f"{safe}.pickle"))
    torch.cuda.memory._record_memory_history(None)
    del step
    if "compiled" in case or "reduce-overhead" in case:
        torch._dynamo.reset()  # the capture compiles afresh, for meta
    t0 = time.perf_counter()
    profile = vt.gpu_profile("current")
    trace = vt.capture(build, device="meta", steps=2, cuda=profile.cuda_choices())
    pred = vt.replay(trace, gpu=profile)
    capture_s = time.perf_counter() - t0
    return {"case": case, "measured_allocated": measured_alloc, "measured_reserved": measured_res,
            "predicted_allocated": pred.peak_allocated, "predicted_reserved": pred.peak_reserved,
            "predicted_by_category": pred.by_category, "compiled_regions": trace.meta.get("compiled_regions"),
            "estimated_at_peak": getattr(pred, "estimated_at_peak", None), "overheads": [list(i) for i in pred.overheads.items()],
            "num_alloc_retries": stats.get("num_alloc_retries"), "num_ooms": stats.get("num_ooms"),
            "real_s": real_s, "capture_s": capture_s, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def context_figure() -> dict:
    """Bytes the process holds on the GPU outside torch's allocator: after CUDA init, and after
    the first cuBLAS matmul (its handle), as total - free - reserved."""
    import torch

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    after_init = total - free - torch.cuda.memory_reserved()
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"total": total, "outside_after_init": after_init,
            "outside_after_matmul": total - free - torch.cuda.memory_reserved(),
            "allocated_after_matmul": torch.cuda.memory_allocated()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    parser.add_argument("--cases", help="case names separated by semicolons (default: all of the eager cases)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--context", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.case:
        print(json.dumps(run_case(args.case, args.out), default=str))
        return 0
    if args.context:
        print(json.dumps(context_figure()))
        return 0
    from children import child_env, run_children

    ctx = subprocess.run([sys.executable, __file__, "--context", "--out", args.out], capture_output=True, text=True,
                         env=child_env(), timeout=120)
    context = json.loads(ctx.stdout.strip().splitlines()[-1]) if ctx.returncode == 0 else {"error": ctx.stderr[-2000:]}
    print("context:", json.dumps(context), file=sys.stderr, flush=True)
    cases = args.cases.split(";") if args.cases else QUICK if args.quick else list(CASES)
    unknown = [c for c in cases if c not in CASES and c not in COMPILED]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES) + list(COMPILED)}")
    results = run_children(__file__, cases, ["--out", args.out], timeout=600)
    with open(os.path.join(args.out, "predict_vs_gpu.json"), "w") as f:
        json.dump({"context": context, "cases": results}, f, indent=1)
    gib = 2.0 ** 30
    print("| case | measured max allocated (GiB) | predicted (GiB) | predicted / measured | measured max reserved "
          "(GiB) | predicted (GiB) | predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | failed | | | | | |")
            continue
        ma, pa, mr, pr = (r["measured_allocated"], r["predicted_allocated"], r["measured_reserved"],
                          r["predicted_reserved"])
        print(f"| {r['case']} | {ma / gib:.3f} | {pa / gib:.3f} | {pa / ma:.4f} | {mr / gib:.3f} | {pr / gib:.3f} "
              f"| {pr / mr:.4f} |")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
