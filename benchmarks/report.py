"""report — run every vramkit benchmark in one process and print one table of figures and ratios.

    PYTHONPATH=python python benchmarks/report.py              # the full run recorded in docs/benchmarks.md
    PYTHONPATH=python python benchmarks/report.py --quick      # smoke run, seconds; figures not for the record
    PYTHONPATH=python python benchmarks/report.py --markdown   # the table as markdown, for docs/benchmarks.md
    PYTHONPATH=python python benchmarks/report.py --json       # rows with per-pass figures, machine readable
    PYTHONPATH=python python benchmarks/report.py --save x.json  # the table, and the JSON written to x.json

Benchmarks (each file's docstring says what it measures and against which peer):
  alloc.py              cached alloc+free pairs, in C against glibc malloc/free and from Python
                        against np.empty + del, on a documented realistic size mix
  numpy_temporaries.py  NumPy expressions with 64 MiB temporaries, NumPy's allocator vs vramkit's;
                        the cost of page release; and NumPy workloads near the host's memory limit
                        (host_pressure.py: time, peak RSS, and a run in a memory cgroup)
  fragmentation.py      a synthetic training trace replayed on a sim device: peak reserved /
                        peak allocated, default settings and max_split_size_mb=128
  amp.py                fused loss-scaling kernels on CPU (unscale + inf/NaN check, + L2 norm) on
                        64 Mi gradient elements in 200 tensors, against the copy-bandwidth limit,
                        NumPy and torch's CPU kernel (the CUDA version is benchmarks/gpu/amp.py)

Ratios compare vramkit with a peer measured in the same run, so they carry over between
machines better than the absolute figures. The exit status is 1 when a correctness check
(e.g. NumPy results equal) failed, 0 otherwise; missed speed or memory targets are reported
in the table, not turned into failures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads competing for the cores
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, format_table, use_source_tree

use_source_tree()


def source_revision() -> str:
    """The git commit the benchmarked code came from, flagged when csrc/, python/ or setup.py
    differ from it (the build being measured is then not exactly that commit)."""
    import subprocess

    from _common import REPO

    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "diff", "--quiet", "HEAD", "--", "csrc", "python", "setup.py"],
                               capture_output=True, check=False, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + (" + uncommitted changes to csrc/python/setup.py" if dirty else "")


def machine() -> dict[str, str]:
    import numpy
    import vramkit

    cpu = platform.processor() or platform.machine()
    family = mhz = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and cpu == (platform.processor() or platform.machine()):
                    cpu = value
                elif key == "cpu family" and not family:
                    family = value
                elif key == "cpu MHz" and not mhz:
                    mhz = f"{float(value):.0f} MHz"
    except (OSError, ValueError):
        pass
    if family or mhz:
        cpu += " (" + ", ".join(x for x in (f"family {family}" if family else "", mhz) if x) + ")"
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "vramkit": vramkit.__version__,
        "source": source_revision(),
        "load_1min_at_start": f"{os.getloadavg()[0]:.2f}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_all(quick: bool = False) -> list[Row]:
    import alloc
    import amp
    import fragmentation
    import numpy_temporaries

    rows: list[Row] = []
    for module in (alloc, numpy_temporaries, fragmentation, amp):
        rows += module.run(quick=quick)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (seconds), not for the record")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", action="store_true", help="print machine info and rows as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write machine info and rows (per-pass figures) as JSON")
    args = parser.parse_args(argv)

    info = machine()
    rows = run_all(quick=args.quick)
    failed = [f"{r.benchmark}: {k}" for r in rows for k, ok in r.checks.items() if not ok]
    record = {"machine": info, "quick": args.quick, "rows": [r.as_dict() for r in rows]}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(record, f, indent=1)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        header = ", ".join(f"{k} {v}" for k, v in info.items())
        print(f"vramkit benchmarks{' (QUICK: not for the record)' if args.quick else ''}"
              f" — {header}\n")
        print(format_table(rows, markdown=args.markdown))
        met = [r for r in rows if r.met is not None]
        print(f"\ntargets met: {sum(bool(r.met) for r in met)} of {len(met)}"
              + (f"; FAILED CHECKS: {'; '.join(failed)}" if failed else "; all correctness checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
