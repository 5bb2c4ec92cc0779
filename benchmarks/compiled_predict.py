"""compiled_predict — steps that call torch.compile'd code, predicted on meta, against the same
steps really compiled by inductor for the CPU and run here.

Part 1: accuracy. For each model and batch size: the real eager and compiled runs' peaks
(torch.profiler's allocator events over two steps, each operator's own scratch netted out:
tests/unit/peaks.py), and the meta captures' step peaks (CUDA's dispatch choices off, so both
sides take the CPU's code paths). The models are tests/unit/compiled_models.py's.

Part 2: the time of ``vramkit.trace.fit`` on the compiled step against the eager one (the
issue's target: at most 2x), on a GPU size where the search runs several probes; which probes'
captures compiled graphs, and whether the answer had to be searched again with static graphs.

    PYTHONPATH=python python benchmarks/compiled_predict.py [--quick] [model:batch ...]
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

ROWS = [("mlp", 64), ("cnn", 8), ("cnn", 16), ("gpt-small", 4), ("gpt-d256-s256", 4), ("gpt-d256-s256", 8),
        ("gpt-lm-loss", 4), ("gpt-lm-loss", 8), ("hf-qwen2", 4), ("hf-llama-gqa", 4), ("hf-llama-gqa", 8),
        ("hf-vit", 8), ("hf-vit", 16), ("hf-gpt2", 4), ("adamw-step", 2), ("gpt-lm-loss-opt", 4)]
QUICK = [("mlp", 64), ("gpt-lm-loss", 4)]


def fit_times(gpus: tuple[tuple[str, str], ...] = (("gpt-lm-loss", "2GiB"), ("hf-gpt2", "2GiB"))) -> list[str]:
    """fit's wall time, answer, captures and compiles, eager and compiled, per model."""
    import torch

    import compiled_models as cm
    import vramkit.trace as vt

    vt.fit(cm.MODELS["mlp"](None), "1GiB", max_batch_size=8)  # warm-up: the first fit in a process loads more
    lines = ["| model | step | fit's largest batch | captures | graphs compiled at | searched again | wall (s) | / eager |",
             "|---|---|---|---|---|---|---|---|"]
    for name, gpu in gpus:
        base = None
        for backend in (None, "inductor"):
            torch._dynamo.reset()
            build = cm.MODELS[name](backend)
            t0 = time.perf_counter()
            report = vt.fit(build, gpu, max_batch_size=256)
            seconds = time.perf_counter() - t0
            base = base or seconds
            compiled_at = [bs for bs, t in report.traces.items()
                           if sum(r.get("graphs", 0) for r in t.meta.get("compiled_regions", ()))]
            again = "yes" if any("searched again" in line for line in report.fallbacks) else "no"
            lines.append(f"| {name} | {'compiled (inductor)' if backend else 'eager'} | {report.max_batch_size} | "
                         f"{report.captures} | {compiled_at or '-'} | {again if backend else '-'} | {seconds:.1f} | "
                         f"{seconds / base:.1f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, and fit")
    parser.add_argument("rows", nargs="*", help="model:batch (default: all)")
    ns = parser.parse_args()
    import compiled_models as cm

    rows = [(r.split(":")[0], int(r.split(":")[1])) for r in ns.rows] or (QUICK if ns.quick else ROWS)
    print("\n".join(cm.table(rows)))
    print()
    print("\n".join(fit_times()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
