"""gpu/sharded_gpu — real single-GPU runs of DDP and FSDP2 (world size 1, NCCL): the figures a
per-rank prediction is checked against.

Each case runs in a fresh child: NCCL process group of one rank, the bundled 1.3B GPT
(examples/gpt_fit.py) built on the GPU, wrapped (DDP, with and without gradient_as_bucket_view;
FSDP2 per block and at the root with reshard_after_forward True or False; FSDP2 with a bf16
MixedPrecisionPolicy and checkpointed blocks; FSDP2 with CPUOffloadPolicy), two AdamW steps. It records `torch.cuda.max_memory_allocated/reserved`, what NCCL took
outside the allocator (the change in `mem_get_info` across `init_process_group` and the first
all-reduce, less the allocator's change), and the allocator history (a memory_viz snapshot) so
the comparison with vramkit's meta prediction can be made afterwards on a machine without a GPU.

    PYTHONPATH=python python benchmarks/gpu/sharded_gpu.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BATCH = 2
CASES = ["ddp", "ddp-bucket-view", "fsdp2", "fsdp2-no-reshard", "fsdp2-bf16-checkpointed", "fsdp2-offload"]


def gpt_fit():
    spec = importlib.util.spec_from_file_location("gpt_fit", os.path.join(REPO, "examples", "gpt_fit.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(case: str, batch: int = BATCH):
    """The model wrapped as `case` says, AdamW, one batch; returns the step. Runs under whatever
    `torch.device(...)` context the caller sets."""
    import torch
    from torch.nn import functional as F

    g = gpt_fit()
    torch.manual_seed(0)
    model = g.GPT(checkpointed=case.endswith("checkpointed"))
    if case.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = torch.empty(0).device
        model = DDP(model, device_ids=[dev.index or 0] if dev.type == "cuda" else None,
                    gradient_as_bucket_view=case == "ddp-bucket-view")
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if "bf16" in case else MixedPrecisionPolicy()
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        reshard = "no-reshard" not in case
        offload = CPUOffloadPolicy() if case.endswith("offload") else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, g.VOCAB, (batch, g.SEQ))
    if case.endswith("offload"):  # parameters live on the host; the batch goes to the GPU
        idx = idx.to("cuda" if torch.cuda.is_available() else "cpu")

    def step() -> None:
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, g.VOCAB).float(), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_case(case: str, out: str) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    res0 = torch.cuda.memory_reserved()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    del t
    free1, _ = torch.cuda.mem_get_info()
    nccl_outside = (free0 - free1) - (torch.cuda.memory_reserved() - res0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    t0 = time.perf_counter()
    with torch.device("cuda"):
        step = build(case)
    steps_alloc = []
    for _ in range(2):
        step()
        torch.cuda.synchronize()
        steps_alloc.append(torch.cuda.max_memory_allocated())
    seconds = time.perf_counter() - t0
    result = {"case": case, "batch": BATCH, "max_allocated": torch.cuda.max_memory_allocated(),
              "max_reserved": torch.cuda.max_memory_reserved(), "max_allocated_after_each_step": steps_alloc,
              "base_allocated": base_alloc, "base_reserved": base_res, "nccl_outside_allocator": nccl_outside,
              "context_outside_allocator": total - free0 - res0, "seconds": seconds,
              "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries"),
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    torch.cuda.memory._dump_snapshot(os.path.join(out, f"sharded_{case}.pickle"))
    dist.destroy_process_group()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.case:
        print(json.dumps(run_case(args.case, args.out)))
        return 0
    from children import run_children

    results = run_children(__file__, list(CASES), ["--out", args.out], timeout=240)
    with open(os.path.join(args.out, "sharded_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    gib = 2.0 ** 30
    print("| case (world size 1, NCCL, 1.3B GPT, batch 2) | max allocated (GiB) | max reserved (GiB) | NCCL outside "
          "the allocator (MiB) |")
    print("|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | failed | | |")
            continue
        print(f"| {r['case']} | {r['max_allocated'] / gib:.3f} | {r['max_reserved'] / gib:.3f} "
              f"| {r['nccl_outside_allocator'] / 2**20:.0f} |")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
