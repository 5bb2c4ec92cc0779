"""PyTorch's own allocator checks, ported to vramkit's pools (issue 35, part 4).

* ``check_memory_stat_consistency``: the invariant of PyTorch's
  ``TestCuda._check_memory_stat_consistency`` (test_cuda.py): every ``*.current`` counter of
  ``memory_stats`` that a snapshot determines is rebuilt from ``memory_snapshot``'s segments and
  blocks and must equal the allocator's own, per pool (small, large) and in total; each
  segment's ``requested_size`` is the sum over its active blocks. Written here from that
  invariant, not copied.
* a fuzz in the spirit of PyTorch's ``test_allocator_fuzz``: 10,000 random allocations, frees
  and ``empty_cache`` calls of sizes from 1 byte to 64 MiB, with each live block's contents
  stamped and checked before it is freed (on the cpu pool, whose memory is real), and the
  consistency and ``pool_check`` (vramkit's invariant checker) every 500 steps.

Over the cpu pool and a simulated device, classic and with expandable segments. The cpu pool
with expandable segments runs in a child process (its layout can change only while nothing is
in use, and this process's other tests hold cpu memory).
"""

from __future__ import annotations

import collections
import ctypes
import os
import random
import subprocess
import sys

import pytest

import vramkit
from conftest import subprocess_env

MiB = 1 << 20


def check_memory_stat_consistency(device: str) -> None:
    snapshot = vramkit.memory_snapshot(device)
    expected: dict[str, int] = collections.defaultdict(int)
    for segment in snapshot["segments"]:
        expandable = segment["is_expandable"]
        pool = segment["segment_type"] + "_pool"
        for scope in ("all", pool):
            if not expandable:
                expected[f"segment.{scope}.current"] += 1
            expected[f"allocated_bytes.{scope}.current"] += segment["allocated_size"]
            expected[f"reserved_bytes.{scope}.current"] += segment["total_size"]
            expected[f"active_bytes.{scope}.current"] += segment["active_size"]
            expected[f"requested_bytes.{scope}.current"] += segment["requested_size"]
        requested = 0
        split = len(segment["blocks"]) > 1
        for block in segment["blocks"]:
            for scope in ("all", pool):
                if block["state"] == "active_allocated":
                    expected[f"allocation.{scope}.current"] += 1
                if block["state"].startswith("active_"):
                    expected[f"active.{scope}.current"] += 1
                if block["state"] == "inactive" and split and not expandable:
                    expected[f"inactive_split.{scope}.current"] += 1
                    expected[f"inactive_split_bytes.{scope}.current"] += block["size"]
            if block["state"].startswith("active_"):
                requested += block["requested_size"]
        assert requested == segment["requested_size"], segment
    stats = vramkit.memory_stats(device)
    for key, value in expected.items():
        assert stats[key] == value, (key, stats[key], value)
    # and the counters no segment holds are zero, as a snapshot without segments implies
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "allocation", "active"):
        if f"{key}.all.current" not in expected:
            assert stats[f"{key}.all.current"] == 0, key


def random_size(rng: random.Random) -> int:
    """1 byte to 64 MiB, log-uniform: both pools, splits and oversize blocks."""
    return max(1, int(2 ** rng.uniform(0, 26)))


def stamp(ptr: int, size: int, value: int) -> None:
    # the whole block when small; its first, middle and last 4 KiB otherwise
    if size <= 64 * 1024:
        ctypes.memset(ptr, value, size)
        return
    for start in (0, size // 2 - 2048, size - 4096):
        ctypes.memset(ptr + start, value, 4096)


def stamped(ptr: int, size: int, value: int) -> bool:
    spans = [(0, size)] if size <= 64 * 1024 else [(0, 4096), (size // 2 - 2048, 4096), (size - 4096, 4096)]
    return all(ctypes.string_at(ptr + start, n) == bytes([value]) * n for start, n in spans)


def fuzz(device: str, steps: int = 10_000, seed: int = 0, contents: bool = True) -> collections.Counter[str]:
    """Returns how many of each operation ran (so a test can see the fuzz did its work)."""
    rng = random.Random(seed)
    live: dict[int, tuple[int, int]] = {}
    done: collections.Counter[str] = collections.Counter()
    before = vramkit.memory_allocated(device)  # (the cpu pool may hold other tests' blocks)
    try:
        for step in range(steps):
            r = rng.random()
            if r < 0.55 and len(live) < 200:
                size = random_size(rng)
                ptr = vramkit.raw_alloc(size, device)
                value = rng.randrange(1, 256)
                if contents:
                    stamp(ptr, size, value)
                live[ptr] = (size, value)
                done["alloc"] += 1
            elif r < 0.97 and live:
                ptr = rng.choice(list(live))
                size, value = live.pop(ptr)
                if contents:
                    assert stamped(ptr, size, value), f"step {step}: a live block of {size} B was overwritten"
                vramkit.raw_free(ptr)
                done["free"] += 1
            else:
                vramkit.empty_cache(device)
                done["empty_cache"] += 1
            if step % 500 == 499:
                check_memory_stat_consistency(device)
                vramkit.pool_check(device)
        for ptr, (size, value) in list(live.items()):
            if contents:
                assert stamped(ptr, size, value)
            vramkit.raw_free(ptr)
        live.clear()
        vramkit.empty_cache(device)
        check_memory_stat_consistency(device)
        vramkit.pool_check(device)
        assert vramkit.memory_allocated(device) == before
        return done
    finally:
        for ptr in live:
            vramkit.raw_free(ptr)


def test_consistency_holds_on_a_fresh_and_a_busy_pool():
    device = vramkit.sim.create(8 << 30)
    check_memory_stat_consistency(device)
    ptrs = [vramkit.raw_alloc(n, device) for n in (1, 511, 512, 1 * MiB + 1, 3 * MiB, 30 * MiB)]
    vramkit.raw_free(ptrs[2])  # an inactive split block in the small pool
    check_memory_stat_consistency(device)
    stats = vramkit.memory_stats(device)
    assert stats["allocation.all.current"] == 5 and stats["inactive_split.small_pool.current"] >= 1
    for p in ptrs[:2] + ptrs[3:]:
        vramkit.raw_free(p)
    vramkit.empty_cache(device)
    check_memory_stat_consistency(device)
    assert vramkit.memory_reserved(device) == 0


def test_the_check_catches_a_counter_that_disagrees(monkeypatch):
    """The ported check can fail: a stats dict one byte off is caught."""
    device = vramkit.sim.create(1 << 30)
    p = vramkit.raw_alloc(1000, device)
    real = vramkit.memory_stats

    def off_by_one(dev=None):
        stats = dict(real(dev))
        stats["requested_bytes.small_pool.current"] += 1
        return stats

    monkeypatch.setattr(vramkit, "memory_stats", off_by_one)
    with pytest.raises(AssertionError, match="requested_bytes.small_pool"):
        check_memory_stat_consistency(device)
    vramkit.raw_free(p)


@pytest.mark.parametrize("expandable", [False, True])
def test_fuzz_on_a_simulated_device(expandable):
    device = vramkit.sim.create(16 << 30)
    if expandable:
        vramkit.configure(device, expandable_segments=True)
    done = fuzz(device, contents=False)
    assert done["alloc"] > 4000 and done["free"] > 4000 and done["empty_cache"] > 100, done


def test_fuzz_on_the_cpu_pool_with_contents():
    done = fuzz("cpu")
    assert done["alloc"] > 4000 and done["free"] > 4000 and done["empty_cache"] > 100, done


CHILD = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import vramkit
from test_allocator_consistency import fuzz
vramkit.configure("cpu", expandable_segments=True)
done = fuzz("cpu")
assert done["alloc"] > 4000 and done["free"] > 4000, done
print("fuzzed", vramkit.memory_stats("cpu")["num_alloc_retries"] >= 0)
"""


def test_fuzz_on_the_cpu_pool_with_expandable_segments():
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests, root=os.path.dirname(tests))], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    assert proc.returncode == 0 and "fuzzed" in proc.stdout, proc.stdout + proc.stderr
