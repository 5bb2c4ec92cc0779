"""What-if sharding (``ShardingChange``), the smallest world size, the optimizer's foreach ops on
shards, and progress lines of long captures.

Each change is checked against the script written with that strategy: a DDP script captured
with ``ShardingChange(fsdp=True)`` must hold, step for step, what the same model wrapped with
``fully_shard`` by hand holds; and so on. The scripts as written are themselves checked against
real gloo runs in ``test_trace_distributed.py``. The smallest world size is checked against an
exhaustive search over world sizes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import sharded_models as sm  # noqa: E402
import vramkit.trace as vt  # noqa: E402
from peaks import total_peak  # noqa: E402
from vramkit.trace.fitting.sharded_fit import predict_ranks, smallest_world_size, world_sizes  # noqa: E402
from vramkit.trace.sharding.sharding_changes import ShardingChange  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch", allow_module_level=True)


def capture(build, world_size=2, rank=0, **kw) -> vt.Trace:
    kw.setdefault("cuda", False)  # as the CPU runs of test_trace_distributed do
    return vt.capture(build, device="meta", steps=2, world_size=world_size, rank=rank, **kw)


def by_hand_fsdp2(model_name: str, batch: int = 4):
    """The FSDP2 recipe written out: fully_shard on each block, then on the model, defaults."""
    def build():
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = sm.GPT() if model_name == "gpt" else sm.CNN()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return sm.training_step(model_name, model, opt, batch)

    return build


def model_state(trace: vt.Trace) -> dict[str, int]:
    from vramkit.trace.fitting.sharded_fit import _model_state

    return _model_state(trace)


def collectives(trace: vt.Trace):
    return trace.meta["distributed"]["steps"]


@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_ddp_sharded_with_fsdp2_holds_what_fsdp2_by_hand_holds(model):
    changed = capture(sm.builder(model, "ddp"), sharding=ShardingChange(fsdp=True))
    by_hand = capture(by_hand_fsdp2(model))
    written = capture(sm.builder(model, "ddp"))
    assert total_peak(changed) == total_peak(by_hand)
    assert model_state(changed) == model_state(by_hand)
    assert collectives(changed) == collectives(by_hand)
    assert total_peak(changed) < total_peak(written)
    assert changed.meta["strategy"]["fsdp2"] and not changed.meta["strategy"]["ddp"]
    assert changed.meta["sharding_change"] == "FSDP2 instead of DDP"
    assert written.meta["strategy"] == {"ddp": True, "fsdp2": False, "zero": False, "uneven_shards": 0}


@pytest.mark.parametrize("model", ["gpt", "cnn"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_reshard_after_forward_changed_equals_the_script_written_with_it(model, world_size):
    last = world_size - 1
    for written, change, same_as in (("fsdp2-no-reshard", True, "fsdp2"), ("fsdp2", False, "fsdp2-no-reshard")):
        changed = capture(sm.builder(model, written), world_size, last,
                          sharding=ShardingChange(reshard_after_forward=change))
        expected = capture(sm.builder(model, same_as), world_size, last)
        assert total_peak(changed) == total_peak(expected)
        assert collectives(changed) == collectives(expected)
        assert changed.meta["strategy"]["reshard_after_forward"] is change


def test_bf16_mixed_precision_changed_equals_the_script_written_with_it():
    # The CNN's "fsdp2-bf16-checkpointed" is bf16 FSDP2 without checkpointing (its blocks have none).
    changed = capture(sm.builder("cnn", "fsdp2"), sharding=ShardingChange(param_dtype=torch.bfloat16))
    expected = capture(sm.builder("cnn", "fsdp2-bf16-checkpointed"))
    assert total_peak(changed) == total_peak(expected)
    assert collectives(changed) == collectives(expected)
    assert changed.meta["strategy"]["param_dtype"] == "bfloat16"
    assert total_peak(changed) < total_peak(capture(sm.builder("cnn", "fsdp2")))


def test_fit_suggests_fsdp2_for_a_ddp_script_with_its_communication():
    def build(batch):
        return sm.builder("gpt", "ddp", batch=batch)()

    written = capture(sm.builder("gpt", "ddp"))
    sharded = capture(sm.builder("gpt", "ddp"), sharding=ShardingChange(fsdp=True))
    a = vt.replay(written, "1GiB", overheads=vt.NO_OVERHEADS)
    b = vt.replay(sharded, "1GiB", overheads=vt.NO_OVERHEADS)
    cap = (a.peak_reserved + b.peak_reserved) // 2
    report = vt.fit(build, cap, batch_size=4, search=False, world_size=2, overheads=vt.NO_OVERHEADS)
    assert not report.target.fits
    fsdp = [s for s in report.suggestions if s.settings == {"fsdp": True}]
    assert fsdp, report.table()
    assert fsdp[0].prediction.peak_reserved == vt.replay(sharded, cap, overheads=vt.NO_OVERHEADS).peak_reserved

    def sent(trace):
        return sum(row["sent"] for row in trace.meta["distributed"]["steps"][-1].values())

    assert sent(sharded) > sent(written) > 0
    diff = sent(sharded) - sent(written)
    assert f"sends {vt.format_size(sent(sharded))} per step" in fsdp[0].cost
    assert f"+{vt.format_size(diff)} against the script as written" in fsdp[0].cost
    assert "FSDP2 instead of DDP" in report.table()


@pytest.mark.parametrize("strategy", ["fsdp2", "zero", "ddp"])
def test_smallest_world_size_is_what_an_exhaustive_search_finds(strategy):
    def build(batch):
        return sm.builder("gpt", strategy, batch=batch)()

    limit = 16
    sizes = world_sizes(limit)
    assert sizes == [1, 2, 4, 8, 16]
    reports = {n: predict_ranks(build, 4, world_size=n, gpu="1GiB", overheads=vt.NO_OVERHEADS, ranks=[0, n - 1])
               for n in sizes}
    worst = {n: max(p.peak_reserved for p in r.predictions.values()) for n, r in reports.items()}

    def fits(n: int, cap: int) -> bool:
        """Every rank's trace replayed on a GPU of `cap` bytes: a small GPU can fit a step whose
        reserved peak on a large one is above it (the allocator frees its cache and retries,
        as the side streams' cached blocks are here)."""
        assert len(reports[n].traces) == len({0, n - 1})
        return all(vt.replay(t, cap, overheads=vt.NO_OVERHEADS).fits for t in reports[n].traces.values())

    for cap in sorted(set(worst.values())) + [min(worst.values()) - 1]:
        expected = min([n for n in sizes if fits(n, cap)] or [0])
        for start in (2, 16):
            known = predict_ranks(build, 4, world_size=start, gpu=cap, overheads=vt.NO_OVERHEADS)
            answer = smallest_world_size(build, 4, gpu=cap, known=known, limit=limit, overheads=vt.NO_OVERHEADS)
            if strategy == "ddp":  # replicated: every world size holds the same
                assert len(set(worst.values())) == 1
                assert answer.replicated and answer.world_size == (1 if worst[start] <= cap else 0)
                assert "replicates" in answer.line()
            else:
                assert answer.world_size == expected, (cap, start, answer.line(), worst)
                if expected:
                    assert f"needs at least {expected} x" in answer.line()


def test_the_optimizers_foreach_ops_on_shards_change_nothing(monkeypatch):
    """The optimizer's foreach ops run on FSDP2's local shards (dtensor_local) hold exactly what
    DTensor's own dispatch of them holds, event for event; and the shortcut is taken."""
    import numpy as np

    from vramkit.trace.capturing import meta_values
    from vramkit.trace.sharding.dtensor_local import NOT_HANDLED, foreach_on_shards

    taken = []

    def counting(func, args, kwargs):
        out = foreach_on_shards(func, args, kwargs)
        taken.append(out is not NOT_HANDLED)
        return out

    monkeypatch.setattr(meta_values, "foreach_on_shards", counting)
    fast = capture(sm.builder("gpt", "fsdp2-no-reshard"), 4, 3, cuda=True)  # CUDA's choice: AdamW's foreach
    assert sum(taken) >= 10  # AdamW's step: lerp, mul, addcmul, sqrt, div, add, addcdiv... each step
    monkeypatch.setattr(meta_values, "foreach_on_shards", lambda func, args, kwargs: NOT_HANDLED)
    slow = capture(sm.builder("gpt", "fsdp2-no-reshard"), 4, 3, cuda=True)
    for column in ("kind", "id"):
        assert np.array_equal(getattr(fast, column), getattr(slow, column))
    assert np.array_equal(fast.alloc_size, slow.alloc_size)
    assert np.array_equal(fast.alloc_category, slow.alloc_category)


def test_long_captures_say_how_far_they_are(monkeypatch):
    from vramkit.trace.capturing import capture_step

    monkeypatch.setattr(capture_step, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(capture_step, "OPS_BETWEEN_CLOCK_READS", 1)
    lines: list[str] = []
    capture(sm.builder("gpt", "fsdp2"), progress=lines.append)
    assert lines and all("capture running for" in line and " ops" in line for line in lines)
    assert any(", in the builder, or step 1" in line for line in lines)
    assert any(", in step 2 of 2, at blocks." in line for line in lines)


def test_bad_sharding_changes():
    with pytest.raises(ValueError, match="param_dtype must be torch.bfloat16"):
        ShardingChange(param_dtype=torch.float32)
    with pytest.raises(TypeError, match="reshard_after_forward must be True, False or None"):
        ShardingChange(reshard_after_forward=2)
    with pytest.raises(TypeError, match="without world_size"):
        vt.capture(sm.builder("gpt", "ddp"), device="meta", sharding=ShardingChange(fsdp=True))
    with pytest.raises(TypeError, match="must be a vramkit.trace.ShardingChange"):
        capture(sm.builder("gpt", "ddp"), sharding={"fsdp": True})


def test_tensors_in_finds_what_tree_flatten_finds_and_holds_nothing():
    """The capture's fast flatten: the same tensors in the same order as torch's tree_flatten,
    and no reference left behind once it returns (a reference cycle would keep tensors alive
    until the cycle collector runs, and the capture would record them freed late)."""
    import gc
    import weakref

    from torch.utils._pytree import tree_flatten
    from vramkit.trace.capturing.meta_values import tensors_in

    a, b, c, d = (torch.ones(i + 1) for i in range(4))
    nested = ((a, [b, {"x": c, "y": (None, 3, d)}], torch.float32), {"out": [a]})
    assert [id(t) for t in tensors_in(nested)] == [id(t) for t in tree_flatten(nested)[0]
                                                   if isinstance(t, torch.Tensor)]
    gc.disable()
    try:
        t = torch.ones(3)
        ref = weakref.ref(t)
        tensors_in(([t], {"k": t}))
        del t
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy, change, message", [
    ("fsdp2", ShardingChange(fsdp=True), "the step never makes a DistributedDataParallel"),
    ("ddp", ShardingChange(reshard_after_forward=True), "the step makes none \\(it does not use FSDP2\\)"),
    ("zero", ShardingChange(param_dtype=torch.bfloat16), "changes the step's fully_shard calls"),
])
def test_a_sharding_change_the_script_does_not_use_is_refused(strategy, change, message):
    from vramkit.trace.sharding.fake_dist import ShardedCaptureError

    with pytest.raises(ShardedCaptureError, match=message):
        capture(sm.builder("gpt", strategy), sharding=change)
    assert not dist.is_initialized()  # the capture's process group is gone


def test_a_step_waiting_for_another_ranks_key_is_cut_off_with_the_reason(monkeypatch, hang_guard):
    """A one-rank capture runs no other rank: a wait on the store for a key another rank sets
    would hang; it fails after STORE_TIMEOUT with a message that says why. The store the step
    waits on has that timeout (checked, not timed); the hang guard is there should it not."""
    import datetime

    from vramkit.trace.sharding import fake_dist

    monkeypatch.setattr(fake_dist, "STORE_TIMEOUT", datetime.timedelta(seconds=1))
    timeouts = []

    def build():
        step = sm.builder("gpt", "ddp")()

        def waiting_step():
            step()
            if dist.get_rank() != 0:  # wait until rank 0 says the checkpoint is written
                store = dist.distributed_c10d._get_default_store()
                timeouts.append(store.timeout)
                store.wait(["checkpoint-written"])

        return waiting_step

    with pytest.raises(vt.CaptureError, match="It waited 1 s on torch.distributed's key-value store") as info:
        hang_guard(300, capture, build, world_size=2, rank=1)
    assert timeouts == [datetime.timedelta(seconds=1)]  # the wait above ended after 1 s, not the default 30
    assert "vramkit_capture" in str(info.value) and isinstance(info.value.__cause__, dist.DistStoreError)
    assert not dist.is_initialized()


@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_ddp_buckets_are_their_own_category(model):
    """DDP's gradient buckets (gradient_as_bucket_view=False, DDP's default) are "ddp_bucket":
    at the last step's end the live buckets hold every gradient once, so their bytes equal the
    parameters' (all fp32, as the closed form writes them from the model's shapes); the buckets
    all-reduced each step (logged by the process group) are the same bytes. No other strategy
    has any."""
    import numpy as np

    t = capture(sm.builder(model, "ddp"))
    params = sum(p.numel() * 4 for p in (sm.GPT() if model == "gpt" else sm.CNN()).parameters())
    live = np.ones(t.num_allocations, bool)
    live[t.id[t.kind == vt.FREE]] = False
    bucket = t.alloc_category == vt.CATEGORIES.index("ddp_bucket")
    assert int(t.alloc_size[live & bucket].sum()) == params
    assert t.meta["distributed"]["steps"][-1]["all_reduce"]["bytes"] == params
    pred = vt.replay(t, "1GiB", overheads=vt.NO_OVERHEADS)
    assert pred.by_category.get("ddp_bucket", 0) >= params  # (rounded to 512-byte blocks)
    for other in ("fsdp2", "zero"):
        assert not (capture(sm.builder(model, other)).alloc_category == vt.CATEGORIES.index("ddp_bucket")).any()


def test_zero_imbalance_names_the_parameter_whose_state_a_rank_holds():
    """ZeroRedundancyOptimizer gives whole parameters to ranks: with a large embedding, the rank
    it lands on peaks higher, and the report says which module's state it holds and how much
    (AdamW: two fp32 moments of the embedding, written here from its shape)."""
    from torch import nn

    vocab, dim = 50_000, 64

    def build(batch):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, 8))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        x = torch.randint(0, vocab, (batch, 16))

        def step():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    report = predict_ranks(build, 2, world_size=2, gpu="1GiB", overheads=vt.NO_OVERHEADS)
    assert len(report.predictions) == 2  # the ranks' optimizer states differ: both captured
    words = report.imbalance()
    state = 2 * vocab * dim * 4
    assert f"holds the state of 0, {vt.format_size(state)}" in words, words
    assert f"rank {report.worst_rank} peaks" in words and "more optimizer state" in words


def test_a_script_that_needs_another_ranks_objects_is_named_at_its_line():
    """Shapes decided by an object rank 0 broadcasts: rank 0 (the source) captures; any other
    rank cannot receive it and gets an error naming the script's line, not the unpickling error
    of an empty buffer. all_gather_object needs every rank's object: refused on every rank."""
    import inspect

    from vramkit.trace.sharding.fake_dist import ShardedCaptureError

    def build(batch, gather=False):
        objs = [{"hidden": 48}] if dist.get_rank() == 0 else [None]
        if gather:
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, objs[0])  # the line named (gather)
        dist.broadcast_object_list(objs, src=0)  # the line named (broadcast)
        layer = torch.nn.Linear(objs[0]["hidden"], 8)
        x = torch.randn(batch, objs[0]["hidden"])

        def step():
            layer(x).sum().backward()

        return step

    lines = {n: inspect.getsourcelines(build)[1] + i for i, text in enumerate(inspect.getsource(build).splitlines())
             for n in ("gather", "broadcast") if f"# the line named ({n})" in text}
    assert capture(lambda: build(2), 2, 0).num_allocations > 0  # the source holds what it sends
    with pytest.raises(vt.CaptureError, match=f"{__file__}:{lines['broadcast']}: broadcast_object_list from rank 0; "
                                              "a one-rank capture of rank 1") as info:
        capture(lambda: build(2), 2, 1)
    assert isinstance(info.value.__cause__, ShardedCaptureError)
    for rank in (0, 1):
        with pytest.raises(vt.CaptureError, match=f":{lines['gather']}: all_gather_object gathers every rank"):
            capture(lambda: build(2, gather=True), 2, rank)
    assert not dist.is_initialized()


def offloading_gpt(batch: int, offload: bool = True):
    """FSDP2's CPU-offload recipe: the model on meta, fully_shard with CPUOffloadPolicy, then
    to_empty(device="cpu") (FSDP2 wants offloaded parameters on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    with torch.device("meta"):
        model = sm.GPT()
    kw = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if offload else torch.get_default_device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sm.training_step("gpt", model, opt, batch)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_offload_moves_exactly_the_model_state_to_the_host(world_size):
    """With CPUOffloadPolicy nothing of the model state is on the GPU: no parameter, gradient or
    optimizer-state storage in the trace; what the rank holds on the host at the end is exactly
    what the same step without offload holds on the GPU as parameters and optimizer state (the
    gradients are freed by zero_grad), plus the host-side step counters both have."""
    import numpy as np

    from vramkit.trace.sharding.sharding_changes import host_bytes

    rank = world_size - 1
    off = capture(lambda: offloading_gpt(4), world_size, rank)
    on = capture(lambda: offloading_gpt(4, offload=False), world_size, rank)
    model_state = {vt.CATEGORIES.index(c) for c in ("parameter", "gradient", "optimizer_state")}
    assert not np.isin(off.alloc_category, list(model_state)).any()
    live = np.ones(on.num_allocations, bool)
    live[on.id[on.kind == vt.FREE]] = False
    on_state = sum(int(on.alloc_size[live & (on.alloc_category == vt.CATEGORIES.index(c))].sum())
                   for c in ("parameter", "optimizer_state", "host"))
    assert host_bytes(off) == on_state > 0
    assert off.meta["strategy"]["cpu_offload"] and not on.meta["strategy"]["cpu_offload"]
    assert total_peak(off) < total_peak(on)
    # The change does what the script written with the policy does.
    changed = capture(lambda: offloading_gpt(4, offload=False), world_size, rank,
                      sharding=ShardingChange(cpu_offload=True))
    assert total_peak(changed) == total_peak(off) and host_bytes(changed) == host_bytes(off)


def test_cpu_offload_copies_each_shard_to_the_gpu_before_its_all_gather():
    """A real offloading run copies every shard it all-gathers to the GPU first (FSDP2's
    per-parameter path); on meta those copies are made too. Their bytes in each step equal the
    bytes the rank sends in that step's all-gathers, as the process group logged them."""
    import numpy as np

    def clone_bytes(t: vt.Trace) -> int:
        ops = np.array([t.name_of("ops", int(o)) if o >= 0 else "" for o in t.alloc_op])
        return int(t.alloc_size[ops == "aten::clone"].sum())

    off = capture(lambda: offloading_gpt(4), 2, 1)
    on = capture(lambda: offloading_gpt(4, offload=False), 2, 1)
    sent = sum(step["all_gather"]["sent"] for step in off.meta["distributed"]["steps"])
    assert sent > 0 and clone_bytes(off) - clone_bytes(on) == sent


def test_fit_suggests_cpu_offload_with_the_host_memory_it_takes():
    from vramkit.trace.sharding.sharding_changes import host_bytes

    off = capture(lambda: offloading_gpt(4))
    on = capture(lambda: offloading_gpt(4, offload=False))
    a = vt.replay(on, "1GiB", overheads=vt.NO_OVERHEADS)
    b = vt.replay(off, "1GiB", overheads=vt.NO_OVERHEADS)
    assert b.peak_reserved < a.peak_reserved
    cap = (a.peak_reserved + b.peak_reserved) // 2
    report = vt.fit(lambda bs: offloading_gpt(bs, offload=False), cap, batch_size=4, search=False, world_size=2,
                    overheads=vt.NO_OVERHEADS)
    assert not report.target.fits
    offload = [s for s in report.suggestions if s.settings == {"offload": True}]
    assert offload, report.table()
    assert offload[0].prediction.peak_reserved == vt.replay(off, cap, overheads=vt.NO_OVERHEADS).peak_reserved
    assert f"{vt.format_size(host_bytes(off))} of host memory per rank" in offload[0].cost
    assert "CPUOffloadPolicy()" in offload[0].cost


def _assert_same_events(a: vt.Trace, b: vt.Trace) -> None:
    import numpy as np

    for col in ("kind", "id", "size", "alloc_dtype", "alloc_category", "alloc_op", "alloc_module"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert (a.dtypes, a.ops, a.modules) == (b.dtypes, b.ops, b.modules)


def test_even_shards_capture_rank_0_only_and_every_rank_is_the_same():
    """The CNN's parameters all divide by 2 (10 outputs, 24 and 48 channels): on two ranks only
    rank 0 is captured, which is right only if rank 1's capture is the same event for event
    (checked here). On four ranks the head's 10 rows do not divide: the last rank is captured too."""
    build = lambda bs: sm.builder("cnn", "fsdp2", batch=bs)()  # noqa: E731
    two = predict_ranks(build, 4, world_size=2, gpu="1GiB", overheads=vt.NO_OVERHEADS)
    assert sorted(two.predictions) == [0], two.note
    assert "divides evenly among the 2 ranks" in two.note
    assert two.traces[0].meta["strategy"]["uneven_shards"] == 0
    one = predict_ranks(build, 4, world_size=2, gpu="1GiB", overheads=vt.NO_OVERHEADS, ranks=[1])
    _assert_same_events(two.traces[0], one.traces[1])
    four = predict_ranks(build, 4, world_size=4, gpu="1GiB", overheads=vt.NO_OVERHEADS)
    assert {0, 3} <= set(four.predictions), four.note
    assert four.traces[0].meta["strategy"]["uneven_shards"] == 2  # the head's weight and bias
    # DDP replicates: nothing is sharded, one capture answers for every rank.
    ddp_build = lambda bs: sm.builder("gpt", "ddp", batch=bs)()  # noqa: E731
    ddp = predict_ranks(ddp_build, 4, world_size=4, gpu="1GiB", overheads=vt.NO_OVERHEADS)
    assert sorted(ddp.predictions) == [0]
    last = predict_ranks(ddp_build, 4, world_size=4, gpu="1GiB", overheads=vt.NO_OVERHEADS, ranks=[3])
    _assert_same_events(ddp.traces[0], last.traces[3])


def test_the_first_capture_in_a_process_is_the_same_as_the_next():
    """The first capture of a process imports torch._dynamo lazily (at the first
    torch._disable_dynamo call, here in FSDP2's setup), whose import leaves frame cycles; with
    the collector off they held the builder's locals (DDP's parameters that FSDP2 replaced,
    385 KB here) through the steps. The setup's garbage is collected before the steps now."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path[:0] = [%r, %r]\n"
            "import test_trace_sharding_changes as t, sharded_models as sm\n"
            "from peaks import total_peak\n"
            "from vramkit.trace.sharding.sharding_changes import ShardingChange\n"
            "print([total_peak(t.capture(sm.builder('gpt', 'ddp'), sharding=ShardingChange(fsdp=True))) "
            "for _ in range(2)])\n") % (here, os.path.dirname(here))  # (a fresh process: its first capture)
    import vramkit

    env = dict(os.environ)  # (the child imports the vramkit this process runs: installed, or built in place)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(vramkit.__file__)),
                                                    env.get("PYTHONPATH")] if p)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == second
