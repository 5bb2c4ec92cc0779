"""vramkit in IPython and Jupyter: ``%load_ext vramkit`` adds two magics.

``%%vram`` runs a cell and prints, for every device vramkit or torch knows that held or used
memory, how allocated and reserved bytes changed and their peaks during the cell
(``notebook_cell``). ``%%vram --timeline`` also records the allocation history and shows the
HTML timeline inline (``notebook_display.Timeline``).

``%vram_free`` lists what keeps memory alive (the last error's traceback, the output history,
the largest variables) with the bytes each reaches; ``%vram_free --clear`` lets go of the error
and the outputs (never a variable), collects garbage, empties the caches and reports what came
back (``notebook_holders``).

IPython is imported only when the extension is loaded, through its public API
(``register_magic_function``, ``UsageError``, ``display``). The magics' output is printed:
printing is what they are for. Their figures are also kept: ``last_cell_report()`` and
``last_free_report()``.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .. import _C
from .._core.devices import current_device
from .._core.text_html import TextAsHtml
from .._core.sizes import format_size
from ..memory.api import memory_counters, record_memory_history
from .notebook_cell import CellMeter, CellReport, known_devices
from .notebook_display import Timeline
from .notebook_holders import Output, Survey, clear_last_error, clear_outputs, find_outputs, survey

__all__ = ["FreeReport", "load_ipython_extension", "last_cell_report", "last_free_report"]

_reports: dict[str, Any] = {}  # the last report of each magic: figures and names only, no objects


def last_cell_report() -> CellReport | None:
    """The figures the last ``%%vram`` cell printed (None before the first)."""
    report: CellReport | None = _reports.get("vram")
    return report


def last_free_report() -> FreeReport | None:
    """What the last ``%vram_free`` found (and, with ``--clear``, gave back)."""
    report: FreeReport | None = _reports.get("vram_free")
    return report


def _usage_error(message: str) -> Exception:
    # IPython shows a UsageError as one line, without a traceback.
    error: type[Exception] = importlib.import_module("IPython.core.error").UsageError
    return error(message)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as IPython's UsageError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _usage_error(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _parse(parser: _Parser, line: str) -> argparse.Namespace:
    try:
        words = shlex.split(line)
    except ValueError as e:  # an unclosed quote
        raise _usage_error(f"{parser.prog}: {e}") from None
    return parser.parse_args(words)


def _devices(prog: str, names: list[str] | None) -> list[str] | None:
    """--device values as vramkit's canonical names, each once; a UsageError names a bad one."""
    if names is None:
        return None
    out: list[str] = []
    for name in names:
        try:
            device = _C.canonical_device(name)
        except (ValueError, TypeError, RuntimeError) as e:
            raise _usage_error(f"{prog}: bad --device {name!r}: {e}") from None
        if device not in out:
            out.append(device)
    return out


def _vram_parser() -> _Parser:
    p = _Parser(prog="%%vram", add_help=False)
    p.add_argument("--device", action="append", help="report only this vramkit device (repeatable)")
    p.add_argument("--no-torch", action="store_true", help="do not meter torch's CPU tensors")
    p.add_argument("--timeline", action="store_true", help="record the history and show the HTML timeline")
    return p


def _free_parser() -> _Parser:
    p = _Parser(prog="%vram_free", add_help=False)
    p.add_argument("--clear", action="store_true", help="let go of the last error and the output history")
    p.add_argument("--top", type=int, default=5, help="how many variables to list (default 5)")
    p.add_argument("--device", action="append", help="the vramkit device to empty and report (repeatable)")
    return p


@dataclass
class FreeReport(TextAsHtml):
    """What ``%vram_free`` found and, after ``--clear``, what it let go of and what came back:
    ``counters_before``/``counters_after`` are (allocated, reserved) per device."""

    survey: Survey
    cleared: list[str] = field(default_factory=list)
    counters_before: dict[str, tuple[int, int]] = field(default_factory=dict)
    counters_after: dict[str, tuple[int, int]] = field(default_factory=dict)
    released: int = 0  # bytes empty_cache gave back to the devices
    collected: dict[str, int] = field(default_factory=dict)  # allocated bytes the first gc.collect() freed

    def __str__(self) -> str:
        lines = [f"collecting garbage first freed {format_size(n)} on {device} (objects in reference cycles, "
                 "such as an earlier error's traceback and its frames)" for device, n in self.collected.items()]
        lines += _holder_lines(self.survey)
        if not self.counters_after:
            if any(h.clearable for h in self.survey.holders):
                lines.append(f"%vram_free --clear lets go of the error and the outputs: about "
                             f"{format_size(self.survey.freeable)} that no variable also holds")
            return "\n".join(lines)
        lines.append("cleared: " + (", ".join(self.cleared) if self.cleared else "nothing to clear")
                     + "; variables are never cleared")
        for device, (alloc_after, res_after) in self.counters_after.items():
            alloc_before, res_before = self.counters_before.get(device, (0, 0))
            lines.append(f"{device}: allocated {format_size(alloc_before)} -> {format_size(alloc_after)}, "
                         f"reserved {format_size(res_before)} -> {format_size(res_after)}")
        lines.append(f"empty_cache gave back {format_size(self.released)}")
        return "\n".join(lines)


def _holder_lines(s: Survey) -> list[str]:
    if not s.holders:
        return ["nothing in the last error, the output history or the variables holds arrays, tensors or buffers"]
    rows = [("size", "on", "held by")]
    for h in s.holders:
        tag = " [cleared by --clear]" if h.clearable else ""
        rows.append((("at least " if h.truncated else "") + format_size(h.nbytes), ", ".join(h.devices), h.name + tag))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines = []
    for row, holder in zip(rows, [None, *s.holders]):
        lines.append(f"{row[0]:>{w0}}  {row[1]:<{w1}}  {row[2]}")
        if holder is not None and holder.detail:
            lines.append(f"{'':>{w0}}  {'':<{w1}}    in {holder.detail}")
    if s.variables_not_listed:
        lines.append(f"({s.variables_not_listed} more variables hold memory; --top N lists more)")
    return lines


def _run_cell(shell: Any, line: str, cell: str) -> Any:
    """Run a cell's code in the notebook's namespace as IPython would, and return the value of
    a final expression (so it is displayed and stored as the cell's output)."""
    __tracebackhide__ = True  # IPython leaves this frame out of the cell's traceback
    source = shell.transform_cell(cell)
    tree = shell.transform_ast(shell.compile.ast_parse(source))
    # Register the source for tracebacks, under the cell's number, with the %%vram line first:
    # a failing line is then shown with its own text and its line number in the cell.
    name = shell.compile.cache(f"%%vram {line}\n{source}", shell.execution_count, raw_code=f"%%vram {line}\n{cell}")
    ast.increment_lineno(tree, 1)
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
    exec(shell.compile(tree, name, "exec"), shell.user_global_ns, shell.user_ns)
    if not isinstance(last, ast.Expr):
        return None
    return eval(shell.compile(ast.Expression(last.value), name, "eval"), shell.user_global_ns, shell.user_ns)


def _display(obj: Any) -> None:
    importlib.import_module("IPython.display").display(obj)


class _Magics:
    """The magics, bound to one shell."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    def vram(self, line: str, cell: str) -> Any:
        """%%vram [--device DEV]... [--no-torch] [--timeline]: run the cell and print how
        allocated and reserved memory changed on each device, and their peaks during it.

        Devices: vramkit's (cpu, sim:N, cuda:N) that held or used memory, torch.cuda's when
        torch has initialized CUDA, and torch's CPU tensors created in the cell (torch
        imported before the cell; --no-torch turns this meter off). --device restricts the
        report to the vramkit devices named. The peak counters are reset at the cell's start.
        --timeline records the allocation history of the reported vramkit devices (the
        default device without --device) for the cell and shows the HTML timeline.
        """
        __tracebackhide__ = True  # IPython leaves this frame out of the cell's traceback
        args = _parse(_vram_parser(), line)
        devices = _devices("%%vram", args.device)
        history = self._start_history(devices) if args.timeline else {}
        meter = CellMeter(devices, meter_torch=not args.no_torch)
        try:
            with meter:
                return _run_cell(self.shell, line, cell)
        finally:
            _reports["vram"] = meter.report
            print(meter.report)
            for device, started in history.items():
                try:
                    _display(Timeline.of(device, title=f"%%vram timeline, {device}"))
                finally:
                    if started:  # recording costs time on every allocation: only during the cell
                        record_memory_history(False, device=device)

    @staticmethod
    def _start_history(devices: list[str] | None) -> dict[str, bool]:
        """Turn on history recording where it is off; returns device -> whether it was turned on
        here (a history the user records is left on, and its timeline shows all of it)."""
        started = {}
        for device in devices or [current_device()]:
            started[device] = not _C.history_enabled(device)
            if started[device]:
                record_memory_history(True, device=device)
        return started

    def vram_free(self, line: str) -> None:
        """%vram_free [--clear] [--top N] [--device DEV]...: what keeps memory alive.

        Collects garbage, then lists the last error's traceback (sys.last_traceback and
        IPython's copies), the entries of the output history (Out, _N, _, __, ___) and the --top
        variables that reach arrays, tensors or vramkit buffers, with their sizes (each storage
        once).
        --clear lets go of the last error (its frames are cleared) and of those outputs, never
        of a variable, then collects garbage, empties the caches of the vramkit devices (the
        --device ones, else all that hold memory) and of torch.cuda, and reports what came back.
        """
        args = _parse(_free_parser(), line)
        if args.top < 0:
            raise _usage_error(f"%vram_free: --top must be 0 or more, got {args.top}")
        devices = _devices("%vram_free", args.device)
        chosen = devices if devices is not None else [d for d in known_devices() if memory_counters(d).reserved]
        before = _counters(chosen)
        # Garbage first: an earlier error's traceback and its frames refer to each other, so
        # once IPython lets go of it only the cycle collector frees it, and no holder would
        # account for that memory.
        gc.collect()
        allocated_before = {d: allocated for d, (allocated, _) in before.items()}
        collected = {d: allocated_before[d] - allocated for d, (allocated, _) in _counters(chosen).items()
                     if allocated_before[d] > allocated}
        outputs = find_outputs(self.shell)
        report = FreeReport(survey(self.shell, outputs, args.top, format_size), counters_before=before,
                            collected=collected)
        if args.clear:
            _clear(self.shell, outputs, report, chosen)
        _reports["vram_free"] = report
        print(report)


def _counters(devices: list[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for device in devices:
        counters = memory_counters(device)
        out[device] = (counters.allocated, counters.reserved)
    return out


def _clear(shell: Any, outputs: list[Output], report: FreeReport, devices: list[str]) -> None:
    """Let go of the holders `report` lists as clearable, then empty the caches of `devices`.
    Empties `outputs`: the magic's own references to them must go too."""
    listed = {h.name for h in report.survey.holders if h.kind == "output"}
    doomed = [out for out in outputs if out.label() in listed]
    outputs.clear()
    clear_outputs(shell, doomed)
    report.cleared = [out.label() for out in doomed]
    doomed.clear()
    if clear_last_error(shell):
        report.cleared.insert(0, "the last error")
    gc.collect()
    report.released = sum(_C.empty_cache(device) for device in devices)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    report.counters_after = _counters(devices)


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext vramkit`` (through ``vramkit.load_ipython_extension``): registers
    the ``%%vram`` cell magic and the ``%vram_free`` line magic on this shell."""
    magics = _Magics(ipython)
    ipython.register_magic_function(magics.vram, magic_kind="cell", magic_name="vram")
    ipython.register_magic_function(magics.vram_free, magic_kind="line", magic_name="vram_free")
