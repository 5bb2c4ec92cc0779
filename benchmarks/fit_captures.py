"""fit_captures — what a batch-size search costs, in captures of the step.

What it measures
  examples/gpt_fit.py's vramkit_step (a 1.42B-parameter GPT-style decoder, AdamW, 1024-token
  sequences, two steps): the time of one capture on meta at batch size 8 (the median of
  several, after a warm-up capture that pays the first capture's one-off costs), and the time
  of the whole ``vramkit.trace.fit(vramkit_step, "80GiB")`` search, deriving traces from
  captures (``derive=True``, the default) and capturing every probe (``derive=False``), each
  the median of its passes, the two interleaved. Reported: captures run, seconds, and seconds
  over one capture (the issue's target for the derived search: at most 3.5).

Checks: both searches give the same largest batch size and the same per-probe predictions
(peak allocated, peak reserved, fits), and the derived search's trace at its answer equals a
capture there, event for event.

    PYTHONPATH=python python benchmarks/fit_captures.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, median, use_source_tree

use_source_tree()


def _builder():
    spec = importlib.util.spec_from_file_location("gpt_fit", os.path.join(REPO, "examples", "gpt_fit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.vramkit_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one pass of each search (figures not for the record)")
    parser.add_argument("--capacity", default="80GiB", help="the simulated GPU's memory (default: %(default)s)")
    args = parser.parse_args()

    from vramkit import trace as vt
    from vramkit.trace.fitting.derive_batch import first_difference

    build = _builder()
    capture_passes, fit_passes = (2, 1) if args.quick else (5, 3)
    vt.capture(build, 8, device="meta", steps=2, meta={"batch_size": 8})  # warm-up, not timed
    one = []
    for _ in range(capture_passes):
        t0 = time.perf_counter()
        vt.capture(build, 8, device="meta", steps=2, meta={"batch_size": 8})
        one.append(time.perf_counter() - t0)
    capture_s = median(one)

    runs: dict[bool, list[float]] = {True: [], False: []}
    reports: dict[bool, vt.FitReport] = {}
    for i in range(fit_passes):
        for derive in ((True, False) if i % 2 == 0 else (False, True)):  # interleaved, order flipped
            t0 = time.perf_counter()
            reports[derive] = vt.fit(build, args.capacity, derive=derive)
            runs[derive].append(time.perf_counter() - t0)

    def answers(r: vt.FitReport) -> tuple[object, ...]:
        return r.max_batch_size, [(p.batch_size, p.fits, p.prediction.peak_allocated, p.prediction.peak_reserved)
                                  for p in r.probes]

    best = reports[True].max_batch_size
    captured = vt.capture(build, best, device="meta", steps=2, meta={"batch_size": best})
    checks = {
        "same largest batch size and per-probe predictions": answers(reports[True]) == answers(reports[False]),
        f"derived trace at {best} == its capture": first_difference(reports[True].trace(best), captured) is None,
    }

    rows = [("one capture, batch size 8", 1, capture_s, f"{len(one)} passes")]
    for derive in (True, False):
        r = reports[derive]
        derived = sum(p.derived for p in r.probes)
        rows.append((f"fit {args.capacity}, derive={derive}", r.captures, median(runs[derive]),
                     f"{len(r.probes)} probes, {derived} derived; {len(runs[derive])} passes"))
    print(f"examples/gpt_fit.py vramkit_step, 2 steps on meta; largest batch size that fits {args.capacity}: {best}")
    print(f"{'what':<28}  {'captures':>8}  {'seconds':>8}  {'x one capture':>13}  detail")
    for what, captures, seconds, detail in rows:
        print(f"{what:<28}  {captures:>8}  {seconds:>8.2f}  {seconds / capture_s:>13.2f}  {detail}")
    for name, ok in checks.items():
        print(f"check: {name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
