"""`vramkit run`: run a Python script and report its memory use.

    vramkit run [--allocator torch|vramkit] [--html PATH] [--snapshot PATH] [--oom-dir DIR]
                [--max-entries N] [--top N] [--rank-report PATH] [--wait-ranks SECONDS] [SCRIPT [ARGS...]]

`run` executes a Python script as `python SCRIPT ARGS` would, with NumPy's array memory routed
through vramkit's cpu pool and the allocation history recorded, then prints the memory summary,
the peaks and the largest allocation sites, and writes a snapshot pickle (for
pytorch.org/memory_viz) and a self-contained HTML timeline per device. When the script imports
torch, its tensors are reported too (run_torch.py): from torch's own CUDA caching allocator, or
on a machine without a GPU from the live-tensor meter; with `--allocator vramkit` the CUDA
tensors come from vramkit's pool instead. An out-of-memory while the script runs writes its
post-mortem to `--oom-dir` (``vramkit.on_oom``: the screen, a snapshot and a timeline at the
failure). Without SCRIPT it runs the bundled example, an image
pipeline training a small MLP in NumPy, then a checkpointed MLP in PyTorch.

Under torchrun (`torchrun --nproc_per_node N -m vramkit run train.py`: RANK and WORLD_SIZE set,
WORLD_SIZE > 1) each rank writes its files with the rank in their names and a JSON summary, and
rank 0 prints the merged report of all ranks (run_ranks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO, cast

from .common import PROG, _exit_status, _non_negative_float, _non_negative_int, _positive_int
from .rank_report import Ending, RankSummary, write_rank_report
from .run_ranks import (SITES_KEPT, RankEnv, SignalTrap, Terminated, WholeLines, ending_of, finish_rank_zero, rank_env,
                        ranked_path, short_report, summarize, terminated_note)

if TYPE_CHECKING:
    from ..report.sites import AllocationSite
    from .run_torch import DeviceReport

__all__ = ["add_command", "bundled_example", "cmd_run"]

EXAMPLE = "numpy_pipeline.py"


def add_command(commands: Any) -> None:
    """Add `run` to the `vramkit` command's subparsers."""
    run = commands.add_parser(
        "run", help="run a Python script and report its memory use",
        description="Run a Python script (default: the bundled NumPy example) with NumPy arrays in vramkit's "
                    "cpu pool and the allocation history recorded; print a memory report and write a "
                    "snapshot pickle and an HTML timeline.")
    run.add_argument("--allocator", choices=("torch", "vramkit"), default="torch",
                     help="where the script's torch CUDA tensors come from: torch's own caching allocator, "
                          "reported from its memory_stats and history (default), or vramkit's cuda pool "
                          "(vramkit.torch.use_as_cuda_allocator(); needs a CUDA build of torch and a GPU)")
    run.add_argument("--html", default="vramkit-timeline.html", metavar="PATH",
                     help="where to write the HTML timeline (default: %(default)s)")
    run.add_argument("--snapshot", default="vramkit-snapshot.pickle", metavar="PATH",
                     help="where to write the snapshot pickle for pytorch.org/memory_viz (default: %(default)s)")
    run.add_argument("--oom-dir", default="vramkit-oom", metavar="DIR",
                     help="where an out-of-memory writes its post-mortem (a snapshot and a timeline at the failure, "
                          "with the rank in the name under torchrun; vramkit.on_oom) (default: %(default)s; '' turns it "
                          "off)")
    run.add_argument("--max-entries", type=_positive_int, default=100_000, metavar="N",
                     help="events kept in the history ring buffer per device (default: %(default)s)")
    run.add_argument("--top", type=_non_negative_int, default=5, metavar="N",
                     help="how many allocation sites to list (default: %(default)s)")
    run.add_argument("--rank-report", default="vramkit.json", metavar="PATH",
                     help="under torchrun (RANK and WORLD_SIZE set, WORLD_SIZE > 1): where each rank writes its JSON "
                          "summary, with -rankN before the extension (default: %(default)s, giving vramkit-rank0.json, "
                          "vramkit-rank1.json, ...); the snapshots and timelines get -rankN in their names too")
    run.add_argument("--wait-ranks", type=_non_negative_float, default=60, metavar="SECONDS",
                     help="under torchrun: how long rank 0 waits for the other ranks' summaries before it prints the "
                          "merged report (default: %(default)s; a few seconds once torchrun has sent SIGTERM)")
    run.add_argument("script", nargs="?", metavar="SCRIPT",
                     help=f"the Python script to run (default: the bundled example {EXAMPLE})")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT")


def bundled_example() -> str:
    """Path of the bundled example script.

    Installed, it ships as the package vramkit.examples; in a source checkout run in place
    (PYTHONPATH=python) that package is the repository's examples/ directory.
    """
    location: str | None
    try:
        from vramkit import examples

        location = examples.__file__
    except ImportError:
        location = None
    if location is not None:
        here = os.path.dirname(os.path.abspath(location))
    else:  # (a namespace package has no __file__: treat it as the source checkout)
        import vramkit

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(vramkit.__file__))))
        here = os.path.join(root, "examples")
    return os.path.join(here, EXAMPLE)


def _print_exception(exc: BaseException, script: str) -> None:
    """Print a traceback that starts in the script, as `python SCRIPT` would, not in runpy."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)


def _run_script(script: str, args: Sequence[str], env: RankEnv | None = None,
                trap: SignalTrap | None = None) -> Ending:
    """Run `script` as __main__ with sys.argv = [script, *args]; returns how it ended (its exit status
    in .status). trap: a distributed rank's SIGTERM handler, which raises Terminated in the script."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *args]
    sys.path.insert(0, script if os.path.isdir(script) else os.path.dirname(script))  # as `python SCRIPT` does
    try:
        runpy.run_path(script, run_name="__main__")
        return ending_of(None, 0)
    except BaseException as exc:  # noqa: BLE001 -- the script's failure is reported; the memory report still follows
        if trap is not None:
            trap.script_ended()  # first: a SIGTERM now must not cut the traceback or the report short
        # The Ending keeps strings only: the traceback (and the script's tensors its frames hold) is
        # released when this handler ends, before the memory is read.
        return _ended_by(exc, script, env)
    finally:
        if trap is not None:
            trap.script_ended()  # from here on a SIGTERM is only noted: the report is written whole
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.stdout.flush()
        sys.stderr.flush()


def _ended_by(exc: BaseException, script: str, env: RankEnv | None) -> Ending:
    """How the script ended when it raised exc; prints its traceback as `python SCRIPT` would."""
    if isinstance(exc, Terminated):  # only with a trap, so only with env
        ending = ending_of(exc, _exit_status(exc.code))
        if env is not None:
            print(terminated_note(ending, env), file=sys.stderr)
        return ending
    if isinstance(exc, SystemExit):
        return ending_of(None, _exit_status(exc.code))
    _print_exception(exc, script)
    return ending_of(exc, 130 if isinstance(exc, KeyboardInterrupt) else 1)


def _devices() -> list[str]:
    import vramkit

    devices = ["cpu"]
    if vramkit.is_available("cuda"):
        devices += [f"cuda:{i}" for i in range(vramkit.device_count("cuda"))]
    return devices


def _with_suffix(path: str, suffix: str) -> str:
    """'out.html' for cpu, 'out-cuda0.html' for cuda:0, 'out-torch-cpu.html': one file per device."""
    if suffix in ("", "cpu"):
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{suffix.replace(':', '')}{ext}"


def _vramkit_report(device: str, snapshot: dict[str, Any], allocations: int) -> DeviceReport:
    import vramkit

    from .run_torch import DeviceReport

    heading = "NumPy arrays, vramkit's cpu pool" if device == "cpu" else "vramkit's pool"
    return DeviceReport(device, heading, vramkit.memory_summary(device), vramkit.max_memory_allocated(device),
                   vramkit.max_memory_reserved(device), allocations, snapshot, None, device)


def _print_report(r: DeviceReport, wall_s: float, top: int, sites: Sequence[AllocationSite]) -> None:
    """Print one device's report; sites: allocation_sites() of its snapshot (computed once by the caller)."""
    from ..report.sites import device_trace, format_bytes

    print(f"=== {r.device}: {r.heading} ===")
    print(r.summary)
    print(f"Peak allocated: {format_bytes(r.peak_allocated)}   Peak reserved: {format_bytes(r.peak_reserved)}   "
          f"Allocations: {r.allocations:,}   Wall time: {wall_s:.2f} s")
    if top == 0:
        return
    recorded = sum(1 for e in device_trace(r.snapshot, r.trace_index) if e.get("action") == "alloc")
    print()
    if not sites:
        print(f"No allocations were recorded on {r.device}.")
        return
    print(f"Top {min(top, len(sites))} allocation sites on {r.device} (of {len(sites)}), by bytes live at the peak:")
    print(f"  {'#':>2}  {'live at peak':>12}  {'total':>10}  {'count':>6}  site")
    for rank, site in enumerate(sites[:top], 1):
        print(f"  {rank:>2}  {format_bytes(site.live_at_peak):>12}  {format_bytes(site.total_bytes):>10}  "
              f"{site.count:>6}  {site.label}")
        for frame in site.frames[1:3]:  # the callers, so that sites with the same label can be told apart
            print(f"  {'':>2}  {'':>12}  {'':>10}  {'':>6}    from {frame.short()}")
    if recorded < r.allocations:
        print(f"Note: the history kept the newest events only ({recorded:,} of {r.allocations:,} allocations); "
              f"raise --max-entries to see them all.")


def cmd_run(ns: argparse.Namespace) -> int:
    script = bundled_example() if ns.script is None else os.path.abspath(ns.script)
    problem = None
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        problem = f"{script!r} is a directory without __main__.py"
    elif not os.path.exists(script):
        what = "the bundled example" if ns.script is None else "script"
        problem = f"{what} {script!r} not found"
    if problem:
        print(f"{PROG} run: error: {problem} (SCRIPT must be a Python file, or a directory or zip file "
              f"with __main__.py, as for `python SCRIPT`)", file=sys.stderr)
        return 2
    try:
        env = rank_env(os.environ)
    except ValueError as exc:
        print(f"{PROG} run: error: {exc}", file=sys.stderr)
        return 2
    html_path, snapshot_path = os.path.abspath(ns.html), os.path.abspath(ns.snapshot)  # the script may chdir
    rank = None
    if env is not None:  # one set of files per rank: the rank goes before the device suffix
        html_path, snapshot_path = ranked_path(html_path, env.rank), ranked_path(snapshot_path, env.rank)
        rank = _Rank(env, ranked_path(os.path.abspath(ns.rank_report), env.rank), SignalTrap())
        problem = _remove_previous(rank.json_path)
        if problem:
            print(f"{PROG} run: error: {problem}", file=sys.stderr)
            return 2

    if ns.allocator == "vramkit":
        problem = _use_vramkit_for_torch()
        if problem:
            print(f"{PROG} run: error: --allocator vramkit: {problem}", file=sys.stderr)
            return 2

    try:
        started_at = time.time()
        ending, wall_s, reports, notes = _measure(ns, script, rank)
        if rank is None or rank.env.rank != 0:
            return _report(ns, script, reports, wall_s, notes, ending, html_path, snapshot_path, rank, started_at)
        lines = WholeLines(sys.stdout)  # rank 0's report: the other ranks' lines go between its lines only
        try:
            with contextlib.redirect_stdout(cast(TextIO, lines)):
                return _report(ns, script, reports, wall_s, notes, ending, html_path, snapshot_path, rank,
                               started_at)
        finally:
            lines.flush()
    finally:
        if rank is not None:
            rank.trap.restore()


@dataclass(frozen=True)
class _Rank:
    """A rank of a distributed run: its place in the job, where its summary goes, its SIGTERM trap."""

    env: RankEnv
    json_path: str
    trap: SignalTrap


def _remove_previous(json_path: str) -> str | None:
    """Remove this rank's summary of an earlier run, so that rank 0 never mistakes it for this run's;
    and check, before the script runs, that the summary can be written there."""
    directory = os.path.dirname(json_path)
    if not os.path.isdir(directory):
        return f"--rank-report: the directory {directory!r} does not exist"
    try:
        os.remove(json_path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"cannot replace the rank report {json_path!r}: {exc.strerror or exc}"
    return None


def _measure(ns: argparse.Namespace, script: str,
             rank: _Rank | None) -> tuple[Ending, float, list[DeviceReport], list[str]]:
    """Run the script with the recording on; returns how it ended, its wall time, the device reports
    and what could not be measured."""
    import vramkit
    import vramkit.numpy as vnp

    from .run_torch import TorchWatch

    devices = _devices()
    allocations_before: dict[str, int] = {}
    already_recording = {d for d in devices if vramkit._C.history_enabled(d)}
    for device in devices:
        vramkit.record_memory_history(True, max_entries=ns.max_entries, device=device)
        vramkit.reset_peak_memory_stats(device)  # the peaks reported are the script's
        allocations_before[device] = vramkit.memory_stats(device)["allocation.all.allocated"]

    watch = TorchWatch(ns.max_entries, cuda=ns.allocator == "torch")
    was_installed = vnp.is_installed()
    vnp.install()
    watch.start()
    # (armed after the histories are on, so that it leaves them to this command)
    post_mortem = vramkit.on_oom(os.path.abspath(ns.oom_dir), devices=devices, top=max(ns.top, 5)) if ns.oom_dir \
        else None
    start = time.perf_counter()
    try:
        if rank is not None:
            rank.trap.install()  # SIGTERM from here on stops the script, not the report
        ending = _run_script(script, ns.args, rank.env if rank else None, rank.trap if rank else None)
    except Terminated as exc:  # the signal came as the script ended, just outside _run_script's handler
        ending = ending_of(exc, _exit_status(exc.code))
    finally:
        wall_s = time.perf_counter() - start
        if post_mortem is not None:
            vramkit._C._drain_oom_queue()  # an OOM in the script's last moments: its post-mortem first
            post_mortem.remove()
        torch_reports = watch.stop()
        if not was_installed:
            vnp.uninstall()

    reports: list[DeviceReport] = []
    for device in devices:
        snapshot = vramkit.memory_snapshot(device)
        allocations = vramkit.memory_stats(device)["allocation.all.allocated"] - allocations_before[device]
        if device != "cpu" and not allocations and not any(snapshot["device_traces"]):
            continue  # CUDA devices are reported only when the script used them
        reports.append(_vramkit_report(device, snapshot, allocations))
    for device in set(devices) - already_recording:
        vramkit.record_memory_history(False, device=device)  # leave the process as it was found
    # The device that held the most first: on a torch CPU script, torch's gigabytes of tensors
    # before the NumPy pool's few kilobytes (sorted() is stable: ties keep their order).
    ordered = sorted(reports + torch_reports, key=lambda r: max(r.peak_reserved, r.peak_allocated), reverse=True)
    return ending, wall_s, ordered, watch.problems


def _report(ns: argparse.Namespace, script: str, reports: list[DeviceReport], wall_s: float, notes: list[str],
            ending: Ending, html_path: str, snapshot_path: str, rank: _Rank | None, started_at: float) -> int:
    """Print the reports and write their files; a rank also writes its summary, and rank 0 prints the
    merged report. Returns the exit status."""
    from ..memory.api import write_snapshot
    from ..report.sites import allocation_sites
    from ..report.timeline import write_html

    status, report_start = ending.status, time.perf_counter()
    loud = rank is None or rank.env.rank == 0  # the other ranks print a short block (run_ranks.short_report)
    if rank is not None and loud:
        print(f"\n{PROG} run: rank 0 of {rank.env.world_size}; its own report first, then all ranks'")
    written: list[tuple[str, str, str]] = []
    kept_sites: list[list[AllocationSite]] = []
    files: list[tuple[str | None, str | None]] = []
    failed = False
    for r in reports:
        sites = allocation_sites(r.snapshot, r.trace_index) if ns.top or rank is not None else []
        kept_sites.append(sites[:max(ns.top, SITES_KEPT)])
        if loud:
            print()
            _print_report(r, wall_s, ns.top, sites)
        snap_path, page_path = _with_suffix(snapshot_path, r.suffix), _with_suffix(html_path, r.suffix)
        try:
            write_snapshot(r.snapshot, snap_path)
            title = f"vramkit timeline: {os.path.basename(script)} on {r.device} ({r.heading})"
            write_html(page_path, r.snapshot, title=title, top=max(ns.top, 10), device=r.trace_index)
        except OSError as exc:
            print(f"{PROG} run: error: cannot write the report: {exc}", file=sys.stderr)
            failed = True
            break
        written.append((f"{r.device}, {r.heading}", snap_path, page_path))
        files.append((snap_path, page_path))
    if rank is not None:
        files += [(None, None)] * (len(reports) - len(files))  # those not written, after a failure
        summary = summarize(rank.env, script, ns.args, ending, started_at, wall_s, reports, kept_sites, files)
        saved = _finish_rank(ns, script, rank, summary, notes, written, report_start)
        return status or int(failed or not saved)
    if failed:
        return status or 1

    _print_files(notes, written)
    if status:
        print(f"{os.path.basename(script)} exited with status {status}", file=sys.stderr)
    return status


def _print_files(notes: list[str], written: list[tuple[str, str, str]]) -> None:
    print()
    for problem in notes:
        print(f"Note: {problem}")
    for what, snap_path, page_path in written:
        print(f"Snapshot ({what}): {snap_path}")
        print(f"Timeline ({what}): {page_path}")
    if written:
        print(f"Explore a snapshot: vramkit view {written[0][1]}  (served from this machine, any size; "
              "https://pytorch.org/memory_viz opens it too)")


def _finish_rank(ns: argparse.Namespace, script: str, rank: _Rank, summary: RankSummary, notes: list[str],
                 written: list[tuple[str, str, str]], report_start: float) -> bool:
    """Write the rank's summary; then rank 0 prints the usual closing lines and the merged report, the
    others a short block. Returns whether the summary was written."""
    if rank.env.rank != 0:
        # Printed before the summary is written: rank 0 prints the merged report once it sees the
        # file, and these lines must not land in the middle of it.
        sys.stdout.write(short_report(summary, rank.json_path, notes))
        sys.stdout.flush()
    saved = True
    try:
        write_rank_report(rank.json_path, summary)
    except OSError as exc:
        print(f"{PROG} run: error: cannot write the rank report {rank.json_path!r}: {exc.strerror or exc}",
              file=sys.stderr)
        saved = False
    if rank.env.rank != 0:
        return saved
    _print_files(notes, written)
    if summary.ending.status:
        print(f"{os.path.basename(script)} exited with status {summary.ending.status}", file=sys.stderr)
    finish_rank_zero(summary, rank.json_path, os.path.abspath(ns.rank_report), ns.wait_ranks, rank.trap,
                     time.perf_counter() - report_start, ns.top)
    return saved


def _use_vramkit_for_torch() -> str | None:
    """Make vramkit torch's CUDA allocator before the script runs; returns what prevents it, if anything."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed"
    import vramkit.torch

    try:
        vramkit.torch.use_as_cuda_allocator()
    except RuntimeError as exc:
        return str(exc)
    if not vramkit.is_available("cuda"):
        return "vramkit was built without its CUDA backend or sees no GPU (build with VRAMKIT_CUDA=1)"
    return None
