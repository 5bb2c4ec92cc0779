"""trace_replay — events per second of the C replay loop (`vramkit._C.trace_replay`).

What it measures
  A synthetic training-like allocation trace of 2,000,000 events (200,000 with --quick) is
  replayed by `_C.trace_replay` on its private simulated 80 GiB pool: once without outputs
  (peaks only) and once filling the three per-event columns (reserved, allocated, address).
  Each pass includes the two checking passes over the columns, the id tables, creating and
  destroying the pool: the whole call, timed from Python.
  The peer is what the same replay costs without it: a Python `for` loop calling
  `vramkit.raw_alloc` / `vramkit.raw_free` on a fresh `vramkit.sim` device over the first
  200,000 events of the same trace (20,000 with --quick); it reads no counters, so it is a
  lower bound on a Python replay that records per-event figures. The ratio is events/s of the
  C loop over events/s of the Python loop; the third row times the C loop on exactly the
  Python loop's events (the early part of a trace is cheaper for the allocator: fewer cached
  blocks), so its ratio compares like with like.

The trace (seed 1234): 1,200 persistent parameters allocated first, then iterations of a
1,000-layer model: forward, per layer an activation kept for backward and a temporary freed at
once; backward in reverse, per layer a weight gradient kept until the optimizer step, an
incoming-gradient temporary, and the layer's activation freed; then every weight gradient freed
and a marker (kind 2). Activation and temporary sizes are the layer's base size (alloc.py's
realistic mix, 512 B - 64 MiB) times a per-iteration factor in [0.5, 1] (a varying sequence
length), so sizes change between iterations; weight gradients have their parameter's size.
8,001 events per iteration; the live set peaks at about 3,200 allocations (~20 GiB).

Checks: the Python loop's reserved bytes after its last event and its peak reserved equal the
replay's figures for the same prefix. Target (from the issue): >= 2 million events/s.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, interleaved, main_for, median, spread, use_source_tree

use_source_tree()

import numpy as np
import vramkit
from vramkit import _C

from alloc import realistic_mix

SEED = 1234
CAPACITY = 80 << 30
PARAMS, LAYERS = 1200, 1000
TARGET_EVENTS_PER_S = 2e6


def training_trace(n: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trace described above, cut to n events: (kind uint8, id int64, size uint64)."""
    rng = np.random.default_rng(seed)
    L = LAYERS
    param_size = realistic_mix(PARAMS, seed)
    act_base, tmp_base, gtmp_base = (realistic_mix(L, seed + k).astype(np.float64) for k in (1, 2, 3))
    wgrad_size = param_size[np.arange(L) % PARAMS]

    # One iteration as a template: (kind, local id, which size); local ids 0..4L-1.
    layers = np.arange(L)
    rev = layers[::-1]
    ACT, TMP, WGRAD, GTMP, NONE = 0, 1, 2, 3, 4
    parts = [
        # forward: alloc act(l), alloc tmp(l), free tmp(l)
        np.stack([np.zeros(L), layers, np.full(L, ACT),
                  np.zeros(L), L + layers, np.full(L, TMP),
                  np.ones(L), L + layers, np.full(L, NONE)], axis=1).reshape(-1, 3),
        # backward: alloc wgrad(l), alloc gtmp(l), free act(l), free gtmp(l)
        np.stack([np.zeros(L), 2 * L + rev, np.full(L, WGRAD),
                  np.zeros(L), 3 * L + rev, np.full(L, GTMP),
                  np.ones(L), rev, np.full(L, NONE),
                  np.ones(L), 3 * L + rev, np.full(L, NONE)], axis=1).reshape(-1, 3),
        # optimizer step: free every weight gradient; then an iteration marker
        np.stack([np.ones(L), 2 * L + layers, np.full(L, NONE)], axis=1),
        np.array([[2, 0, NONE]]),
    ]
    template = np.concatenate(parts).astype(np.int64)
    per_iter = len(template)
    iters = max(1, -(-(n - PARAMS) // per_iter))
    t_kind, t_id, t_which = template[:, 0], template[:, 1], template[:, 2]
    # Base size of each template event (for ACT/TMP/GTMP scaled per iteration below).
    local = t_id % L
    base = np.zeros(per_iter)
    base[t_which == ACT] = act_base[local[t_which == ACT]]
    base[t_which == TMP] = tmp_base[local[t_which == TMP]]
    base[t_which == GTMP] = gtmp_base[local[t_which == GTMP]]
    fixed = np.zeros(per_iter, np.uint64)
    fixed[t_which == WGRAD] = wgrad_size[local[t_which == WGRAD]]

    factor = rng.uniform(0.5, 1.0, size=iters)
    kind = np.concatenate([np.zeros(PARAMS, np.uint8), np.tile(t_kind, iters).astype(np.uint8)])
    ids = np.concatenate([np.arange(PARAMS, dtype=np.int64),
                          (PARAMS + np.arange(iters, dtype=np.int64)[:, None] * 4 * L + t_id[None, :]).ravel()])
    scaled = np.ceil(base[None, :] * factor[:, None] / 4) * 4
    sizes = np.where(t_which[None, :] == WGRAD, fixed[None, :].astype(np.float64), scaled)
    sizes[:, t_which == NONE] = 0
    size = np.concatenate([param_size, sizes.ravel().astype(np.uint64)])
    ids[PARAMS:][np.tile(t_kind, iters) == 2] = 0  # markers carry no id
    return kind[:n], ids[:n], size[:n]


def python_replay(kind: np.ndarray, ids: np.ndarray, size: np.ndarray) -> tuple[int, str]:
    """One pass of the peer: ns taken, and the device it used (for the checks)."""
    device = vramkit.sim.create(CAPACITY)
    raw_alloc, raw_free = vramkit.raw_alloc, vramkit.raw_free
    kinds, idl, sizes = kind.tolist(), ids.tolist(), size.tolist()
    ptrs: dict[int, int] = {}
    start = time.perf_counter_ns()
    for k, i, s in zip(kinds, idl, sizes):
        if k == 0:
            ptrs[i] = raw_alloc(s, device)
        elif k == 1:
            raw_free(ptrs.pop(i))
    elapsed = time.perf_counter_ns() - start
    python_replay.last = (device, ptrs)  # type: ignore[attr-defined]
    return elapsed, device


def run(quick: bool = False) -> list[Row]:
    n = 200_000 if quick else 2_000_000
    n_py = 20_000 if quick else 200_000
    passes, warmup = (3, 1) if quick else (7, 1)
    kind, ids, size = training_trace(n)
    outs = [np.empty(n, np.uint64) for _ in range(3)]

    def c_plain() -> float:
        start = time.perf_counter_ns()
        _C.trace_replay(kind, ids, size, None, CAPACITY)
        return time.perf_counter_ns() - start

    def c_outs() -> float:
        start = time.perf_counter_ns()
        _C.trace_replay(kind, ids, size, None, CAPACITY, None, *outs)
        return time.perf_counter_ns() - start

    prefix = (kind[:n_py], ids[:n_py], size[:n_py])
    py_devices: list[str] = []

    def c_prefix() -> float:
        start = time.perf_counter_ns()
        _C.trace_replay(*prefix, None, CAPACITY)
        return time.perf_counter_ns() - start

    def py_pass() -> float:
        elapsed, device = python_replay(*prefix)
        py_devices.append(device)
        dev, ptrs = python_replay.last  # type: ignore[attr-defined]
        for p in ptrs.values():  # not timed: leave the device empty
            vramkit.raw_free(p)
        vramkit.empty_cache(dev)
        return elapsed

    # Checks on a fresh run of each side over the prefix.
    result = _C.trace_replay(kind, ids, size, None, CAPACITY, None, *outs)
    pre_res = np.empty(n_py, np.uint64)
    pre = _C.trace_replay(*prefix, None, CAPACITY, None, pre_res)
    _, device = python_replay(*prefix)
    dev, ptrs = python_replay.last  # type: ignore[attr-defined]
    checks = {
        "python loop reserved after the prefix == replay's": vramkit.memory_reserved(device) == int(pre_res[-1]),
        "python loop peak reserved == replay's": vramkit.max_memory_reserved(device) == pre["peak_reserved"],
        "full trace runs without OOM": result["oom_event"] == -1,
        "prefix columns == full trace's": bool((outs[0][:n_py] == pre_res).all()),
    }
    for p in ptrs.values():
        vramkit.raw_free(p)
    vramkit.empty_cache(dev)

    t = interleaved({"plain": c_plain, "outs": c_outs, "prefix": c_prefix, "python": py_pass}, passes=passes,
                    warmup=warmup)
    plain_rate = [n / (ns / 1e9) for ns in t["plain"]]
    outs_rate = [n / (ns / 1e9) for ns in t["outs"]]
    prefix_rate = [n_py / (ns / 1e9) for ns in t["prefix"]]
    py_rate = [n_py / (ns / 1e9) for ns in t["python"]]
    py = median(py_rate)
    detail = {"events": n, "python_events": n_py, "passes": passes, "peak_reserved": result["peak_reserved"],
              "peak_allocated": result["peak_allocated"], "num_device_alloc": result["num_device_alloc"],
              "live_peak_allocations": int(_live_peak(kind, ids))}
    rows = []
    for events, name, rates in ((n, "no outputs", plain_rate), (n, "3 output columns", outs_rate),
                                (n_py, "no outputs, the peer's events", prefix_rate)):
        vk = median(rates)
        rows.append(Row(
            benchmark=f"trace_replay: C loop, {events // 1000}k events, {name}", vramkit=vk,
            vramkit_text=f"{vk / 1e6:.1f} M events/s ({1e9 / vk:.0f} ns/event)",
            peer_name="Python raw_alloc/raw_free loop", peer=py, peer_text=f"{py / 1e6:.2f} M events/s",
            ratio=vk / py, ratio_text=f"{vk / py:.1f}x faster", target=">= 2 M events/s",
            met=vk >= TARGET_EVENTS_PER_S, checks=checks if name == "no outputs" else {},
            detail={**detail, "rates": rates, "spread": spread(rates), "python_rates": py_rate},
        ))
    return rows


def _live_peak(kind: np.ndarray, ids: np.ndarray) -> int:
    delta = np.where(kind == 0, 1, np.where(kind == 1, -1, 0))
    return int(np.cumsum(delta).max())


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
