"""vramkit's prediction of one rank of a sharded step against PyTorch's own estimators,
FSDPMemTracker (FSDP2) and MemTracker (DDP), run on the same rank of the same steps
(``torch_trackers``: torch's fake process group, real CPU tensors or FakeTensorMode).

What is asserted, and why it is honest:

* the sharded parameter bytes per rank, from a closed form written here from the model's
  shapes and the world size (FSDP2 cuts dim 0 into chunks of ceil(d0 / N) rows and pads each
  rank's storage to a full chunk), seen by both tools;
* AdamW's state per rank: two moments of the unpadded local shard each, plus (tracker only)
  one 4-byte ``step`` tensor per parameter, which vramkit files as host memory (on a GPU it is
  a CPU tensor) and leaves out of the peak;
* the peak: both tools follow the same execution (FSDP2's or DDP's own code for that rank), so
  the tracker's peak less the step counters equals vramkit's, within 1 KiB (meta and CPU
  kernels may save a tiny tensor in another dtype: see test_trace_distributed);
* FakeTensorMode gives the tracker the same peak as real tensors.

vramkit against a real multi-process run is test_trace_distributed's business.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch", allow_module_level=True)
pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")

import sharded_models as sm  # noqa: E402
import torch_trackers as tt  # noqa: E402
import vramkit.trace as vt  # noqa: E402
from peaks import total_peak  # noqa: E402

WORLD = 2


def _gpt_shapes() -> list[torch.Size]:
    with torch.device("meta"):
        return [p.shape for p in sm.GPT().parameters()]


def _shard_bytes(shapes: list[torch.Size], n: int, rank: int, padded: bool) -> int:
    total = 0
    for shape in shapes:
        chunk = -(-shape[0] // n)
        rows = chunk if padded else max(0, min(chunk, shape[0] - rank * chunk))
        total += rows * int(np.prod(shape[1:], dtype=np.int64)) * 4
    return total


def _live_by_category(t: vt.Trace) -> dict[str, int]:
    live = np.ones(t.num_allocations, bool)
    live[t.id[t.kind == vt.FREE]] = False
    return {c: int(t.alloc_size[live & (t.alloc_category == i)].sum()) for i, c in enumerate(vt.CATEGORIES)}


@pytest.mark.parametrize("rank", [0, WORLD - 1])
def test_fsdp2_rank_fsdpmemtracker_and_vramkit(rank):
    shapes = _gpt_shapes()
    padded, local = _shard_bytes(shapes, WORLD, rank, True), _shard_bytes(shapes, WORLD, rank, False)
    # 1003 rows do not split in two: rank 0 holds 502, the last rank 501 in a padded 502-row storage
    assert (padded > local) == (rank == WORLD - 1)
    steps_bytes = 4 * len(shapes)  # AdamW's step counters

    tracked = tt.tracker_run("gpt", "fsdp2", WORLD, rank)
    assert tracked["tool"] == "FSDPMemTracker"
    assert tracked["at_entry"]["Sharded Param"] == padded
    assert tracked["at_entry"]["Inputs"] == 4 * sm.SEQ * 8  # the batch: 4 x SEQ int64 tokens
    assert tracked["peak_snapshot"]["Sharded Param"] == padded
    assert tracked["after_step"][-1]["OptState"] == 2 * local + steps_bytes

    t = vt.capture(sm.builder("gpt", "fsdp2"), device="meta", steps=2, cuda=False, world_size=WORLD, rank=rank)
    by_cat = _live_by_category(t)
    assert by_cat["parameter"] == padded
    assert by_cat["optimizer_state"] == 2 * local

    predicted = total_peak(t)
    assert abs((tracked["peak"] - steps_bytes) - predicted) <= 1024, (tracked["peak"], predicted)

    fake = tt.tracker_run("gpt", "fsdp2", WORLD, rank, fake_tensors=True)
    assert fake["peak"] == tracked["peak"]


def test_ddp_memtracker_and_vramkit():
    """DDP replicates: the whole model per rank; MemTracker sees it with PyTorch's no-op comm hook
    on torch's fake group."""
    shapes = _gpt_shapes()
    full = sum(int(np.prod(s, dtype=np.int64)) * 4 for s in shapes)
    tracked = tt.tracker_run("gpt", "ddp", WORLD, 0)
    assert tracked["tool"] == "MemTracker"
    assert tracked["at_entry"]["Parameter"] == full
    assert tracked["after_step"][-1]["Optstate"] == 2 * full + 4 * len(shapes)
    predicted = total_peak(vt.capture(sm.builder("gpt", "ddp"), device="meta", steps=2, cuda=False, world_size=WORLD,
                                      rank=0))
    assert abs((tracked["peak"] - 4 * len(shapes)) - predicted) <= 1024, (tracked["peak"], predicted)
