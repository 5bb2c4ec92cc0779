"""sharded_predict — per-rank predictions of sharded training against real runs.

Part 1: real gloo runs on this machine
  The same jobs as tests/unit/test_trace_distributed.py: world sizes 2 and 4 (separate
  processes, torch.multiprocessing.spawn), a GPT-style decoder and a CNN under DDP, FSDP2
  (reshard after forward or not, bf16 with checkpointed blocks, built on meta then to_empty) and
  ZeroRedundancyOptimizer. For each rank:
  * predicted: the meta capture of that rank under the capture's process group, peak of live
    storage bytes from nothing to the end of the second step;
  * measured: the real run's peak from torch.profiler's allocator events with c10's exact total
    (every thread; tests/unit/peaks.py), smallest of three runs, without what gloo itself holds
    (its copies and temporaries; NCCL keeps none in PyTorch's allocator), and the same without
    what a CPU kernel allocates and frees inside itself (oneDNN's bf16 scratch: on a GPU,
    cuBLAS/cuDNN workspaces); and the profiler events' own sum, as it is usually read (it misses
    the frees gloo's worker threads do, so it only grows).

Part 2: single-rank runs on an H200
  The figures benchmarks/gpu/sharded_gpu.py recorded (benchmarks/gpu/results/h200-2026-11-26),
  against the prediction made here on the H200-141GB profile.

    PYTHONPATH=python python benchmarks/sharded_predict.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, use_source_tree

use_source_tree()
sys.path.insert(0, os.path.join(REPO, "tests", "unit"))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))


def gloo_part(world_sizes: list[int]) -> list[str]:
    import torch.multiprocessing as mp

    import sharded_models as sm
    import vramkit.trace as vt
    from peaks import total_peak

    configs = [(m, s) for m in ("gpt", "cnn") for s in sm.STRATEGIES]
    rows = ["| model | strategy | world | rank | predicted (KiB) | measured, gloo's copies left out (KiB) | predicted / measured "
            "| kernels' scratch (KiB) | predicted / measured less scratch | gloo's copies at the peak (KiB) "
            "| torch.profiler events' sum (KiB) | predicted / events' sum |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in world_sizes:
        out = tempfile.mkdtemp()
        t0 = time.perf_counter()
        mp.spawn(sm.measure_rank, args=(n, os.path.join(out, "store"), configs, out), nprocs=n, join=True)
        print(f"world size {n}: real runs {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(n)]
        for model, strategy in configs:
            for r in range(n):
                real = ranks[r][f"{model}/{strategy}"]
                p = total_peak(vt.capture(sm.builder(model, strategy), device="meta", steps=2, cuda=False,
                                          world_size=n, rank=r))
                rows.append(f"| {model} | {strategy} | {n} | {r} | {p / 1024:.1f} | {real['no_backend'] / 1024:.1f} | "
                            f"{p / real['no_backend']:.4f} | {real['scratch'] / 1024:.1f} | "
                            f"{p / real['no_backend_netted']:.4f} | {real['backend'] / 1024:.1f} | "
                            f"{real['main'] / 1024:.1f} | {p / real['main']:.4f} |")
    return rows


def h200_part() -> list[str]:
    import sharded_gpu as sg
    import vramkit.trace as vt

    path = os.path.join(REPO, "benchmarks", "gpu", "results", "h200-2026-11-26", "sharded_gpu.json")
    measured = {r["case"]: r for r in json.load(open(path))}
    first_run = {r["case"]: r for r in json.load(open(path.replace(".json", "_first_run.json")))}
    profile = vt.gpu_profile("H200-141GB")
    rows = ["| case (1.3B GPT, batch 2, world size 1) | measured max allocated (GiB) | predicted (GiB) | predicted / "
            "measured | measured max reserved (GiB) | predicted (GiB) | predicted / measured | capture (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for case in sg.CASES:
        m = measured.get(case)
        if m is None or "error" in m:
            continue
        t0 = time.perf_counter()
        try:
            trace = vt.capture(lambda c=case: sg.build(c), device="meta", steps=2, cuda=profile.cuda_choices(),
                               world_size=1, rank=0)
        except vt.CaptureError as exc:
            rows.append(f"| {case} | {m['max_allocated'] / 2**30:.3f} | not captured: {str(exc)[:80]} | | | | | |")
            continue
        p = vt.replay(trace, gpu=profile)
        s = time.perf_counter() - t0
        # DDP measured twice: its bucket rebuild overlapped the old buckets in the first run only
        for name, m in ((case, m), (f"{case} (first run)", first_run.get(case) if case == "ddp" else None)):
            if m is not None:
                rows.append(f"| {name} | {m['max_allocated'] / 2**30:.3f} | {p.peak_allocated / 2**30:.3f} | "
                            f"{p.peak_allocated / m['max_allocated']:.4f} | {m['max_reserved'] / 2**30:.3f} | "
                            f"{p.peak_reserved / 2**30:.3f} | {p.peak_reserved / m['max_reserved']:.4f} | {s:.1f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="world size 2 only")
    args = parser.parse_args()
    rows = gloo_part([2] if args.quick else [2, 4])
    print("\n".join(rows))
    print()
    print("\n".join(h200_part()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
