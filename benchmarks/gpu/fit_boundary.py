"""gpu/fit_boundary — `vramkit.trace.fit`'s largest batch against the real largest on a GPU.

The one answer a user acts on is "batch N fits" (issue 34): it must run, and it should not
leave much on the table. For each model (a causal LM, a conv net, a ViT, an encoder-decoder
with relative position biases: Hugging Face models from their configs, random weights), a
child Python limits torch's allocator to CAP GiB (``torch.cuda.set_per_process_memory_fraction``,
so the search is short and every model meets its limit), then:

* real: ``vramkit.survive.find_batch_size`` on the GPU, each try building the model afresh and running
  two training steps (AdamW) at that batch size;
* predicted: ``vramkit.trace.fit`` of the same builder on meta, for this GPU's profile with the
  capacity set to the allocator's limit (the CUDA context lies outside it);
* then fit's answer is run on the GPU: it must fit.

    PYTHONPATH=python python benchmarks/gpu/fit_boundary.py [--quick] [--out DIR] [--cap GIB]
    PYTHONPATH=python python benchmarks/gpu/fit_boundary.py --dry-run   # no GPU: fit only, on H100-80GB

Prints a table: real largest, fit's largest, fit / real (target >= 0.97), whether fit's answer
ran, and the times. Needs a CUDA GPU and transformers (but --dry-run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # (predict_vs_gpu, children)
REPO = os.path.dirname(os.path.dirname(HERE))
GiB = 1 << 30

CASES = {
    # name: predict_vs_gpu's Hugging Face model (from its config, nothing downloaded)
    "causal LM (Llama 8x1024 GQA, seq 512)": "llama",
    "conv net (ResNet-50, 224x224)": "resnet",
    "ViT-B/16 (224x224)": "vit",
    "encoder-decoder (T5-small, seq 256)": "t5",
}
QUICK = ["causal LM (Llama 8x1024 GQA, seq 512)", "conv net (ResNet-50, 224x224)"]


def builder(case: str):
    """batch -> step: the model, AdamW and one batch built on the current default device
    (predict_vs_gpu's Hugging Face builders)."""
    from predict_vs_gpu import hf_builder

    name = CASES[case]
    return lambda batch: hf_builder(name, batch, False)()


def predicted(case: str, target, max_batch_size: int) -> tuple[int, float, int]:
    """fit's largest batch for `target`, its time, and its captures."""
    import vramkit.trace as vt

    t0 = time.perf_counter()
    report = vt.fit(builder(case), target, max_batch_size=max_batch_size)
    return report.max_batch_size, time.perf_counter() - t0, report.captures


def run_case(case: str, cap: float, max_batch_size: int) -> dict:
    """In a fresh child: the real search first (the allocator untouched), then fit, then fit's
    answer on the GPU."""
    import torch

    import vramkit.trace as vt
    from vramkit.survive import find_batch_size

    total = torch.cuda.get_device_properties(0).total_memory
    allowed = int(cap * GiB)
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total))
    build = builder(case)

    def two_steps(batch: int) -> None:
        try:
            with torch.device("cuda"):
                step = build(batch)
                step()
                step()
            torch.cuda.synchronize()
        finally:
            step = None  # noqa: F841 -- (everything the try made is released before the next try)
            gc.collect()
            torch.cuda.empty_cache()

    t0 = time.perf_counter()
    real = find_batch_size(two_steps, start=1, max_batch_size=max_batch_size, device=torch.device("cuda"))
    real_s = time.perf_counter() - t0
    target = vt.resolve_target("current", capacity=allowed, overheads={"cuda_context": 0})
    fit_bs, fit_s, captures = predicted(case, target, max_batch_size)
    runs = None
    if fit_bs:
        try:
            two_steps(fit_bs)
            runs = True
        except torch.OutOfMemoryError:
            runs = False
    return {"case": case, "cap_gib": cap, "real_largest": real.batch_size, "fit_largest": fit_bs,
            "fit_runs": runs, "real_s": real_s, "fit_s": fit_s, "fit_captures": captures,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def table(results: list[dict]) -> list[str]:
    lines = ["| model | allocator limit (GiB) | real largest | fit's largest | fit / real (target >= 0.97) | "
             "fit's answer runs | find_batch_size (s) | fit (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'].strip().splitlines()[-1][:120]} | | | | | | |")
            continue
        real, fit = r.get("real_largest"), r["fit_largest"]
        ratio = f"{fit / real:.3f}" if real else "-"
        runs = {True: "yes", False: "NO", None: "-"}[r.get("fit_runs")]
        lines.append(f"| {r['case']} | {r['cap_gib']:g} | {real if real is not None else '-'} | {fit} | {ratio} | "
                     f"{runs} | {r.get('real_s', 0):.1f} | {r['fit_s']:.1f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    parser.add_argument("--cap", type=float, default=6.0, help="the allocator's limit in GiB (default 6)")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--dry-run", action="store_true", help="no GPU: fit alone, on the H100-80GB profile")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = QUICK if args.quick else list(CASES)
    if args.dry_run:
        import vramkit.trace as vt

        target = vt.resolve_target("H100-80GB", capacity=int(args.cap * GiB), overheads={"cuda_context": 0})
        results = []
        for case in cases:
            bs, s, captures = predicted(case, target, args.max_batch_size)
            results.append({"case": case, "cap_gib": args.cap, "real_largest": None, "fit_largest": bs,
                            "fit_runs": None, "fit_s": s, "fit_captures": captures})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        print("\n".join(table(results)))
        return 0
    if args.case:
        print(json.dumps(run_case(args.case, args.cap, args.max_batch_size)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    from children import run_children

    results = run_children(__file__, cases, ["--cap", str(args.cap), "--max-batch-size", str(args.max_batch_size)],
                           timeout=300)
    with open(os.path.join(args.out, "fit_boundary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n".join(table(results)))
    return 1 if failed(results) else 0


def failed(results: list[dict]) -> list[str]:
    """The cases that miss the issue's goal: an error, fit's answer out of memory on the GPU, or
    below 97 % of the real largest."""
    return [r["case"] for r in results if "error" in r or r.get("fit_runs") is False
            or (r.get("real_largest") and r["fit_largest"] < 0.97 * r["real_largest"])]


if __name__ == "__main__":
    sys.exit(main())
