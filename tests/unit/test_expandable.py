"""expandable_segments:True — one growing address range per stream and pool kind, memory
mapped in pages on demand (PyTorch's ExpandableSegment), on sim and on the real cpu pool.

Expected values come from the rules (page arithmetic on the addresses the allocator hands
out, /proc/self/statm for resident memory), never from the allocator's own figures."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

import pytest

import vramkit
from conftest import subprocess_env
from vramkit.report import sites
from vramkit import trace as vt

MiB = 1 << 20
PAGE = 20 * MiB  # PyTorch's large-pool page (kLargeBuffer)


def expandable_sim(capacity: int = 8 << 30, **options) -> str:
    device = vramkit.sim.create(capacity)
    vramkit.configure(device, expandable_segments=True, **options)
    return device


def pages_under(blocks: list[tuple[int, int]], base: int, page: int) -> int:
    """Bytes of the pages that the blocks (address, size) overlap, counted once each."""
    touched = set()
    for addr, size in blocks:
        touched.update(range((addr - base) // page, (addr + size - 1 - base) // page + 1))
    return len(touched) * page


def test_a_larger_request_extends_the_free_space_at_the_end():
    """The case the classic policy cannot serve from its cache: freed space at the end of a
    segment, too small for the next request, grows into it by mapping the pages after it."""
    device = expandable_sim()
    first = vramkit.raw_alloc(30 * MiB, device)
    assert vramkit.memory_reserved(device) == 40 * MiB  # two 20 MiB pages
    vramkit.raw_free(first)
    second = vramkit.raw_alloc(50 * MiB, device)
    assert second == first  # same start: the free 40 MiB were extended by one more page
    assert vramkit.memory_reserved(device) == 60 * MiB
    s = vramkit.memory_stats(device)
    assert s["num_device_alloc"] == 2 and s["segment.all.current"] == 0  # maps, not segments (PyTorch's counters)
    vramkit.raw_free(second)
    vramkit.pool_check(device)

    classic = vramkit.sim.create(8 << 30)
    a = vramkit.raw_alloc(30 * MiB, classic)
    vramkit.raw_free(a)
    b = vramkit.raw_alloc(50 * MiB, classic)
    assert b != a and vramkit.memory_reserved(classic) == 80 * MiB  # a second segment
    vramkit.raw_free(b)


def test_empty_cache_unmaps_every_free_page():
    device = expandable_sim()
    ptrs = [vramkit.raw_alloc(n, device) for n in (7 * MiB, 33 * MiB, 3 * MiB, 90 * MiB, 5 * MiB, 512, 100_000)]
    for i in (1, 3, 6):
        vramkit.raw_free(ptrs[i])
    kept = [ptrs[i] for i in (0, 2, 4, 5)]
    vramkit.empty_cache(device)
    vramkit.pool_check(device)
    snap = vramkit.memory_snapshot(device)
    blocks = [(b["address"], b["size"], s["segment_type"]) for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"]
    assert sorted(a for a, _, _ in blocks) == sorted(kept)
    # Reserved is exactly the pages under live blocks: 20 MiB pages for the large pool, 2 MiB
    # for the small, each range starting on a page boundary of its own.
    expected = 0
    for kind, page in (("large", PAGE), ("small", 2 * MiB)):
        segs = [s for s in snap["segments"] if s["segment_type"] == kind]
        base = min(s["address"] for s in segs)
        expected += pages_under([(a, n) for a, n, k in blocks if k == kind], base, page)
    assert vramkit.memory_reserved(device) == expected
    assert all(s["is_expandable"] for s in snap["segments"])
    for p in kept:
        vramkit.raw_free(p)
    vramkit.empty_cache(device)
    assert vramkit.memory_reserved(device) == 0  # every range released once nothing is mapped
    vramkit.pool_check(device)


def test_snapshot_reports_mapped_runs_and_trace_maps(sim):
    vramkit.configure(sim, expandable_segments=True)
    vramkit.record_memory_history(True, device=sim)
    a, b, c = (vramkit.raw_alloc(PAGE, sim) for _ in range(3))  # one page each, in address order
    assert (b - a, c - b) == (PAGE, PAGE)
    vramkit.raw_free(b)
    vramkit.empty_cache(sim)  # unmaps b's page: a hole between two mapped runs
    snap = vramkit.memory_snapshot(sim)
    segs = sorted(snap["segments"], key=lambda s: s["address"])
    assert [(s["address"], s["total_size"]) for s in segs] == [(a, PAGE), (c, PAGE)]
    assert all(s["is_expandable"] for s in segs)
    assert vramkit.memory_reserved(sim) == 2 * PAGE
    for seg in segs:  # the viewer walks blocks in order from the segment's address
        assert sum(blk["size"] for blk in seg["blocks"]) == seg["total_size"]
    trace = snap["device_traces"][-1]
    actions = [e["action"] for e in trace]
    assert "segment_alloc" not in actions and actions.count("segment_map") == 3
    assert actions.count("segment_unmap") == 1
    unmap = next(e for e in trace if e["action"] == "segment_unmap")
    assert unmap["addr"] == b and unmap["size"] == PAGE
    # vramkit's timeline rebuilds reserved bytes from those actions
    replayed = sites.replay(snap, int(sim.split(":")[1]))
    assert replayed.reserved[-1] == vramkit.memory_reserved(sim)
    assert max(replayed.reserved) == 3 * PAGE
    vramkit.raw_free(a)
    vramkit.raw_free(c)
    vramkit.record_memory_history(False, device=sim)


def test_oom_ladder_unmaps_free_pages_and_retries():
    """Free pages pinned nowhere go back to the device when a request does not fit: the
    retry maps them again where the request needs them."""
    device = expandable_sim(200 * MiB, expandable_page_mb=2)
    pairs = []
    for _ in range(9):  # [2 MiB kept][18 MiB freed] x 9: 180 MiB mapped, 18 MiB live
        pairs.append((vramkit.raw_alloc(2 * MiB, device), vramkit.raw_alloc(18 * MiB, device)))
    for _, temp in pairs:
        vramkit.raw_free(temp)
    before = vramkit.memory_stats(device)
    big = vramkit.raw_alloc(150 * MiB, device)  # no free block holds it; 20 MiB unmapped remain
    after = vramkit.memory_stats(device)
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert after["num_device_free"] > before["num_device_free"]
    vramkit.pool_check(device)
    vramkit.raw_free(big)

    classic = vramkit.sim.create(200 * MiB)
    pairs = [(vramkit.raw_alloc(2 * MiB, classic), vramkit.raw_alloc(18 * MiB, classic)) for _ in range(9)]
    for _, temp in pairs:
        vramkit.raw_free(temp)
    with pytest.raises(vramkit.OutOfMemoryError):  # each 20 MiB segment is pinned by its 2 MiB block
        vramkit.raw_alloc(150 * MiB, classic)


def test_a_true_oom_raises_and_changes_nothing():
    device = expandable_sim(100 * MiB)
    keep = vramkit.raw_alloc(70 * MiB, device)
    before = vramkit.memory_stats(device)
    with pytest.raises(vramkit.OutOfMemoryError, match="Tried to allocate") as info:
        vramkit.raw_alloc(50 * MiB, device)
    assert "Expandable segments are on: every free page was unmapped before this error" in str(info.value)
    assert "expandable_page_mb:2" in str(info.value)
    after = vramkit.memory_stats(device)
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    vramkit.pool_check(device)
    vramkit.raw_free(keep)


def test_record_stream_keeps_pages_until_the_stream_finishes(sim):
    vramkit.configure(sim, expandable_segments=True)
    p = vramkit.raw_alloc(40 * MiB, sim)
    vramkit.record_stream(p, 7)
    vramkit.raw_free(p)
    q = vramkit.raw_alloc(40 * MiB, sim)
    assert q != p  # p awaits stream 7: neither reused nor unmapped
    assert vramkit.memory_reserved(sim) == 80 * MiB
    vramkit.synchronize(sim, 7)
    vramkit.raw_free(q)
    vramkit.empty_cache(sim)
    assert vramkit.memory_reserved(sim) == 0
    vramkit.pool_check(sim)


def test_switching_the_option_with_live_blocks_is_refused(sim):
    p = vramkit.raw_alloc(5 * MiB, sim)
    before = vramkit.memory_stats(sim)
    with pytest.raises(ValueError, match="expandable_segments can be changed only while no memory is in use on "
                                         + sim + r", but 1 block \(5.00 MiB\) is allocated"):
        vramkit.configure(sim, expandable_segments=True, max_split_size_mb=64)
    assert vramkit.get_settings(sim)["expandable_segments"] is False
    assert vramkit.get_settings(sim)["max_split_size"] is None  # all or nothing
    assert vramkit.memory_stats(sim) == before
    vramkit.pool_check(sim)
    vramkit.raw_free(p)
    # Nothing in use: the cache is released and the next allocation uses the new layout.
    assert vramkit.configure(sim, expandable_segments=True)["expandable_segments"] is True
    assert vramkit.memory_reserved(sim) == 0
    q = vramkit.raw_alloc(5 * MiB, sim)
    assert vramkit.memory_snapshot(sim)["segments"][0]["is_expandable"] is True
    with pytest.raises(ValueError, match="no memory is in use"):
        vramkit.configure(sim, expandable_segments=False)
    vramkit.raw_free(q)
    vramkit.configure(sim, expandable_segments=False)
    assert vramkit.memory_reserved(sim) == 0
    vramkit.pool_check(sim)


@pytest.mark.parametrize("conf, message", [
    ({"expandable_segments": "Maybe"}, "expandable_segments must be True or False"),
    ({"expandable_page_mb": 3}, "expandable_page_mb must be an even number of MiB from 2 to 1024"),
    ({"expandable_page_mb": 0}, "expandable_page_mb must be an even number"),
])
def test_bad_options_are_refused(sim, conf, message):
    before = vramkit.get_settings(sim)
    with pytest.raises(ValueError, match=message):
        vramkit.configure(sim, **conf)
    assert vramkit.get_settings(sim) == before


def test_replay_takes_the_option():
    """The predict replay simulates PyTorch with expandable_segments:True: a growing trace
    that needs a second segment under the classic policy fits in one mapped range."""
    kinds, ids, sizes = [], [], []
    for i, mb in enumerate(range(100, 1000, 100)):  # a buffer reallocated 100 MiB larger each time
        kinds.append(0), ids.append(i), sizes.append(mb * MiB)
        if i:
            kinds.append(1), ids.append(i - 1), sizes.append(0)
    t = vt.Trace.from_columns(kind=kinds, id=ids, size=sizes)
    classic = vt.replay(t, 80 << 30, None, overheads=vt.NO_OVERHEADS)
    grown = vt.replay(t, 80 << 30, "expandable_segments:True", overheads=vt.NO_OVERHEADS)
    assert grown.peak_allocated == classic.peak_allocated
    assert grown.peak_reserved < classic.peak_reserved


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_cpu_empty_cache_returns_resident_memory():
    gc.collect()
    before = vramkit.get_settings("cpu")
    vramkit.configure("cpu", expandable_segments=True, host_page_release_mb=None)  # keep pages until empty_cache
    try:
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        ptrs = [vramkit.raw_alloc(64 * MiB, "cpu") for _ in range(4)]
        for p in ptrs:
            ctypes.memset(p, 1, 64 * MiB)
        for p in ptrs:
            vramkit.raw_free(p)
        held = rss()
        assert vramkit.memory_reserved("cpu") >= 256 * MiB  # cached, still mapped
        vramkit.empty_cache("cpu")
        vramkit.pool_check("cpu")
        assert vramkit.memory_reserved("cpu") == 0
        assert held - rss() >= 200 * MiB  # the kernel got the pages back
    finally:
        vramkit.configure("cpu", expandable_segments=False, host_page_release_mb=(
            None if before["host_page_release"] is None else before["host_page_release"] >> 20))


def test_cpu_large_frees_unmap_at_the_release_threshold():
    gc.collect()
    before = vramkit.get_settings("cpu")
    vramkit.configure("cpu", expandable_segments=True, host_page_release_mb=16)
    try:
        small = vramkit.raw_alloc(4 * MiB, "cpu")
        big = vramkit.raw_alloc(64 * MiB, "cpu")
        ctypes.memset(small, 7, 4 * MiB)
        ctypes.memset(big, 1, 64 * MiB)
        vramkit.raw_free(big)  # >= 16 MiB free: its whole 2 MiB pages are unmapped at once
        assert vramkit.memory_reserved("cpu") == 4 * MiB
        assert ctypes.string_at(small, 4 * MiB) == b"\x07" * (4 * MiB)  # the neighbour is intact
        vramkit.pool_check("cpu")
        vramkit.raw_free(small)
    finally:
        vramkit.empty_cache("cpu")
        vramkit.configure("cpu", expandable_segments=False, host_page_release_mb=(
            None if before["host_page_release"] is None else before["host_page_release"] >> 20))


def test_fit_suggests_expandable_segments_for_fragmentation():
    """vramkit fit's advice when only fragmentation fails: a 100 MiB block is freed and split by
    a 30 MiB request, then 80 MiB are asked for. Under the classic policy the 70 MiB left in
    the split segment cannot serve it (180 MiB reserved on a 150 MiB device); with expandable
    segments the free 70 MiB grow by one 20 MiB page."""
    from vramkit.trace.fitting.probes import Probe
    from vramkit.trace.fitting.suggestions import suggest

    kind = [0, 1, 0, 0]
    ids = [0, 0, 1, 2]
    sizes = [100 * MiB, 0, 30 * MiB, 80 * MiB]
    t = vt.Trace.from_columns(kind=kind, id=ids, size=sizes)
    cap = 150 * MiB

    def probe(batch_size, conf=None, checkpoint_blocks=False, autocast=None):
        return Probe(batch_size, vt.replay(t, cap, conf, overheads=vt.NO_OVERHEADS), 0.0)

    classic = probe(8).prediction
    assert not classic.fits and classic.oom["allocated"] == 30 * MiB
    expandable = probe(8, "expandable_segments:True").prediction
    assert expandable.fits and expandable.peak_reserved == 120 * MiB
    suggestions = suggest(probe, 8, classic, None)
    assert [s.change for s in suggestions] == ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert "CUDA IPC" in suggestions[0].cost


def growing_kv_trace(requests: int = 1500, seed: int = 5, in_flight: int = 300) -> "vt.Trace":
    """Requests arriving and finishing at random, each one's buffer reallocated larger every
    few tokens (a KV cache), ~300 in flight: the workload expandable segments are for."""
    import numpy as np

    rng = np.random.default_rng(seed)
    kind, ids, sizes = [], [], []
    live: dict[int, tuple[int, int, int]] = {}  # request -> (alloc id, tokens, tokens at the end)
    next_id = 0
    for step in range(400):
        while len(live) < in_flight and rng.random() < 0.5 and requests:
            requests -= 1
            kind.append(0), ids.append(next_id), sizes.append(int(rng.integers(1, 64)) * 64 * 1024)
            live[next_id] = (next_id, 0, int(rng.integers(32, 512)))
            next_id += 1
        for r, (aid, tokens, end) in list(live.items()):
            tokens += int(rng.integers(16, 64))
            if tokens >= end:
                kind.append(1), ids.append(aid), sizes.append(0)
                del live[r]
                continue
            kind.append(0), ids.append(next_id), sizes.append(tokens * 128 * 1024)  # larger copy, then free
            kind.append(1), ids.append(aid), sizes.append(0)
            live[r] = (next_id, tokens, end)
            next_id += 1
    return vt.Trace.from_columns(kind=kind, id=ids, size=sizes)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:True,expandable_page_mb:2"])
def test_replays_under_pressure_at_many_capacities(conf):
    """Every capacity between the peak allocation and the roomy peak reservation: the OOM ladder
    unmaps and maps again on almost every step. A replay either fits within the capacity or
    stops at an OOM; under ASan (CI) a bookkeeping slip on these paths crashes here (the
    benchmark's serving trace once found one: tests/c/test_expandable.c pins it down)."""
    t = growing_kv_trace()
    roomy = vt.replay(t, 64 << 30, conf, overheads=vt.NO_OVERHEADS)
    lo, hi = roomy.peak_allocated, roomy.peak_reserved + PAGE
    fitted = 0
    for i in range(41):
        cap = lo + (hi - lo) * i // 40
        p = vt.replay(t, cap, conf, overheads=vt.NO_OVERHEADS)
        assert p.peak_allocated <= roomy.peak_allocated
        if p.fits:
            fitted += 1
            assert p.peak_reserved <= cap
        else:
            assert p.oom is not None
    assert fitted > 0


# A child Python under an address-space limit (`ulimit -v`): the limit is set after numpy and
# vramkit are imported (they need address space too), rounded up to whole GiB plus `extra`.
UNDER_ADDRESS_LIMIT = """
import resource, sys
import numpy as np
import vramkit
GiB, MiB = 1 << 30, 1 << 20
def vm_size():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()
limit = (vm_size() // GiB + 1 + int(sys.argv[1])) * GiB
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
"""


def run_under_address_limit(extra_gib: int, code: str, **env: str) -> str:
    """Run `code` after UNDER_ADDRESS_LIMIT in a child; return its stdout (it must exit 0)."""
    child = subprocess.run([sys.executable, "-c", UNDER_ADDRESS_LIMIT + code, str(extra_gib)], capture_output=True,
                           text=True, env={**subprocess_env(), **env}, timeout=120)
    assert child.returncode == 0, child.stdout + child.stderr
    return child.stdout


needs_address_limit = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm") or vramkit.mem_get_info("cpu")[1] < 8 << 30,
    reason="needs Linux /proc and a host of 8 GiB (the requests must fit its capacity; they are never touched)")


@needs_address_limit
def test_cpu_ranges_fit_an_address_space_limit():
    """Under RLIMIT_AS a range of 1 1/8 x the host's memory cannot be reserved, and every
    request failed, even of one byte, with an OOM that blamed nothing. Ranges now take a share
    of what the limit leaves (an eighth for the small pool, half for the large one); a request
    no such range can hold gets a classic segment of its own size in the same pool; and what
    passes the limit is an OOM that names it."""
    out = run_under_address_limit(5, """
vramkit.configure("cpu", expandable_segments=True, host_memory_check=False)  # nothing is touched
tiny = vramkit.raw_alloc(1, "cpu")
a = vramkit.raw_alloc(2 * GiB, "cpu")   # a large-pool range of more than 2 GiB: half of what is left
assert vm_size() <= limit
b = vramkit.raw_alloc(2 * GiB, "cpu")   # no range of 2 GiB fits in half of what is left now: a classic segment
segments = {s["address"]: s for s in vramkit.memory_snapshot("cpu")["segments"]}
assert segments[b]["is_expandable"] is False and segments[b]["total_size"] == 2 * GiB, segments[b]
assert segments[a]["is_expandable"] is True and segments[tiny]["is_expandable"] is True
vramkit.pool_check("cpu")
try:
    vramkit.raw_alloc(2 * GiB, "cpu")
except vramkit.OutOfMemoryError as e:
    print("OOM:", e)
    assert e.free < 2 * GiB, e.free  # what the limit leaves, not the host's free memory
vramkit.pool_check("cpu")
for p in (b, a, tiny):
    vramkit.raw_free(p)
vramkit.empty_cache("cpu")
assert vramkit.memory_reserved("cpu") == 0
vramkit.configure("cpu", expandable_segments=False)
print("LIMIT=" + str(limit))
""")
    limit = int(out.split("LIMIT=")[1])
    oom = out.split("OOM: ")[1].splitlines()[0]
    assert oom.startswith("CPU out of memory. Tried to allocate 2.00 GiB.")
    assert (f"vramkit could not map 2.00 GiB because of the address-space limit RLIMIT_AS (ulimit -v) of "
            f"{limit / (1 << 30):.2f} GiB, of which ") in oom
    assert "reserved by vramkit's expandable segments and not mapped" in oom
    assert oom.endswith("or turn expandable_segments off (its ranges take address space before they take memory).")
