"""hf_predict — vramkit's prediction for Hugging Face models against PyTorch's own accounting.

What it measures
  For Hugging Face models from their default configs with random weights (GPT-2 124M,
  BERT-base, a Llama of 8 layers at width 1024 with grouped-query attention, ViT-B/16, and the
  library's ResNet-50), at two batch sizes each:
  * predicted: the peak of a meta capture with CUDA's choices off (meta as the CPU), what the
    steps allocate beyond the built model — no weights exist, no memory is used;
  * measured: the same two AdamW steps run for real on this CPU under torch.profiler with
    profile_memory=True (PyTorch's own allocator events), peak over the same baseline; and the
    same with each operator's events netted at its end (a CPU kernel's internal scratch out);
  * the capture's and the real run's seconds;
  * "as on an H100": the meta capture with CUDA's choices on (flash/efficient attention by
    torch's CUDA rules, dropout's bool masks, foreach AdamW), replayed on the H100-80GB profile:
    predicted peak allocated, the model included (what torch.cuda.max_memory_allocated would say).
  Needs `pip install transformers`. Not part of CI (the real runs take minutes on a CPU).

  python benchmarks/hf_predict.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, use_source_tree

use_source_tree()
sys.path.insert(0, os.path.join(REPO, "tests", "unit"))


def models(quick: bool):
    import transformers as T

    gpt2 = T.GPT2Config(bos_token_id=0, eos_token_id=0)
    llama = T.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000)
    out = [
        ("GPT-2 124M", T.GPT2LMHeadModel, gpt2, "lm", (1, 4), 512),
        ("BERT-base", T.BertForMaskedLM, T.BertConfig(), "mlm", (4, 16), 128),
        ("Llama 8x1024 GQA", T.LlamaForCausalLM, llama, "lm", (1, 4), 512),
        ("ViT-B/16", T.ViTForImageClassification, T.ViTConfig(), "image", (2, 8), 0),
        ("ResNet-50", T.ResNetForImageClassification, T.ResNetConfig(), "image", (2, 8), 0),
    ]
    return out[:2] if quick else out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 and BERT only")
    args = parser.parse_args()
    import torch

    import vramkit.trace as vt
    from test_trace_hf_models import model_builder, profiler_peaks, step_peak

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    for name, cls, cfg, kind, batches, seq in models(args.quick):
        for batch in batches:
            build = model_builder(cls, cfg, kind, batch, seq, image=224)
            t0 = time.perf_counter()
            trace = vt.capture(build, device="meta", steps=2, cuda=False)
            capture_s = time.perf_counter() - t0
            predicted = step_peak(trace)
            step = build()
            t0 = time.perf_counter()
            raw, netted = profiler_peaks(step, steps=2)  # the same two steps, from the same built state
            run_s = time.perf_counter() - t0
            gpu = vt.capture(build, device="meta", steps=2)
            h100 = vt.replay(gpu, gpu="H100-80GB")
            what = f"{name} x{batch}" + (f" seq {seq}" if seq else "")
            rows.append((what, predicted, raw, netted, capture_s, run_s, h100.peak_allocated))
            print(f"{what}: predicted {predicted / 2**20:.1f} MiB, profiler {raw / 2**20:.1f} MiB "
                  f"(netted {netted / 2**20:.1f}), capture {capture_s:.1f} s, run {run_s:.1f} s, "
                  f"H100 {h100.peak_allocated / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    print(f"| model x batch | predicted (MiB) | measured, profiler (MiB) | predicted / measured | measured, op scratch "
          "netted (MiB) | predicted / netted | capture (s) | CPU run (s) | as on an H100: peak allocated (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for what, predicted, raw, netted, capture_s, run_s, h100 in rows:
        print(f"| {what} | {predicted / 2**20:.1f} | {raw / 2**20:.1f} | {predicted / raw:.4f} | {netted / 2**20:.1f} "
              f"| {predicted / netted:.4f} | {capture_s:.1f} | {run_s:.1f} | {h100 / 2**30:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
