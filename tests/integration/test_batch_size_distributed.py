"""find_batch_size under a real multi-process gloo job (issue 36, part 2): ranks with different
memory limits, a step with a collective in its middle, no hang, the same answer on every rank.

Each rank is its own Python process (torch.distributed over gloo, a file store), with a
simulated device of its own: rank r's device is capped at LIMITS[r]. The step allocates
2 x `batch_size` MiB, all-reduces over the job's group, then allocates 1 MiB more: a rank that
runs out at the first allocation while another, with more memory, goes on into the all-reduce
would leave the other waiting for it forever. The reference answer is an exhaustive search, in this process, of
the same allocations on a device capped at the smallest limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import vramkit  # noqa: E402

MIB = 1 << 20
LIMITS = (96 * MIB, 160 * MIB)  # rank 0 runs out first

WORKER = textwrap.dedent(r"""
    import json, os, sys
    import torch, torch.distributed as dist
    import vramkit
    from vramkit.survive import find_batch_size

    rank, world, store, limits, mode, timeout = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                 json.loads(sys.argv[4]), sys.argv[5], float(sys.argv[6]))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    device = str(vramkit.sim.create(1 << 30))
    vramkit.set_memory_limit(limits[rank], device)
    MIB = 1 << 20

    def step(batch_size):
        first = vramkit.raw_alloc(2 * batch_size * MIB, device)
        try:
            if mode == "uneven" and rank == 0:  # work only rank 0 does: equal budgets cannot help
                extra = vramkit.raw_alloc(48 * MIB, device)
                vramkit.raw_free(extra)
            t = torch.ones(1)
            dist.all_reduce(t)  # the step's collective, on the job's group
            second = vramkit.raw_alloc(MIB, device)
            vramkit.raw_free(second)
        finally:
            vramkit.raw_free(first)

    try:
        result = find_batch_size(step, device=device, max_batch_size=4096, timeout=timeout)
        after = vramkit.get_settings(device)["memory_limit"]
        print("RESULT " + json.dumps({"batch_size": result.batch_size, "limit_after": after, "text": str(result),
                                      "attempts": [[a.batch_size, a.outcome, a.local_outcome]
                                                   for a in result.attempts]}), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
""")


def run_job(tmp_path, mode: str, timeout: float, deadline: float) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(vramkit.__file__)),
                                                                     os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(store), json.dumps(LIMITS), mode,
                               str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=deadline)  # a hang fails the test here, not forever
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def exhaustive_reference(limit: int) -> int:
    """The largest batch size whose two allocations fit under `limit` on a fresh device, by
    trying every size in turn (no search, no agreement)."""
    device = str(vramkit.sim.create(1 << 30))
    vramkit.set_memory_limit(limit, device)
    best = 0
    for batch_size in range(1, 4097):
        try:
            a = vramkit.raw_alloc(2 * batch_size * MIB, device)
            try:
                b = vramkit.raw_alloc(MIB, device)
                vramkit.raw_free(b)
            finally:
                vramkit.raw_free(a)
        except vramkit.OutOfMemoryError:
            break
        finally:
            vramkit.empty_cache(device)
        best = batch_size
    return best


def test_ranks_with_different_limits_agree_without_hanging(tmp_path):
    jobs = run_job(tmp_path, "even", timeout=60, deadline=120)
    results = []
    for r, job in enumerate(jobs):
        assert job.returncode == 0, f"rank {r} failed:\n{job.stderr[-3000:]}"
        line = [x for x in job.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    want = exhaustive_reference(min(LIMITS))
    assert want > 0
    assert [r["batch_size"] for r in results] == [want, want]  # the same answer on every rank
    assert results[0]["attempts"] == [[a, o, results[0]["attempts"][i][2]] for i, (a, o, _) in
                                      enumerate(results[1]["attempts"])]  # the same sizes and outcomes
    # rank 1 (more memory) was capped to rank 0's headroom during the search, and uncapped after
    assert [r["limit_after"] for r in results] == list(LIMITS)
    # and so ran out of memory at the same allocation as rank 0, before the collective: without
    # the common budget it would have gone on into the all-reduce alone
    assert any(local == "oom" for _, _, local in results[1]["attempts"])
    assert "searched by 2 ranks together" in results[0]["text"]


def test_uneven_work_raises_on_the_waiting_rank_instead_of_hanging(tmp_path):
    jobs = run_job(tmp_path, "uneven", timeout=8, deadline=120)
    assert all(job.returncode != 0 for job in jobs)
    assert "did not finish attempt" in jobs[0].stderr, jobs[0].stderr[-3000:]
