"""find_batch_size in a real two-process FSDP2 job (`fully_shard`, gloo, CPU; issue 36, part 2):
FSDP2 all-gathers each layer's parameters before its forward and reduce-scatters its gradients in
the backward, so a rank that ran out of memory between two layers, while the other went on to
the next all-gather, would leave that one waiting forever. The ranks have different memory; the
search ends on both with the same size, the largest that fits on the smaller rank (found by
trying every size in one process), with no hang (each rank has a deadline).

GPU memory is the one thing stood in for: a forward pre-hook on the activation between the
sharded layers takes 1 MiB per sample from vramkit's cpu pool for the rest of the step, and each
rank's pool is capped (rank 0 at 48 MiB, rank 1 at 80 MiB)."""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from torchrun_jobs import launch  # noqa: E402

LIMITS_MIB = (48, 80)

WORKER = textwrap.dedent(r"""
    import json, sys
    import torch
    import vramkit
    from vramkit.survive import find_batch_size

    mode, limit_mib = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    vramkit.set_memory_limit(limit_mib << 20, "cpu")
    held = []

    def take(batch_size):  # the stand-in for activation memory: 1 MiB a sample
        held.append(vramkit.raw_alloc(batch_size << 20, "cpu"))

    def release():
        while held:
            vramkit.raw_free(held.pop())

    if mode == "reference":  # every size in turn, one process, no search
        best = 0
        for bs in range(1, 257):
            try:
                take(bs)
            except vramkit.OutOfMemoryError:
                break
            finally:
                release()
                vramkit.empty_cache("cpu")
            best = bs
        print("RESULT " + json.dumps({"batch_size": best}), flush=True)
        sys.exit(0)

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    model[1].register_forward_pre_hook(lambda module, args: take(args[0].shape[0]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = []

    def step(batch_size):
        steps.append(batch_size)
        try:
            x = torch.randn(batch_size, 32)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            release()

    result = find_batch_size(step, device="cpu", max_batch_size=256, timeout=120)
    print("RESULT " + json.dumps({"batch_size": result.batch_size, "ranks": result.ranks, "steps": steps,
                                  "limit_after": vramkit.get_settings("cpu")["memory_limit"],
                                  "outcomes": [[a.batch_size, a.outcome, a.local_outcome] for a in result.attempts]}),
          flush=True)
    dist.destroy_process_group()
""")


def test_fsdp2_ranks_with_different_memory_agree(tmp_path):
    want = launch(tmp_path / "ref", WORKER, "reference", [min(LIMITS_MIB)], deadline=120)[0]["batch_size"]
    assert 0 < want < 256
    ranks = launch(tmp_path, WORKER, "fsdp2", LIMITS_MIB, deadline=300)
    assert [r["ranks"] for r in ranks] == [2, 2]
    assert [r["batch_size"] for r in ranks] == [want, want]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # every size tried on both ranks, in the same order
    assert [[b, o] for b, o, _ in ranks[0]["outcomes"]] == [[b, o] for b, o, _ in ranks[1]["outcomes"]]
    assert any(local == "oom" for _, _, local in ranks[1]["outcomes"])  # the larger rank ran out with the smaller
    assert [r["limit_after"] for r in ranks] == [m << 20 for m in LIMITS_MIB]
