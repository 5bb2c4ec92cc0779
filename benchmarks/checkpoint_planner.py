"""checkpoint_planner — how long the optimal checkpoint planner takes to solve a chain.

What it measures
  Heterogeneous chains of L = 50, 100 and 200 stages (seed 1234: forward times 1-3 ms,
  backward twice that with noise, inputs 1-8 MiB, saved tensors 1-4x the input, small
  transients), budget = least + 30 % of (store-everything peak - least), 500 memory slots.
  vramkit: `vramkit.checkpoint.plan(stages, budget, "optimal")` (C: the bottom-up table over
  (memory, first stage, last stage), plus the baselines it compares against), median of 3.
  Peer: the same dynamic program written plainly in Python (tests/checkpoint_reference.py's
  memoised `persistent_dp`, fed sizes already rounded to the same 500 slots, so it computes
  the same table entries it needs), for the sizes where it finishes in reasonable time.
  Both must find the same optimal time.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from vramkit import checkpoint as ck  # noqa: E402

MiB = 1 << 20


def chain(L: int, seed: int = 1234) -> list:
    rng = random.Random(seed + L)
    out = []
    for _ in range(L):
        f = rng.uniform(1e-3, 3e-3)
        a = rng.randint(1, 8) * MiB
        out.append(ck.Stage(f, 2 * f * rng.uniform(0.8, 1.2), a, a * rng.randint(1, 4), rng.randint(0, 2) * MiB // 4,
                            rng.randint(0, 2) * MiB // 4))
    return out


def slotted(stages, budget, slots=500):
    unit = max(1, budget // slots)
    up = lambda b: -(-b // unit)  # noqa: E731
    return [(s.fwd_time, s.bwd_time, up(s.input_bytes), up(s.input_bytes) + up(s.saved_bytes - s.input_bytes),
             up(s.fwd_tmp), up(s.bwd_tmp)) for s in stages], budget // unit, up(stages[-1].input_bytes)


def run(quick: bool = False) -> list[tuple]:
    rows = []
    for L in ((20, 50) if quick else (50, 100, 200)):
        stages = chain(L)
        least = ck.min_budget(stages)
        full = ck.plan(stages, None, "none").predicted_peak
        budget = least + int(0.3 * (full - least))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            s = ck.plan(stages, budget, "optimal")
            times.append(time.perf_counter() - t)
        ours = statistics.median(times)
        plain = None
        if L <= (20 if quick else 50):
            import checkpoint_reference as ref

            sys.setrecursionlimit(100000)
            st, m, out = slotted(stages, budget)
            t = time.perf_counter()
            res = ref.persistent_dp(st, m, output_bytes=out)
            plain = time.perf_counter() - t
            assert res is not None and res[0] >= s.predicted_time * (1 - 1e-9), (res[0], s.predicted_time)
        rows.append((L, budget, ours, plain, s.predicted_time, least, full))
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    print(f"{'L':>4} {'budget':>12} {'vramkit (C)':>12} {'plain Python DP':>16} {'ratio':>8}  predicted step")
    for L, budget, ours, plain, pred, least, full in run(quick):
        ratio = f"{plain / ours:7.0f}x" if plain else "       —"
        plain_s = f"{plain:14.2f} s" if plain else "(not run)"
        print(f"{L:>4} {budget / MiB:>9.1f} MiB {ours * 1e3:>9.1f} ms {plain_s:>16} {ratio}  {pred * 1e3:.1f} ms "
              f"(least {least / MiB:.0f} MiB, store-all {full / MiB:.0f} MiB)")


if __name__ == "__main__":
    main()
