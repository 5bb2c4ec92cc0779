"""`vramkit merge`: the merged report of a distributed job's ranks, from their JSON summaries.

    vramkit merge [--top N] FILE...          e.g. vramkit merge vramkit-rank*.json

Rank 0 of `vramkit run` under torchrun prints the same report when its script ends
(run_ranks.py); this command prints it again later, or from the files of a job whose rank 0
died. One row per rank and device with the peaks and how the rank ended, the highest rank
marked, then the top allocation sites of the highest rank. Ranks in 0..world_size-1 without a
file are listed as having no report. Every file is checked (rank_report.py); a malformed one,
two files of one rank, or files of different runs are an error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..report.sites import format_bytes
from .common import PROG, _non_negative_int
from .rank_report import DeviceSummary, RankReportError, RankSummary, describe_run, read_rank_report, same_run

__all__ = ["add_command", "cmd_merge", "device_label", "merged_report"]

NO_REPORT = "no report (it died before writing one, or is still running)"

# What measured a device, in a word (the headings of commands/run.py and run_torch.py).
_SHORT = {"NumPy arrays, vramkit's cpu pool": "NumPy", "vramkit's pool": "vramkit pool",
          "PyTorch tensors, live-tensor meter": "torch", "PyTorch's caching allocator": "torch"}


def add_command(commands: Any) -> None:
    """Add `merge` to the `vramkit` command's subparsers."""
    merge = commands.add_parser(
        "merge", help="print the merged report of the ranks of a `vramkit run` under torchrun",
        description="Print the merged report of a distributed job from the JSON summaries its ranks wrote "
                    "(vramkit-rankN.json): the ranks' peaks side by side, the highest rank, how each rank "
                    "ended, and the top allocation sites of the highest rank.")
    merge.add_argument("--top", type=_non_negative_int, default=5, metavar="N",
                       help="how many allocation sites of the highest rank to list (default: %(default)s)")
    merge.add_argument("files", nargs="+", metavar="FILE", help="the ranks' JSON summaries, e.g. vramkit-rank*.json")


def cmd_merge(ns: argparse.Namespace) -> int:
    try:
        by_rank = one_run(ns.files, [read_rank_report(p) for p in ns.files])
    except RankReportError as exc:
        print(f"{PROG} merge: error: {exc}", file=sys.stderr)
        return 2
    world_size = next(iter(by_rank.values())).world_size
    sys.stdout.write(merged_report(by_rank, world_size, {}, ns.top))
    return 0


def one_run(paths: Sequence[str], summaries: Sequence[RankSummary]) -> dict[int, RankSummary]:
    """{rank: summary}; RankReportError when two files are of one rank or of different runs."""
    by_rank: dict[int, RankSummary] = {}
    path_of: dict[int, str] = {}
    first_path, first = paths[0], summaries[0]
    for path, s in zip(paths, summaries):
        if s.world_size != first.world_size:
            raise RankReportError(f"{first_path} is a rank of a job of {first.world_size} ranks, {path} of "
                                  f"{s.world_size} (merge the files of one run)")
        if not same_run(s, first):
            raise RankReportError(f"{first_path} and {path} are from different runs ({describe_run(first)}; "
                                  f"{describe_run(s)}): merge the files of one run")
        if s.rank in by_rank:
            raise RankReportError(f"{path_of[s.rank]} and {path} are both rank {s.rank} (one file per rank: "
                                  f"merge the files of one run)")
        by_rank[s.rank], path_of[s.rank] = s, path
    return by_rank


def device_label(d: DeviceSummary) -> str:
    """'cpu (torch)', 'cpu (NumPy)', 'cuda:1 (torch)': the device and, in a word, what measured it."""
    return f"{d.device} ({_SHORT.get(d.heading, d.heading)})"


def _shown_devices(s: RankSummary) -> list[DeviceSummary]:
    """The devices a rank used (the NumPy pool of a torch-only script is left out), or its first."""
    used = [d for d in s.devices if d.allocations or d.peak_allocated]
    return used or list(s.devices[:1])


def _in_a_word(s: RankSummary) -> str:
    e = s.ending
    return {"finished": "finished", "exited": f"exited {e.status}", "signal": f"killed by {e.signal}"}.get(
        e.how, f"raised {e.exception}")


def _highest(found: Mapping[int, RankSummary]) -> tuple[int, DeviceSummary] | None:
    """The rank with the highest peak of allocated bytes on one device (the lowest rank of a tie)."""
    best: tuple[int, DeviceSummary] | None = None
    for rank in sorted(found):
        for d in _shown_devices(found[rank]):
            if best is None or d.peak_allocated > best[1].peak_allocated:
                best = (rank, d)
    return best


def _table(found: Mapping[int, RankSummary], world_size: int, problems: Mapping[int, str],
           highest: tuple[int, DeviceSummary] | None) -> list[str]:
    width = max([len(device_label(d)) for s in found.values() for d in _shown_devices(s)] + [6])
    lines = [f"  {'rank':>5}  {'device':<{width}}  {'peak allocated':>14}  {'peak reserved':>13}  {'exit':>4}  ended"]
    for rank in range(world_size):
        s = found.get(rank)
        if s is None:
            why = "unreadable report" if problems.get(rank, "").startswith("unreadable") else "no report"
            lines.append(f"  {rank:>5}  {'-':<{width}}  {'-':>14}  {'-':>13}  {'-':>4}  {why}")
            continue
        devices = _shown_devices(s)
        if not devices:  # a rank that reported no device at all
            lines.append(f"  {rank:>5}  {'-':<{width}}  {'-':>14}  {'-':>13}  {s.ending.status:>4}  {_in_a_word(s)}")
        for d in devices:
            mark = "*" if highest is not None and highest[0] == rank and highest[1] is d else " "
            lines.append(f"  {mark}{rank:>4}  {device_label(d):<{width}}  {format_bytes(d.peak_allocated):>14}  "
                         f"{format_bytes(d.peak_reserved):>13}  {s.ending.status:>4}  {_in_a_word(s)}")
    return lines


def _comparison(found: Mapping[int, RankSummary], highest: tuple[int, DeviceSummary]) -> str:
    rank, d = highest
    text = (f"* the highest: rank {rank}, {format_bytes(d.peak_allocated)} allocated at its peak on "
            f"{device_label(d)}")
    peaks = {k: max((x.peak_allocated for x in _shown_devices(s)), default=0) for k, s in found.items()}
    low = min(peaks, key=lambda k: (peaks[k], k))
    if low != rank:
        text += (f", {format_bytes(d.peak_allocated - peaks[low])} more than the lowest, rank {low} "
                 f"({format_bytes(peaks[low])})")
    return text


def _sites(rank: int, d: DeviceSummary, top: int) -> list[str]:
    if top == 0:
        return []
    if not d.sites:
        return ["", f"No allocations were recorded on {device_label(d)} of rank {rank}."]
    shown = min(top, len(d.sites))
    heading = f"Top {shown} allocation sites of rank {rank} on {device_label(d)}, by bytes live at the peak:"
    lines = ["", heading, f"  {'#':>2}  {'live at peak':>12}  {'total':>10}  {'count':>6}  site"]
    for n, site in enumerate(d.sites[:top], 1):
        lines.append(f"  {n:>2}  {format_bytes(site.live_at_peak):>12}  {format_bytes(site.total_bytes):>10}  "
                     f"{site.count:>6}  {site.label}")
        for frame in site.frames[1:3]:  # the callers, so that sites with the same label can be told apart
            lines.append(f"  {'':>2}  {'':>12}  {'':>10}  {'':>6}    from {frame.short()}")
    return lines


def _what_happened(found: Mapping[int, RankSummary], world_size: int, problems: Mapping[int, str]) -> list[str]:
    """A line for each rank that did not finish: the ranks that failed on their own first, in the
    order they ended (the first is what brought the job down), then the ranks stopped by a signal
    (torchrun stops the others when one fails), then the ranks without a report."""
    ended = sorted((s for s in found.values() if s.ending.how != "finished"),
                   key=lambda s: (s.ending.how == "signal", s.started_at + s.wall_time_s, s.rank))
    lines = [f"rank {s.rank} {s.ending.text()} (exit status {s.ending.status}; host {s.host}, pid {s.pid})"
             for s in ended]
    return lines + [f"rank {k}: {problems.get(k, NO_REPORT)}" for k in range(world_size) if k not in found]


def merged_report(found: Mapping[int, RankSummary], world_size: int, problems: Mapping[int, str],
                  top: int) -> str:
    """The merged report: found {rank: summary}; problems {rank: why it has no usable report}, for
    ranks not found that are more than 'no report' (rank 0's view while it waited)."""
    scripts = sorted({os.path.basename(s.script) for s in found.values()})
    reported = f"{len(found)} of {world_size} reported"
    lines = [f"=== all ranks: {', '.join(scripts)}, world size {world_size} ({reported}) ==="]
    highest = _highest(found)
    lines += _table(found, world_size, problems, highest)
    if highest is not None:
        lines.append(_comparison(found, highest))
    lines += _what_happened(found, world_size, problems)
    if highest is not None:
        lines += _sites(highest[0], highest[1], top)
    return "\n".join(lines) + "\n"
