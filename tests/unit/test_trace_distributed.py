"""One rank of a sharded job captured in one process (``capture(..., world_size=N, rank=r)``),
checked against real multi-process gloo runs of the same steps, against closed forms, and on
bad input.

The real runs: ``torch.multiprocessing.spawn`` starts N processes (N = 2 and 4) that form a gloo
group on this machine; every rank runs each model (a GPT-style decoder and a CNN, from
``sharded_models``) under each strategy (DDP; FSDP2 with ``reshard_after_forward`` True and
False, with bf16 parameters (and checkpointed blocks, the GPT's), and with deferred
initialization; ZeroRedundancyOptimizer) from nothing to the end of its second step under
torch.profiler, three times. The reference is PyTorch's allocator accounting of those runs
(``peaks.allocator_peaks``): nothing of vramkit's takes part in it. The prediction for that
rank is a meta capture under the capture's process group, in this process.

What differs between the two, each measured and named here (figures on 2 ranks, GPT):

* **Frees torch.profiler does not see.** A gloo work holds its tensors; when its worker thread,
  not the training thread, drops the last reference, the storage is freed on a thread the
  profiler does not follow and no event says so: the events' own sum stays high to the end of
  the run. With FSDP2 that is an all-gather output or a reduce-scatter input, now and then:
  the events' sum puts FSDP2 at up to 0.80-0.92 of the prediction's bytes (issue 33). The
  reference reads the allocator's own total instead, counted on every thread (c10's
  ``caffe2_report_cpu_memory_usage``), and pairs each unseen free with its storage.
* **gloo's own copies** ("backend"). gloo runs a reduce-scatter as an all-reduce of a
  full-size copy of the input, made inside the c10d op, and its all-gather fills full-size
  temporaries; NCCL reduces and gathers in place, into the caller's buffers. Leaving out what
  the backend's scopes hold gives what an NCCL run of the same steps would hold: FSDP2's peak
  is at the root's reduce-scatter, 103 KB (fp32) and 399 KB (bf16) below the figure with them.
  The prediction has none of them (asserted); DDP and ZeroRedundancyOptimizer make none.
* **CPU kernels' scratch** ("scratch"). With bf16, oneDNN's matmuls and convolutions reorder
  their operands into buffers they allocate and free inside the op (94 KB GPT, 64 KB CNN; and
  11-13 KB for the CNN's fp32 convolutions on 4 ranks), which a GPU's cuBLAS and cuDNN do in
  their workspaces. With each op's own allocate-and-free
  left out, the prediction is within 1 %; with them, below by that scratch (at most 6 %: the
  CNN's bf16 convolutions on 4 ranks).
* **When gloo lets go.** A buffer FSDP2 has released can outlive it inside a gloo work until
  the worker thread drops it: a real run's peak then rises by up to one block's buffers. The
  smallest of three runs is compared.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import sharded_models as sm  # noqa: E402
import vramkit.trace as vt  # noqa: E402
from peaks import total_peak  # noqa: E402
from vramkit.trace.sharding.fake_dist import ShardedCaptureError, collective_bytes  # noqa: E402

CONFIGS = [(m, s) for m in ("gpt", "cnn") for s in sm.STRATEGIES]
MiB = 1 << 20

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch", allow_module_level=True)


def predict(model: str, strategy: str, world_size: int, rank: int, device: str = "meta") -> vt.Trace:
    return vt.capture(sm.builder(model, strategy), device=device, steps=2, cuda=False, world_size=world_size,
                      rank=rank)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def real_runs(request, tmp_path_factory):
    """Each rank's measurements from one real gloo job of `world_size` processes."""
    import torch.multiprocessing as mp

    n = request.param
    out = tmp_path_factory.mktemp(f"gloo{n}")
    mp.spawn(sm.measure_rank, args=(n, str(out / "store"), CONFIGS, str(out)), nprocs=n, join=True)
    return n, [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.slow
def test_each_rank_against_a_real_gloo_run(real_runs):
    world_size, ranks = real_runs
    rows = []
    for model, strategy in CONFIGS:
        for rank, measured in enumerate(ranks):
            real = measured[f"{model}/{strategy}"]
            t = predict(model, strategy, world_size, rank)
            first_use = [int(t.alloc_size[i]) for i in range(t.num_allocations)
                         if t.alloc_op[i] >= 0 and t.name_of("ops", int(t.alloc_op[i])) == "(first use)"]
            assert max(first_use, default=0) <= 8, first_use  # no backend-internal storages: AdamW's step scalars only
            p = total_peak(t)
            row = (model, strategy, rank, p, real["no_backend_netted"], real["no_backend"], real["all"], real["main"])
            rows.append(row)
            # DDP rebuilds its buckets in the second step's forward, and the old ones die only
            # when gloo's work on them is dropped, at the worker thread's pace: in slow runs (ASan)
            # all three runs held both for a moment, one bucket set (the gradients' bytes) above
            # the prediction: either that or nothing.
            held = _bucket_set(t) if strategy == "ddp" and real["no_backend_netted"] - p > _bucket_set(t) / 2 else 0
            # An NCCL run's figure (gloo's copies left out), the CPU kernels' scratch left out: 1 %;
            # 2 % for FSDP2, whose released buffers a gloo work can hold a moment longer, until its
            # worker thread drops it: in a loaded machine (CI, 4 ranks on 2 cores) all three runs
            # of a configuration held about 100 KiB (1.6 %) that way once.
            slack = 0.02 if strategy.startswith("fsdp2") else 0.01
            nccl = real["no_backend_netted"]
            assert abs(p + held - nccl) <= slack * nccl, row
            # With the scratch: below, by no more than the scratch (6 % at most here: the CNN's
            # bf16 convolutions on 4 ranks; 0-2 % elsewhere).
            short = real["no_backend"] - (p + held)
            assert -slack * real["no_backend"] <= short <= real["scratch"] + slack * real["no_backend"], row
            if strategy in ("ddp", "zero"):  # gloo copies nothing here
                assert real["backend"] == 0, row
    # ZeroRedundancyOptimizer gives whole parameters to ranks: their optimizer states differ,
    # and the prediction follows each rank.
    zero = [r for r in rows if r[0] == "gpt" and r[1] == "zero"]
    assert len({r[3] for r in zero}) > 1 and len({r[4] for r in zero}) > 1


def _bucket_set(t: vt.Trace) -> int:
    """Bytes of DDP's gradient buckets live at the end of the trace: one set, every gradient once."""
    live = np.ones(t.num_allocations, bool)
    live[t.id[t.kind == vt.FREE]] = False
    return int(t.alloc_size[live & (t.alloc_category == vt.CATEGORIES.index("ddp_bucket"))].sum())


def _sharded_bytes(shapes: list[torch.Size], n: int, rank: int, padded: bool, itemsize: int = 4) -> int:
    """Per-rank bytes of parameters of these shapes sharded as FSDP2 shards them: dim 0 cut
    into chunks of ceil(d0 / n) rows, rank r holding rows [r * chunk, (r + 1) * chunk) of those
    that exist. FSDP2's parameter storage is padded to the full chunk (`padded`); the local
    tensor the optimizer sees, and so its state, is not."""
    total = 0
    for shape in shapes:
        chunk = -(-shape[0] // n)
        rows = chunk if padded else max(0, min(chunk, shape[0] - rank * chunk))
        total += rows * int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    return total


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_fsdp2_model_state_is_the_closed_form(world_size):
    """ZeRO-3-style full sharding: parameters and AdamW's two moments per rank are each the
    sharded size of the parameters (formula above, written from the model's shapes); the peak
    holds at least those three, the sharded gradients and one all-gathered group."""
    with torch.device("meta"):
        shapes = [p.shape for p in sm.GPT().parameters()]
    rank = world_size - 1  # the last rank: the short (or empty) chunks
    t = predict("gpt", "fsdp2", world_size, rank=rank)
    live = np.ones(t.num_allocations, bool)
    live[t.id[t.kind == vt.FREE]] = False
    by_cat = {c: int(t.alloc_size[live & (t.alloc_category == vt.CATEGORIES.index(c))].sum())
              for c in ("parameter", "optimizer_state")}
    padded, local = _sharded_bytes(shapes, world_size, rank, True), _sharded_bytes(shapes, world_size, rank, False)
    assert by_cat["parameter"] == padded
    assert by_cat["optimizer_state"] == 2 * local
    with torch.device("meta"):
        block = sum(p.numel() * 4 for p in sm.Block().parameters())
    assert total_peak(t) >= padded + 3 * local + (block if world_size > 1 else 0)


def test_deferred_initialization_holds_no_memory():
    """FSDP2's recipe builds the model on meta, shards it, then ``to_empty`` allocates the
    shards: the meta-built full parameters hold nothing in a real run. The prediction leaves
    them out ("deferred") and equals the same model built directly, and the same capture on the
    CPU (where meta storage is not memory); the real gloo runs above check the recipe itself."""
    for model in ("gpt", "cnn"):
        deferred = predict(model, "fsdp2-deferred", 2, 1)
        direct = predict(model, "fsdp2", 2, 1)
        cpu = predict(model, "fsdp2-deferred", 2, 1, device="cpu")
        assert (deferred.alloc_category == vt.CATEGORIES.index("deferred")).any()
        assert not (cpu.alloc_category == vt.CATEGORIES.index("deferred")).any()
        assert abs(total_peak(deferred) - total_peak(cpu)) <= 1024
        # the direct build holds the full parameters before sharding them; the recipe never does
        full = sum(p.numel() * 4 for p in (sm.GPT() if model == "gpt" else sm.CNN()).parameters())
        assert total_peak(deferred) <= total_peak(direct) and peak_before_first_step(direct) >= full
        replayed = vt.replay(deferred, "8GiB", overheads=vt.NO_OVERHEADS)
        assert abs(replayed.peak_allocated - vt.replay(cpu, "8GiB", overheads=vt.NO_OVERHEADS).peak_allocated) <= 4096


def peak_before_first_step(t: vt.Trace) -> int:
    first = np.flatnonzero(t.kind == vt.STEP)[0]
    mem = np.flatnonzero(t.kind <= vt.FREE)
    mem = mem[mem < first]
    sizes = t.alloc_size.astype(np.int64)
    return int(np.cumsum(np.where(t.kind[mem] == vt.ALLOC, sizes[t.id[mem]], -sizes[t.id[mem]])).max())


def test_ranks_differ_only_where_shards_do():
    """DDP replicates everything: every rank the same. ZeroRedundancyOptimizer assigns whole
    parameters to ranks by size: rank 0 and the last differ."""
    ddp = {total_peak(predict("gpt", "ddp", 4, r)) for r in range(4)}
    assert len(ddp) == 1
    zero = [total_peak(predict("gpt", "zero", 4, r)) for r in (0, 3)]
    assert zero[0] != zero[1]


def test_meta_equals_cpu_under_the_capture_group():
    """The same rank captured on meta and on the CPU (both with the capture's process group):
    the same allocations of 4 KiB and more, and peaks within 1 KiB, for every strategy. Small
    allocations differ: with bf16 parameters LayerNorm saves its statistics in fp32 on meta
    (as CUDA does) and in bf16 on the CPU; DDP's setup makes five copies on meta that it does
    not make on the CPU (under 2 KiB together); FSDP2's peak moves by a 32-byte scalar."""
    for strategy in sm.STRATEGIES:
        meta, cpu = predict("gpt", strategy, 2, 1), predict("gpt", strategy, 2, 1, device="cpu")
        if strategy == "fsdp2-deferred":
            # After to_empty, FSDP2 re-pads a parameter whose rows do not split evenly unless its
            # local tensor and padded buffer share a storage, which it tells by data_ptr(): 0 for
            # every meta storage. So meta keeps the unpadded tensor where the CPU (and a GPU) make
            # a padded copy: here the embedding's and the head's (1003 rows over 2 ranks).
            padded = 2 * (-(-sm.VOCAB // 2)) * sm.DIM * 4
            assert 0 <= total_peak(cpu) - total_peak(meta) <= padded, strategy
            continue
        assert abs(total_peak(meta) - total_peak(cpu)) <= 1024, strategy
        real = [t.alloc_size[t.alloc_category != vt.CATEGORIES.index("deferred")] for t in (meta, cpu)]
        big = [sorted(s for s in sizes.tolist() if s >= 4096) for sizes in real]
        assert big[0] == big[1], strategy
        assert abs(int(real[0].sum()) - int(real[1].sum())) < 16 * 1024, strategy


def test_collectives_are_counted_per_step():
    t = predict("gpt", "fsdp2", 4, 0)
    info = t.meta["distributed"]
    assert info["world_size"] == 4 and info["rank"] == 0 and len(info["steps"]) == 2
    step = info["steps"][-1]
    with torch.device("meta"):
        full = sum(p.numel() * 4 for p in sm.GPT().parameters())
    # Each step all-gathers every parameter once in forward and once more in backward for the
    # blocks resharded after forward (the root stays unsharded), and reduce-scatters every
    # gradient once; buffers are padded to a multiple of the world size.
    assert step["reduce_scatter"]["bytes"] >= full
    assert step["all_gather"]["bytes"] > full
    for op in ("all_gather", "reduce_scatter"):  # a rank of 4 sends 3/4 of each buffer (ring)
        assert 0.74 * step[op]["bytes"] <= step[op]["sent"] <= 0.75 * step[op]["bytes"]
    ddp = predict("gpt", "ddp", 4, 0).meta["distributed"]["steps"][-1]
    assert ddp["all_reduce"]["bytes"] == full  # DDP all-reduces every gradient once per step


@pytest.mark.parametrize("strategy", sm.STRATEGIES)
def test_sharded_categories(strategy):
    """FSDP2's gathered parameters are "unsharded_parameter": each step's allocations of them
    add up to the bytes its all-gathers produce (logged by the process group, independently);
    its collective buffers are "communication", at least the reduce-scatter inputs. DDP and
    ZeroRedundancyOptimizer have neither."""
    t = predict("gpt", strategy, 4, 0)
    last = np.flatnonzero(t.kind == vt.STEP)[-1]
    in_step = np.zeros(t.num_allocations, bool)
    in_step[t.id[(np.arange(len(t.kind)) > last) & (t.kind == vt.ALLOC)]] = True
    size = {c: int(t.alloc_size[in_step & (t.alloc_category == vt.CATEGORIES.index(c))].sum())
            for c in ("unsharded_parameter", "communication")}
    step = t.meta["distributed"]["steps"][-1]
    if strategy.startswith("fsdp2"):
        assert size["unsharded_parameter"] == step["all_gather"]["bytes"]
        assert size["communication"] >= step["reduce_scatter"]["bytes"] > 0
    else:
        assert size == {"unsharded_parameter": 0, "communication": 0}


def test_collective_bytes_ring_formulas():
    assert collective_bytes("all_reduce", 800, 4) == 1200
    assert collective_bytes("all_gather", 800, 4) == 600
    assert collective_bytes("reduce_scatter", 800, 4) == 600
    assert collective_bytes("broadcast", 800, 4) == 800
    assert collective_bytes("all_reduce", 800, 1) == 0


def test_a_script_that_calls_init_process_group_itself():
    """Scripts call dist.init_process_group("nccl") and read torchrun's variables: under the
    capture the call succeeds, the variables hold the rank's values, and afterwards the
    process is as it was."""
    seen = {}
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def build():
        dist.init_process_group("nccl")
        seen.update(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]),
                    local=int(os.environ["LOCAL_RANK"]), dist_rank=dist.get_rank(), dist_world=dist.get_world_size())
        step = sm.builder("gpt", "ddp")()

        def train():
            step()
            dist.barrier()

        return train

    t = vt.capture(build, device="meta", steps=2, cuda=False, world_size=8, rank=5)
    assert seen == {"rank": 5, "world": 8, "local": 5, "dist_rank": 5, "dist_world": 8}
    assert t.meta["distributed"]["world_size"] == 8
    assert not dist.is_initialized()
    assert {k: os.environ.get(k) for k in before} == before


@pytest.mark.parametrize("world_size, rank, error, match", [
    (0, 0, ValueError, "world_size must be >= 1"),
    (-2, 0, ValueError, "world_size must be >= 1"),
    (2.0, 0, TypeError, "world_size must be an integer"),
    ("4", 0, TypeError, "world_size must be an integer"),
    (True, 0, TypeError, "world_size must be an integer"),
    (4, 4, ValueError, r"rank must be in 0\.\.3"),
    (4, -1, ValueError, r"rank must be in 0\.\.3"),
    (None, 1, ValueError, "needs world_size"),
])
def test_bad_world_size_or_rank(world_size, rank, error, match):
    with pytest.raises(error, match=match):
        vt.capture(sm.builder("gpt", "ddp"), device="meta", world_size=world_size, rank=rank)
    assert not dist.is_initialized()


def test_a_script_asking_for_another_world_size_is_named():
    def build():
        dist.init_process_group("nccl", world_size=16, rank=0)  # the line the error names
        return lambda: None

    with pytest.raises(vt.CaptureError) as info:
        vt.capture(build, device="meta", world_size=8, rank=0)
    cause = info.value.__cause__
    assert isinstance(cause, ShardedCaptureError)
    assert "world size 16" in str(cause) and "world size 8" in str(cause)
    assert f"{__file__}:" in str(cause)
    assert not dist.is_initialized()


def test_capture_refuses_an_initialized_process_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(ShardedCaptureError, match="already initialized"):
            vt.capture(sm.builder("gpt", "ddp"), device="meta", world_size=2)
    finally:
        dist.destroy_process_group()


def test_point_to_point_is_refused_with_the_reason():
    def build():
        x = torch.zeros(4)
        return lambda: dist.send(x, dst=1)

    with pytest.raises(vt.CaptureError) as info:
        vt.capture(build, device="meta", world_size=2, rank=0)
    assert "send/recv" in str(info.value)
    assert not dist.is_initialized()
