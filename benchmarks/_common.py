"""Shared pieces of the benchmarks: the Row type, timing helpers and table printing.

Timing rules used by every benchmark here (so the numbers are comparable and low-noise):
warm-up passes that are thrown away, several measured passes, the median reported, the
same input sequence for vramkit and its peer, passes of the two sides interleaved so that
drift (frequency, other load) hits both alike, and fixed seeds.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_source_tree() -> None:
    """Import vramkit from <repo>/python when the extension was built in place there."""
    import glob

    source = os.path.join(REPO, "python")
    if glob.glob(os.path.join(source, "vramkit", "_C*.so")) and source not in sys.path:
        sys.path.insert(0, source)


@dataclass
class Row:
    """One line of the report: a vramkit figure, its peer's figure and how they compare.

    `ratio` is oriented so that bigger is better for vramkit where the row is a speed
    comparison (peer time / vramkit time); for memory rows it is the figure the target
    names (peak reserved / peak allocated, lower is better). `met` is None for rows that
    are informational only.
    """

    benchmark: str
    vramkit: float
    vramkit_text: str
    peer_name: str
    peer: float
    peer_text: str
    ratio: float
    ratio_text: str
    target: str
    met: bool | None
    checks: dict[str, bool] = field(default_factory=dict)  # correctness checks (e.g. results equal)
    detail: dict[str, object] = field(default_factory=dict)  # raw per-pass figures etc.

    def as_dict(self) -> dict[str, object]:
        return {
            "benchmark": self.benchmark, "vramkit": self.vramkit, "vramkit_text": self.vramkit_text,
            "peer_name": self.peer_name, "peer": self.peer, "peer_text": self.peer_text,
            "ratio": self.ratio, "ratio_text": self.ratio_text, "target": self.target, "met": self.met,
            "checks": dict(self.checks), "detail": dict(self.detail),
        }


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def spread(values: Sequence[float]) -> float:
    """Relative spread of the passes, (max - min) / median, to show how noisy a figure is."""
    m = median(values)
    return (max(values) - min(values)) / m if m else math.nan


def time_ns(fn: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def interleaved(sides: dict[str, Callable[[], float]], passes: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each side's pass function `warmup` times (discarded), then `passes` times with the
    sides alternating and the order flipped every round (ABBA...), and return the figures."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(passes):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            out[name].append(float(sides[name]()))
    return out


def fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e4:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def met_text(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "NO")


HEADERS = ("benchmark", "vramkit", "peer", "ratio", "target", "met?")


def _cells(row: Row) -> tuple[str, ...]:
    peer = f"{row.peer_name}: {row.peer_text}" if row.peer_name else row.peer_text
    return (row.benchmark, row.vramkit_text, peer, row.ratio_text, row.target, met_text(row.met))


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    cells = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(HEADERS)]
    sep = "  "
    lines = [sep.join(h.ljust(w) for h, w in zip(HEADERS, widths)), sep.join("-" * w for w in widths)]
    lines += [sep.join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_rows(rows: Sequence[Row], markdown: bool = False) -> None:
    print(format_table(rows, markdown=markdown))
    failed = [f"{r.benchmark}: {k}" for r in rows for k, ok in r.checks.items() if not ok]
    if failed:
        print("\nFAILED CHECKS: " + "; ".join(failed))


def main_for(run: Callable[..., list[Row]], description: str) -> None:
    """The `__main__` of one benchmark file: --quick and --markdown, then its table."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (seconds), not for the record")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args()
    print_rows(run(quick=args.quick), markdown=args.markdown)


def write_json(path: str | None, machine: dict, results: list) -> None:
    """Save a GPU benchmark's machine description and every figure (no-op without a path)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=1)
