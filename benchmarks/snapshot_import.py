"""snapshot_import — time per trace entry of `vramkit.trace.from_torch_snapshot`, and that it stays linear.

What it measures
  A synthetic PyTorch memory snapshot shaped like the large one in tests/unit/test_trace_import.py
  (which only guards that import against hangs): one 2 MiB segment, then N allocations of 400
  bytes, each followed by its free_requested and free_completed (3N entries), cycling over 64
  block addresses. N = 100,000 (300k entries; 10,000 with --quick). Every alloc entry carries a
  two-frame stack (a torch frame, then the user's): one list shared by all of them, as pickled
  snapshots share a context's frames list ("shared stacks"), or a list of its own per entry,
  equal in content, which the import's per-list attribution cache cannot reuse ("own stacks").
  `from_torch_snapshot(snapshot)` is timed on the dict in memory, the whole call.

Peers (same run, passes interleaved ABBA, median of 5 passes; 3 with --quick)
  * The same import of a snapshot of N/10 allocations: the ratio is its time per entry over the
    large one's, 1.0 when the import is exactly linear. Target: at least 0.67 (ten times the
    entries cost at most 1.5 times as much per entry).
  * `pickle.loads` of the large snapshot pickled (protocol 4, the stacks shared or not as in
    the dict): what reading the snapshot file costs before any import. Informational.

Checks (on each large import): 2N events and N allocations, the user's frame as the one module,
and the recorded peak of one 512-byte block.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, Row, interleaved, main_for, median, spread, use_source_tree

use_source_tree()
sys.path.insert(0, os.path.join(REPO, "tests", "unit"))

import vramkit.trace as vt
from torch_snapshots import MiB, alloc, block, frame, free_completed, free_requested, segment, segment_alloc, snapshot

A = 0x7F3A_0000_0000
USER = frame("/home/u/proj/train.py", 42, "step")
TORCH = frame("/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward")
TARGET_RATIO = 1 / 1.5


def make_snapshot(n: int, shared: bool) -> dict:
    stack = [TORCH, USER]
    entries = [segment_alloc(A, 2 * MiB)]
    for i in range(n):
        addr = A + (i % 64) * 512
        entries += [alloc(addr, 400, frames=stack if shared else [TORCH, USER]), free_requested(addr, 400),
                    free_completed(addr, 400)]
    return snapshot([entries], [segment(A, [block(2 * MiB)])])


def timed(fn, *args) -> float:
    start = time.perf_counter_ns()
    fn(*args)
    return time.perf_counter_ns() - start


def run(quick: bool = False) -> list[Row]:
    n = 10_000 if quick else 100_000
    passes = 3 if quick else 5
    rows = []
    for shared in (True, False):
        kind = "shared stacks" if shared else "own stacks"
        big, small = make_snapshot(n, shared), make_snapshot(n // 10, shared)
        blob = pickle.dumps(big, protocol=4)
        t = vt.from_torch_snapshot(big)
        checks = {
            "events and allocations": t.num_events == 2 * n and t.num_allocations == n,
            "the user's frame is the module": t.modules == ["/home/u/proj/train.py:42"],
            "recorded peak one 512-byte block": t.meta["recorded_peak_allocated"] == 512,
        }
        del t
        times = interleaved({"big": lambda: timed(vt.from_torch_snapshot, big),
                             "small": lambda: timed(vt.from_torch_snapshot, small),
                             "unpickle": lambda: timed(pickle.loads, blob)}, passes=passes)
        entries, small_entries = 3 * n + 1, 3 * (n // 10) + 1
        big_ns, small_ns, unpickle_ns = (median(times[k]) for k in ("big", "small", "unpickle"))
        per, per_small = big_ns / entries, small_ns / small_entries
        detail = {"allocations": n, "entries": entries, "small_entries": small_entries, "passes": passes,
                  "ns": times["big"], "small_ns": times["small"], "unpickle_ns": times["unpickle"],
                  "spread": spread(times["big"]), "pickle_bytes": len(blob)}
        linear = per_small / per
        rows.append(Row(
            benchmark=f"snapshot_import: {entries // 1000}k entries, {kind}, per entry",
            vramkit=per, vramkit_text=f"{per / 1e3:.2f} µs/entry ({big_ns / 1e9:.2f} s)",
            peer_name=f"the same at {small_entries // 1000}k entries", peer=per_small,
            peer_text=f"{per_small / 1e3:.2f} µs/entry", ratio=linear,
            ratio_text=f"{linear:.2f} (1.00 = linear)", target=f">= {TARGET_RATIO:.2f} (linear)",
            met=linear >= TARGET_RATIO, checks=checks, detail=detail))
        rows.append(Row(
            benchmark=f"snapshot_import: {entries // 1000}k entries, {kind}, against unpickling",
            vramkit=big_ns, vramkit_text=f"{big_ns / 1e9:.3f} s",
            peer_name="pickle.loads of the snapshot", peer=unpickle_ns, peer_text=f"{unpickle_ns / 1e9:.3f} s",
            ratio=big_ns / unpickle_ns, ratio_text=f"{big_ns / unpickle_ns:.1f}x the unpickling", target="",
            met=None, detail=detail))
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
