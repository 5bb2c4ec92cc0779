"""Allocation sites and the replay behind them, on traces recorded on fresh sim devices.

Every expected number is worked out here from the operations the test performs (sizes are
multiples of 512 B, so no rounding is involved), or read from the allocator's own counters,
never from vramkit.report.sites itself.

Memory is taken as Buffers (vramkit.empty), freed on their own device when dropped. raw_free()
would do as well within one device, but it takes only an address and every sim device hands out
the same addresses, so a block another test left behind could be freed in place of ours.
"""

from __future__ import annotations

import inspect

import pytest

import vramkit
from vramkit.report.sites import BEFORE_HISTORY, allocation_sites, device_trace, is_internal_frame, replay

KiB, MiB = 1 << 10, 1 << 20


def alloc_small(device: str) -> vramkit.Buffer:
    return vramkit.empty(1 * KiB, device=device)


def alloc_medium(device: str) -> vramkit.Buffer:
    return vramkit.empty(4 * MiB, device=device)


def alloc_big(device: str) -> vramkit.Buffer:
    return vramkit.empty(40 * MiB, device=device)


def alloc_churn(device: str) -> vramkit.Buffer:
    return vramkit.empty(8 * MiB, device=device)


def alloc_tiny_churn(device: str) -> vramkit.Buffer:
    return vramkit.empty(512, device=device)


def run_workload(device: str) -> tuple[list[int], list[vramkit.Buffer]]:
    """A known sequence. Returns memory_allocated() after every alloc and free, in order, and the
    three small buffers it leaves allocated (the caller keeps them alive)."""
    seen = []

    def note() -> None:
        seen.append(vramkit.memory_allocated(device))

    smalls = []
    for _ in range(3):
        smalls.append(alloc_small(device)); note()
    m1 = alloc_medium(device); note()
    m2 = alloc_medium(device); note()
    del m1; note()
    big = alloc_big(device); note()  # the peak: 40 MiB + 4 MiB + 3 KiB
    del big; note()
    for _ in range(3):
        c = alloc_churn(device); note()
        del c; note()
    for _ in range(5):
        m = alloc_medium(device); note()
        del m; note()
    t = alloc_tiny_churn(device); note()
    del t; note()
    del m2; note()
    return seen, smalls


PEAK = 40 * MiB + 4 * MiB + 3 * KiB


@pytest.fixture
def recorded(sim):
    """A fresh sim device recording its history."""
    vramkit.record_memory_history(True, device=sim)
    yield sim
    vramkit.record_memory_history(False, device=sim)


def line_of(text: str) -> int:
    """Line number of the line of run_workload containing `text`."""
    lines, first = inspect.getsourcelines(run_workload)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_sites_ranked_by_bytes_live_at_peak_then_total(recorded):
    _, _alive = run_workload(recorded)  # keeps the three small buffers allocated
    sites = allocation_sites(vramkit.memory_snapshot(recorded))
    got = [(s.frame.name, s.frames[1].line, s.live_at_peak, s.total_bytes, s.count) for s in sites]
    # A site is a whole stack: alloc_medium called from three lines of run_workload is three sites.
    assert got == [
        ("alloc_big", line_of("big = alloc_big"), 40 * MiB, 40 * MiB, 1),
        ("alloc_medium", line_of("m2 = alloc_medium"), 4 * MiB, 4 * MiB, 1),
        ("alloc_small", line_of("alloc_small(device)"), 3 * KiB, 3 * KiB, 3),
        # nothing live at the peak: ranked by total bytes
        ("alloc_churn", line_of("c = alloc_churn"), 0, 3 * 8 * MiB, 3),
        ("alloc_medium", line_of("m = alloc_medium"), 0, 5 * 4 * MiB, 5),
        ("alloc_medium", line_of("m1 = alloc_medium"), 0, 4 * MiB, 1),
        ("alloc_tiny_churn", line_of("t = alloc_tiny_churn"), 0, 512, 1),
    ]
    assert sum(s.live_at_peak for s in sites) == PEAK


def test_site_label_is_the_innermost_user_frame(recorded):
    _, _alive = run_workload(recorded)  # keeps the three small buffers allocated
    top = allocation_sites(vramkit.memory_snapshot(recorded))[0]
    assert top.frame.filename == __file__
    assert top.frame.line == alloc_big.__code__.co_firstlineno + 1
    assert top.label == f"test_sites.py:{top.frame.line} in alloc_big"
    assert top.frames[1].name == "run_workload"  # the callers follow, innermost first


def test_replay_matches_the_allocator_counters(recorded):
    seen, _alive = run_workload(recorded)
    snapshot = vramkit.memory_snapshot(recorded)
    r = replay(snapshot)
    trace = device_trace(snapshot)
    after_alloc_or_free = [r.allocated[i + 1] for i, e in enumerate(trace)
                           if e["action"] in ("alloc", "free_requested")]
    assert after_alloc_or_free == seen
    assert r.allocated[0] == 0 and r.reserved[0] == 0
    assert r.peak_allocated == PEAK == vramkit.max_memory_allocated(recorded)
    assert r.allocated[-1] == 3 * KiB == vramkit.memory_allocated(recorded)
    assert r.reserved[-1] == vramkit.memory_reserved(recorded)
    assert r.peak_reserved == vramkit.max_memory_reserved(recorded)
    assert sorted(a.size for a in r.live_at_peak) == [KiB, KiB, KiB, 4 * MiB, 40 * MiB]
    assert r.live_at_peak[0].frame.name == "alloc_big"


def test_allocations_made_before_recording_are_counted(sim):
    early_kept = vramkit.empty(6 * MiB, device=sim)
    early_freed = vramkit.empty(2 * MiB, device=sim)
    vramkit.record_memory_history(True, device=sim)
    try:
        del early_freed
        late = alloc_big(sim)
        snapshot = vramkit.memory_snapshot(sim)
    finally:
        vramkit.record_memory_history(False, device=sim)
    r = replay(snapshot)
    assert r.allocated[0] == 8 * MiB
    assert r.allocated[-1] == vramkit.memory_allocated(sim) == 46 * MiB
    assert r.peak_allocated == 46 * MiB
    assert sorted(a.size for a in r.initial_live) == [2 * MiB, 6 * MiB]
    sites = allocation_sites(snapshot)
    assert sites[0].frame.name == "alloc_big"  # 40 MiB live at the peak
    before = sites[1]  # 6 MiB live at the peak; no stack was recorded for either early block
    assert before.label == BEFORE_HISTORY and before.frame is None
    assert (before.live_at_peak, before.total_bytes, before.count) == (6 * MiB, 8 * MiB, 2)
    del late, early_kept


def test_truncated_history_gives_the_tail_of_the_full_curves():
    full, short = vramkit.sim.create(8 << 30), vramkit.sim.create(8 << 30)
    vramkit.record_memory_history(True, device=full)
    vramkit.record_memory_history(True, max_entries=9, device=short)
    try:
        _, _alive_full = run_workload(full)
        _, _alive_short = run_workload(short)
        r_full = replay(vramkit.memory_snapshot(full))
        r_short = replay(vramkit.memory_snapshot(short))
    finally:
        vramkit.record_memory_history(False, device=full)
        vramkit.record_memory_history(False, device=short)
    assert r_short.num_events == 9 < r_full.num_events
    k = len(r_short.allocated)
    assert r_short.allocated == r_full.allocated[-k:]
    assert r_short.reserved == r_full.reserved[-k:]
    assert r_short.allocated[-1] == 3 * KiB


def test_empty_history_is_a_flat_line_at_the_current_state(sim):
    m = alloc_medium(sim)
    r = replay(vramkit.memory_snapshot(sim))
    assert r.num_events == 0
    assert r.allocated == (4 * MiB,) and r.reserved == (vramkit.memory_reserved(sim),)
    assert [a.size for a in r.live_at_peak] == [4 * MiB]
    del m


def test_internal_frames():
    assert is_internal_frame("<frozen runpy>")
    assert is_internal_frame("/usr/lib/python3/site-packages/numpy/_core/numeric.py")
    assert is_internal_frame(vramkit.__file__)
    assert not is_internal_frame("/venv/lib/python3.11/site-packages/vramkit/examples/numpy_pipeline.py")
    assert not is_internal_frame("/home/me/train.py")
    assert not is_internal_frame("/home/me/numpy_tricks.py")


def test_not_a_snapshot_is_rejected():
    with pytest.raises(ValueError, match="segments"):
        replay({"device_traces": []})
