"""`vramkit run`: run a Python script and report its memory use.

    vramkit run [--allocator torch|vramkit] [--html PATH] [--snapshot PATH] [--max-entries N]
                [--top N] [SCRIPT [ARGS...]]

`run` executes a Python script as `python SCRIPT ARGS` would, with NumPy's array memory routed
through vramkit's cpu pool and the allocation history recorded, then prints the memory summary,
the peaks and the largest allocation sites, and writes a snapshot pickle (for
pytorch.org/memory_viz) and a self-contained HTML timeline per device. When the script imports
torch, its tensors are reported too (run_torch.py): from torch's own CUDA caching allocator, or
on a machine without a GPU from the live-tensor meter; with `--allocator vramkit` the CUDA
tensors come from vramkit's pool instead. Without SCRIPT it runs the bundled example, an image
pipeline training a small MLP in NumPy, then a checkpointed MLP in PyTorch.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .common import PROG, _exit_status, _non_negative_int, _positive_int

if TYPE_CHECKING:
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
    run.add_argument("--max-entries", type=_positive_int, default=100_000, metavar="N",
                     help="events kept in the history ring buffer per device (default: %(default)s)")
    run.add_argument("--top", type=_non_negative_int, default=5, metavar="N",
                     help="how many allocation sites to list (default: %(default)s)")
    run.add_argument("script", nargs="?", metavar="SCRIPT",
                     help=f"the Python script to run (default: the bundled example {EXAMPLE})")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT")


def bundled_example() -> str:
    """Path of the bundled example script.

    Installed, it ships as the package vramkit.examples; in a source checkout run in place
    (PYTHONPATH=python) that package is the repository's examples/ directory.
    """
    try:
        from vramkit import examples

        here = os.path.dirname(os.path.abspath(examples.__file__))
    except ImportError:
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


def _run_script(script: str, args: Sequence[str]) -> int:
    """Run `script` as __main__ with sys.argv = [script, *args]; returns its exit status."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *args]
    sys.path.insert(0, script if os.path.isdir(script) else os.path.dirname(script))  # as `python SCRIPT` does
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        _print_exception(exc, script)
        return 130
    except BaseException as exc:  # noqa: BLE001 -- the script's failure is reported; the memory report still follows
        _print_exception(exc, script)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.stdout.flush()
        sys.stderr.flush()


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


def _print_report(r: DeviceReport, wall_s: float, top: int) -> None:
    from ..report.sites import allocation_sites, device_trace, format_bytes

    print(f"=== {r.device}: {r.heading} ===")
    print(r.summary)
    print(f"Peak allocated: {format_bytes(r.peak_allocated)}   Peak reserved: {format_bytes(r.peak_reserved)}   "
          f"Allocations: {r.allocations:,}   Wall time: {wall_s:.2f} s")
    if top == 0:
        return
    sites = allocation_sites(r.snapshot, r.trace_index)
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
    html_path, snapshot_path = os.path.abspath(ns.html), os.path.abspath(ns.snapshot)  # the script may chdir

    import vramkit
    import vramkit.numpy as vnp

    from .run_torch import TorchWatch
    from ..memory.api import write_snapshot
    from ..report.timeline import write_html

    if ns.allocator == "vramkit":
        problem = _use_vramkit_for_torch()
        if problem:
            print(f"{PROG} run: error: --allocator vramkit: {problem}", file=sys.stderr)
            return 2

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
    start = time.perf_counter()
    try:
        status = _run_script(script, ns.args)
    finally:
        wall_s = time.perf_counter() - start
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
    reports += torch_reports

    written: list[tuple[str, str, str]] = []
    for r in reports:
        print()
        _print_report(r, wall_s, ns.top)
        snap_path, page_path = _with_suffix(snapshot_path, r.suffix), _with_suffix(html_path, r.suffix)
        try:
            write_snapshot(r.snapshot, snap_path)
            title = f"vramkit timeline: {os.path.basename(script)} on {r.device} ({r.heading})"
            write_html(page_path, r.snapshot, title=title, top=max(ns.top, 10), device=r.trace_index)
        except OSError as exc:
            print(f"{PROG} run: error: cannot write the report: {exc}", file=sys.stderr)
            return status or 1
        written.append((f"{r.device}, {r.heading}", snap_path, page_path))

    print()
    for problem in watch.problems:
        print(f"Note: {problem}")
    for what, snap_path, page_path in written:
        print(f"Snapshot ({what}): {snap_path}")
        print(f"Timeline ({what}): {page_path}")
    print("Open the snapshot at https://pytorch.org/memory_viz (drag and drop; the file is read locally).")
    if status:
        print(f"{os.path.basename(script)} exited with status {status}", file=sys.stderr)
    return status


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
