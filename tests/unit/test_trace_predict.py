"""vramkit.trace.replay and fit: peaks against NumPy recomputations of the trace, OOM
boundaries, the batch-size search against an exhaustive search, and bad input."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from vramkit import trace as vt

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_models import GPTConfig, gpt_builder, resnet_builder  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(scope="module")
def gpt_trace():
    return vt.capture(gpt_builder(GPTConfig(layers=3)), 4, device="meta", steps=2)


def test_peak_allocated_equals_the_rounded_live_bytes(gpt_trace):
    pred = vt.replay(gpt_trace, "80GiB", overheads=vt.NO_OVERHEADS)
    device = [c for c in vt.CATEGORIES if c != "host"]
    assert pred.fits and pred.oom is None
    assert pred.peak_allocated == vt.peak_live_bytes(gpt_trace, rounded=True, categories=device)
    assert pred.peak_requested == vt.peak_live_bytes(gpt_trace, categories=device)
    assert pred.peak_reserved >= pred.peak_allocated
    assert sum(pred.by_category.values()) == pred.peak_allocated
    assert set(pred.by_category) <= set(vt.CATEGORIES) and "host" not in pred.by_category
    with_host = vt.replay(gpt_trace, "80GiB", overheads=vt.NO_OVERHEADS, include_host=True)
    assert with_host.peak_allocated == vt.peak_live_bytes(gpt_trace, rounded=True)


def test_line_items_are_explicit(gpt_trace):
    bare = vt.replay(gpt_trace, "80GiB", overheads=vt.NO_OVERHEADS)
    ov = vt.GpuOverheads(cuda_context=500 * MiB, cublas_workspace=32 * MiB)
    pred = vt.replay(gpt_trace, "80GiB", overheads=ov)
    assert pred.usable == 80 * GiB - 500 * MiB
    # The 32 MiB workspace is live from the first step on, so it adds exactly to the peak.
    assert pred.peak_allocated == bare.peak_allocated + 32 * MiB
    assert pred.by_category["workspace"] == 32 * MiB
    assert "cuda context" in pred.table() and "cublas workspace" in pred.table()


def test_oom_boundary_and_location(gpt_trace):
    ok = vt.replay(gpt_trace, "80GiB", overheads=vt.NO_OVERHEADS)
    assert vt.replay(gpt_trace, ok.peak_reserved, overheads=vt.NO_OVERHEADS).fits
    bad = vt.replay(gpt_trace, ok.peak_allocated - 1, overheads=vt.NO_OVERHEADS)
    assert not bad.fits
    o = bad.oom
    # The failing request: the allocation at that event in the trace, named by module and op.
    i = int(gpt_trace.id[o["event"]])
    assert gpt_trace.kind[o["event"]] == vt.ALLOC and o["size"] == int(gpt_trace.size[o["event"]])
    assert o["op"] == gpt_trace.name_of("ops", int(gpt_trace.alloc_op[i]))
    assert o["phase"] in vt.PHASES and "Tried to allocate" in o["message"]
    # What was live then, rounded, plus the request exceeds the capacity.
    before = vt.Trace.from_columns(kind=gpt_trace.kind[:o["event"]], id=gpt_trace.id[:o["event"]],
                                   size=gpt_trace.size[:o["event"]])
    assert o["allocated"] <= ok.peak_allocated
    assert bad.verdict().startswith("OOM at ")
    assert before.num_events == o["event"]


def test_alloc_conf_is_applied(gpt_trace):
    t = vt.Trace.from_columns(kind=[vt.ALLOC], id=[0], size=[5 * MiB + 1])
    a = vt.replay(t, "80GiB", overheads=vt.NO_OVERHEADS)
    b = vt.replay(t, "80GiB", {"roundup_power2_divisions": 4}, overheads=vt.NO_OVERHEADS)
    assert b.alloc_conf == "roundup_power2_divisions:4"
    assert a.peak_allocated == 5 * MiB + 512  # 512-byte rounding
    assert b.peak_allocated == 6 * MiB  # [4, 8) MiB in quarters: 4, 5, 6, 7
    with pytest.raises(ValueError):
        vt.replay(gpt_trace, "80GiB", "no_such_option:1")


@pytest.mark.parametrize("text, value", [
    ("24GiB", 24 * GiB), ("40 GiB", 40 * GiB), ("80gib", 80 * GiB), ("512MiB", 512 * MiB), ("1.5GiB", 3 * GiB // 2),
    ("24e9", 24 * 10**9), ("1024", 1024), (2048, 2048), ("16G", 16 * GiB),
])
def test_parse_size(text, value):
    assert vt.parse_size(text) == value


@pytest.mark.parametrize("text, message", [
    ("24 GB", "ambiguous: GB means 10\\^9 bytes"), ("24GB", "write '24GiB'"), ("garbage", "is not a size"),
    ("24 parsecs", "unknown unit"), ("0", "between 1 byte"), ("-5GiB", "is not a size"), (1.5, "whole number"),
])
def test_parse_size_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        vt.parse_size(text)
    with pytest.raises(TypeError):
        vt.parse_size(None)


def test_fit_search_equals_exhaustive_search():
    build = resnet_builder(widths=(8, 16), blocks=(1, 1), image=16)
    cap = 4 * MiB
    fits = [vt.replay(vt.capture(build, b, device="meta", steps=2), cap, overheads=vt.NO_OVERHEADS).fits
            for b in range(1, 65)]
    assert fits[0] and not fits[-1]
    largest = max(b for b, ok in enumerate(fits, 1) if ok)
    # Memory grows with the batch, so what fits is a prefix; the search must find its end.
    assert all(fits[:largest]) and not any(fits[largest:])
    lines: list[str] = []
    report = vt.fit(build, cap, overheads=vt.NO_OVERHEADS, progress=lines.append)
    assert report.max_batch_size == largest
    assert len(report.probes) < 2 * np.log2(largest) + 4  # doubling then bisection, not a scan
    assert len(lines) == len(report.probes) and "fits" in "".join(lines)
    assert f"largest batch size that fits: {largest}" in report.table()
    capped = vt.fit(build, cap, overheads=vt.NO_OVERHEADS, max_batch_size=largest - 3)
    assert capped.max_batch_size == largest - 3
    assert f"largest batch size that fits: {largest - 3} (the search's cap)" in capped.table()


def test_fit_suggests_accumulation_for_a_batch_that_does_not_fit():
    build = resnet_builder(widths=(8, 16), blocks=(1, 1), image=16)
    cap = 4 * MiB
    report = vt.fit(build, cap, batch_size=64, overheads=vt.NO_OVERHEADS, search=False)
    assert not report.target.fits and not report.fits
    acc = [s for s in report.suggestions if "accumulation_steps" in s.settings]
    assert acc, report.table()
    s = acc[0]
    assert s.settings["micro_batch_size"] * s.settings["accumulation_steps"] == 64
    assert s.prediction.fits
    # It is the fewest accumulation steps that fit: the next larger micro-batch that divides 64 does not.
    bigger = s.settings["micro_batch_size"] * 2
    assert not vt.replay(vt.capture(build, bigger, device="meta", steps=2), cap, overheads=vt.NO_OVERHEADS).fits
    assert report.table().startswith("batch size 64: OOM at ")


def test_fit_bad_input():
    build = resnet_builder()
    with pytest.raises(TypeError, match="build must be callable"):
        vt.fit(None, "1GiB")
    with pytest.raises(ValueError, match="ambiguous"):
        vt.fit(build, "24 GB")
    with pytest.raises(ValueError, match="batch_size must be"):
        vt.fit(build, "1GiB", batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size must be"):
        vt.fit(build, "1GiB", max_batch_size=-1)

    def broken(batch_size):
        raise RuntimeError("no such dataset")

    with pytest.raises(vt.CaptureError, match="no such dataset"):
        vt.fit(broken, "1GiB")


def test_replay_bad_input(gpt_trace):
    with pytest.raises(TypeError, match="must be a vramkit.trace.Trace"):
        vt.replay("trace.vktrace", "24GiB")
    with pytest.raises(ValueError, match="leaves nothing"):
        vt.replay(gpt_trace, "256MiB", overheads=vt.GpuOverheads(cuda_context=512 * MiB))
    with pytest.raises(ValueError, match="must be >= 0"):
        vt.replay(gpt_trace, "1GiB", overheads=vt.GpuOverheads(cuda_context=-1))


def test_checkpoint_blocks_equals_a_model_that_checkpoints_itself():
    """fit's "checkpoint every block" capture against the same model written with
    torch.utils.checkpoint around each block: the same allocations, so the same peaks."""
    from dataclasses import replace

    cfg = GPTConfig(layers=3)
    wrapped = vt.capture(gpt_builder(cfg), 4, steps=2, checkpoint_blocks=True)
    written = vt.capture(gpt_builder(replace(cfg, checkpoint=True)), 4, steps=2)
    assert wrapped.meta["checkpointed_blocks"] == "layers (3 x Block)"
    np.testing.assert_array_equal(wrapped.kind, written.kind)
    np.testing.assert_array_equal(wrapped.size, written.size)
    a = vt.replay(wrapped, "1GiB", overheads=vt.NO_OVERHEADS)
    b = vt.replay(written, "1GiB", overheads=vt.NO_OVERHEADS)
    plain = vt.replay(vt.capture(gpt_builder(cfg), 4, steps=2), "1GiB", overheads=vt.NO_OVERHEADS)
    assert (a.peak_allocated, a.peak_reserved) == (b.peak_allocated, b.peak_reserved)
    assert a.by_category["activation"] < plain.by_category["activation"]
    # The blocks are restored after the capture.
    assert vt.capture(gpt_builder(cfg), 4, steps=2).num_events == vt.capture(gpt_builder(cfg), 4, steps=2).num_events


def test_fit_suggests_checkpointing_when_it_is_what_makes_the_batch_fit():
    cfg = GPTConfig(layers=4, seq=256, dim=128)
    build = gpt_builder(cfg)

    def peak(**kw):
        return vt.replay(vt.capture(build, 16, steps=2, **kw), "8GiB", overheads=vt.NO_OVERHEADS).peak_reserved

    plain, every = peak(), peak(checkpoint_blocks=True)
    cap = (plain + every) // 2  # between the two: some checkpointing fits
    report = vt.fit(build, cap, batch_size=16, overheads=vt.NO_OVERHEADS, search=False)
    assert not report.target.fits
    ck = [s for s in report.suggestions if s.settings.get("checkpoint_blocks") and "accumulation_steps" not in s.settings
          and "autocast" not in s.settings]
    assert ck, report.table()
    k = ck[0].settings["checkpointed_count"]
    # The fewest blocks: checkpointing the first k fits, the first k - 1 does not (by exhaustive check).
    fits = [vt.replay(vt.capture(build, 16, steps=2, checkpoint_blocks=j), cap, overheads=vt.NO_OVERHEADS).fits
            for j in range(0, 5)]
    assert fits.index(True) == k
    assert ck[0].prediction.peak_reserved == peak(checkpoint_blocks=k)
    assert f"{k} block forward(s) more per step" in ck[0].cost and "layers (4 x Block)" in ck[0].change


def test_fit_suggests_bf16_autocast_when_it_is_enough():
    cfg = GPTConfig(layers=2, seq=256, dim=128)
    build = gpt_builder(cfg)
    plain = vt.replay(vt.capture(build, 16, steps=2), "8GiB", overheads=vt.NO_OVERHEADS)
    amp = vt.replay(vt.capture(build, 16, steps=2, autocast=torch.bfloat16), "8GiB", overheads=vt.NO_OVERHEADS)
    assert amp.peak_reserved < plain.peak_reserved
    cap = (plain.peak_reserved + amp.peak_reserved) // 2
    report = vt.fit(build, cap, batch_size=16, overheads=vt.NO_OVERHEADS, search=False)
    first = report.suggestions[0]
    assert first.settings == {"autocast": "bfloat16"}, report.table()
    assert first.prediction.peak_reserved == amp.peak_reserved
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in first.cost
    # Nothing that includes autocast with more changes is listed: autocast alone is enough.
    assert not any("autocast" in s.settings and len(s.settings) > 1 for s in report.suggestions)


def test_fit_on_a_gpu_without_bf16_suggests_fp16_autocast():
    from vramkit.trace.capturing.cuda_choices import CudaChoices

    t4 = vt.GpuProfile("T4", 15 << 30, (7, 5))
    cfg = GPTConfig(layers=2, seq=256, dim=128)
    build = gpt_builder(cfg)
    sm75 = CudaChoices(arch=(7, 5))
    plain = vt.replay(vt.capture(build, 16, steps=2, cuda=sm75), "8GiB", overheads=vt.NO_OVERHEADS)
    amp = vt.replay(vt.capture(build, 16, steps=2, cuda=sm75, autocast=torch.float16), "8GiB",
                    overheads=vt.NO_OVERHEADS)
    assert amp.peak_reserved < plain.peak_reserved
    cap = (plain.peak_reserved + amp.peak_reserved) // 2
    report = vt.fit(build, vt.resolve_target(t4, capacity=cap, overheads=vt.NO_OVERHEADS), batch_size=16, search=False)
    first = report.suggestions[0]
    assert first.settings == {"autocast": "float16"}, report.table()
    assert first.prediction.peak_reserved == amp.peak_reserved
    assert "GradScaler" in first.cost and "no bf16" in first.cost
