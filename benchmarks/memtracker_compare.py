"""memtracker_compare — vramkit's per-rank prediction against PyTorch's own estimators and a real run.

For a GPT-style decoder and a CNN (tests/unit/sharded_models.py) under FSDP2 (reshard after
forward or not, bf16 parameters with checkpointed blocks) and DDP, AdamW, batch 4, two steps,
one rank of a world of 2 (and 4 for the GPT under the FSDP2 variants), rank 0 and the last rank:

* measured: a real gloo job (torch.multiprocessing.spawn, one process per rank), that rank's
  peak of the CPU allocator's exact total (torch.profiler's allocator events with c10's
  all-thread count; tests/unit/peaks.py ``allocator_peaks``) from nothing (build: model,
  wrapper, optimizer, batch) to the end of the second step, without what gloo itself holds
  (its copy of a reduce-scatter input, its all-gather temporaries); the smallest of three runs
  (sharded_models.measure_rank, as benchmarks/sharded_predict.py and
  tests/unit/test_trace_distributed.py use it). The plain sum of torch.profiler's events is
  shown beside it: it misses frees done on gloo's worker threads;
* vramkit: ``vramkit.trace.capture(build, device="meta", steps=2, world_size=N, rank=r)``,
  peak of live storage bytes of the trace (tests/unit/peaks.py ``total_peak``): what a GPU
  would hold, so CPU-side storages are left out (AdamW's ``step`` counters, FSDP2's device-mesh
  index tensors);
* PyTorch: FSDPMemTracker (FSDP2) or MemTracker (DDP), ``get_tracker_snapshot("peak")``'s
  Total, run in this process on torch's fake process group for rank r of N
  (tests/unit/torch_trackers.py says how, and what had to be done for the CPU): once with
  real CPU tensors, once under FakeTensorMode.

Each tool's time is its own: vramkit's capture and peak; the tracker's fake group, build and
two steps; the real run's time on that rank for the case (three instrumented runs and three
profiled runs, gloo group set-up included). Each in-process tool runs one untimed warm-up case
first.

    PYTHONPATH=python python benchmarks/memtracker_compare.py [--quick] [--json PATH]
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

CASES = [(m, s) for m in ("gpt", "cnn") for s in ("fsdp2", "fsdp2-no-reshard", "fsdp2-bf16-checkpointed", "ddp")]
WORLD4_CASES = [("gpt", s) for s in ("fsdp2", "fsdp2-no-reshard", "fsdp2-bf16-checkpointed")]


def measure_each(rank: int, world_size: int, configs: list[tuple[str, str]], out_dir: str, repeats: int) -> None:
    """One rank of the real job (torch.multiprocessing.spawn's target): sharded_models.measure_rank
    for each case on its own (its own gloo group, and its own FileStore in the case's directory), timed."""
    import sharded_models as sm

    times = {}
    for model, strategy in configs:
        sub = os.path.join(out_dir, f"{model}-{strategy}")
        os.makedirs(sub, exist_ok=True)
        t0 = time.perf_counter()
        sm.measure_rank(rank, world_size, os.path.join(sub, "store"), [(model, strategy)], sub, repeats=repeats)
        times[f"{model}/{strategy}"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"times{rank}.json"), "w") as f:
        json.dump(times, f)


def real_runs(world_size: int, configs: list[tuple[str, str]], repeats: int) -> list[dict]:
    """Per rank: {"model/strategy": measure_rank's figures plus "seconds"}."""
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="memtracker_compare")
    t0 = time.perf_counter()
    mp.spawn(measure_each, args=(world_size, configs, out, repeats), nprocs=world_size, join=True)
    print(f"world size {world_size}: real runs {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    ranks = []
    for r in range(world_size):
        with open(os.path.join(out, f"times{r}.json")) as f:
            times = json.load(f)
        figures = {}
        for model, strategy in configs:
            key = f"{model}/{strategy}"
            with open(os.path.join(out, f"{model}-{strategy}", f"rank{r}.json")) as f:
                figures[key] = json.load(f)[key]
            figures[key]["seconds"] = times[key]
        ranks.append(figures)
    return ranks


def vramkit_peak(model: str, strategy: str, world_size: int, rank: int) -> dict:
    import numpy as np

    import sharded_models as sm
    import vramkit.trace as vt
    from peaks import total_peak

    t0 = time.perf_counter()
    t = vt.capture(sm.builder(model, strategy), device="meta", steps=2, cuda=False, world_size=world_size, rank=rank)
    peak = total_peak(t)
    seconds = time.perf_counter() - t0
    # where the peak is: in the build or in which step (for comparing with the trackers,
    # which see the steps only)
    counted = ~np.isin(t.alloc_category, [vt.CATEGORIES.index("host"), vt.CATEGORIES.index("deferred")])
    mem = np.flatnonzero(t.kind <= vt.FREE)
    sizes = np.where(counted, t.alloc_size.astype(np.int64), 0)
    live = np.cumsum(np.where(t.kind[mem] == vt.ALLOC, sizes[t.id[mem]], -sizes[t.id[mem]]))
    at = int(mem[int(np.argmax(live))])
    in_step = int(np.count_nonzero(np.flatnonzero(t.kind == vt.STEP) < at))
    # host-side storages (left out of the peak) alive at that moment: AdamW's step counters,
    # FSDP2's device-mesh index tensors
    alive = np.zeros(t.num_allocations, bool)
    before = mem[mem <= at]
    alive[t.id[before[t.kind[before] == vt.ALLOC]]] = True
    alive[t.id[before[t.kind[before] == vt.FREE]]] = False
    host = alive & (t.alloc_category == vt.CATEGORIES.index("host"))
    return {"peak": peak, "seconds": seconds, "peak_in_step": in_step,
            "host_allocations_at_peak": int(host.sum()), "host_bytes_at_peak": int(t.alloc_size[host].sum())}


def tracker_peak(model: str, strategy: str, world_size: int, rank: int, fake_tensors: bool) -> dict:
    import torch_trackers as tt

    try:
        return tt.tracker_run(model, strategy, world_size, rank, fake_tensors=fake_tensors)
    except Exception as exc:  # noqa: BLE001 - the table says why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"}


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="world size 2 only, and one real run per case instead of the smallest of three")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # as the real ranks run
    jobs = [(2, CASES, [0, 1])] + ([] if args.quick else [(4, WORLD4_CASES, [0, 3])])
    repeats = 1 if args.quick else 3

    # untimed warm-up of the in-process tools (imports, first-call set-up)
    vramkit_peak("gpt", "fsdp2", 2, 0)
    tracker_peak("gpt", "fsdp2", 2, 0, False)
    tracker_peak("gpt", "fsdp2", 2, 0, True)

    records = []
    for world_size, configs, ranks in jobs:
        measured = real_runs(world_size, configs, repeats)
        for model, strategy in configs:
            for rank in ranks:
                real = measured[rank][f"{model}/{strategy}"]
                rec = {"model": model, "strategy": strategy, "world_size": world_size, "rank": rank,
                       "measured": real, "vramkit": vramkit_peak(model, strategy, world_size, rank),
                       "tracker_cpu": tracker_peak(model, strategy, world_size, rank, False),
                       "tracker_fake": tracker_peak(model, strategy, world_size, rank, True)}
                records.append(rec)
                print(f"{model}/{strategy} world {world_size} rank {rank} done", file=sys.stderr, flush=True)

    rows = [("| case | world | rank | measured (KiB) | torch.profiler (KiB) | vramkit (KiB) | vramkit / measured "
             "| vramkit's peak in | PyTorch tracker | tracker, CPU tensors (KiB) | / measured | tracker, FakeTensorMode "
             "(KiB) | / measured | time: real run / vramkit / tracker CPU / tracker fake (s) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        m = rec["measured"]["no_backend"]
        v = rec["vramkit"]
        cells = []
        for key in ("tracker_cpu", "tracker_fake"):
            tr = rec[key]
            cells += [f"not run: {tr['error']}", "—"] if "error" in tr else [_kib(tr["peak"]), f"{tr['peak'] / m:.4f}"]
        tool = next((rec[k]["tool"] for k in ("tracker_cpu", "tracker_fake") if "tool" in rec[k]), "—")
        times = [f"{rec['measured']['seconds']:.1f}", f"{v['seconds']:.2f}"] + \
            [f"{rec[k]['seconds']:.2f}" if "seconds" in rec[k] else "—" for k in ("tracker_cpu", "tracker_fake")]
        rows.append(f"| {rec['model']} {rec['strategy']} | {rec['world_size']} | {rec['rank']} | {_kib(m)} | "
                    f"{_kib(rec['measured']['main'])} | {_kib(v['peak'])} | {v['peak'] / m:.4f} | "
                    f"{'build' if v['peak_in_step'] == 0 else 'step ' + str(v['peak_in_step'])} | {tool} | "
                    f"{' | '.join(cells)} | {' / '.join(times)} |")
    print("\n".join(rows))

    print()
    rows = [("| case | world | rank | tracker − vramkit (B) | measured − vramkit (B) | host storages live at vramkit's "
             "peak, left out (count, B) | gloo's own copies at the peak, left out of measured (B) | tracker's peak by category (B) |"),
            "|---|---|---|---|---|---|---|---|"]
    for rec in records:
        tr = rec["tracker_cpu"]
        v = rec["vramkit"]
        diff = f"{tr['peak'] - v['peak']:+d}" if "peak" in tr else "—"
        cats = ", ".join(f"{k}: {n}" for k, n in tr.get("peak_snapshot", {}).items() if n and k != "Total")
        rows.append(f"| {rec['model']} {rec['strategy']} | {rec['world_size']} | {rec['rank']} | {diff} | "
                    f"{rec['measured']['no_backend'] - v['peak']:+d} | {v['host_allocations_at_peak']}, "
                    f"{v['host_bytes_at_peak']} | {rec['measured']['backend']} | {cats} |")
    print("\n".join(rows))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
