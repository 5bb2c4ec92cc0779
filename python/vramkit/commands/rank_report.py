"""One rank's summary of `vramkit run` under torchrun: the JSON file each rank writes, which
rank 0 and `vramkit merge` read back.

The file is JSON, never a pickle, since it is read back (by rank 0, by `vramkit merge` on
another machine), and it is written through a temporary name and a rename, so that a reader
polling for it sees either nothing or the whole file. Reading checks everything before use:
the size before reading (MAX_BYTES), then the format name and version, then every field's
presence, type and range; each problem is one RankReportError naming the file, the field and
what is allowed.

    {"format": "vramkit-rank-report", "version": 1,
     "rank": 1, "world_size": 2, "local_rank": 1,
     "run": {"id": "none", "restart": 0, "master": "127.0.0.1:29500"},
     "host": "node7", "pid": 4242, "script": "/abs/train.py", "args": [],
     "exit_status": 1, "started_at": 1700000000.0, "wall_time_s": 3.2,
     "ended": {"how": "raised", "exception": "RuntimeError", "message": "boom", "signal": null,
               "where": {"filename": "/abs/train.py", "line": 12, "name": "<module>"}},
     "devices": [{"device": "cpu", "heading": "PyTorch tensors, live-tensor meter",
                  "peak_allocated": 50331648, "peak_reserved": 50331648, "allocations": 12,
                  "top_sites": [{"label": "train.py:9 in <module>", "live_at_peak": 33554432,
                                 "total_bytes": 33554432, "count": 1, "frames": [{...}, ...]}],
                  "snapshot": "/abs/vramkit-snapshot-rank1-torch-cpu.pickle",
                  "timeline": "/abs/vramkit-timeline-rank1-torch-cpu.html"}]}
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .._core.files import write_atomically
from ..report.sites import Frame

__all__ = ["FORMAT", "MAX_BYTES", "VERSION", "DeviceSummary", "Ending", "RankReportError", "RankSummary",
           "RunId", "SiteSummary", "read_rank_report", "write_rank_report"]

FORMAT = "vramkit-rank-report"
VERSION = 1
MAX_BYTES = 16 << 20  # a real report is a few KiB; anything near this is not one
MAX_MESSAGE = 2000  # characters of an exception's message kept (torch's can be pages long)
MAX_SHOWN = 160  # characters of its first line shown in a report line
HOW = ("finished", "exited", "raised", "signal")
_MAX_INT = (1 << 63) - 1  # byte counts, pids and lines all fit in an int64


class RankReportError(ValueError):
    """A rank report that cannot be used; the message names the file, the field and what is allowed."""


@dataclass(frozen=True)
class Ending:
    """How the script of one rank ended."""

    how: str  # one of HOW
    status: int  # the rank's exit status
    exception: str | None = None  # how == "raised": the exception's type name
    message: str | None = None  # how == "raised": str(exception), at most MAX_MESSAGE characters
    signal: str | None = None  # how == "signal": "SIGTERM"
    where: Frame | None = None  # the innermost frame of the user's code when it raised or was signalled

    def text(self) -> str:
        """'finished', 'exited with status 3', 'raised RuntimeError: boom at train.py:12 in <module>',
        'killed by SIGTERM at train.py:30 in <module>'."""
        at = f" at {self.where.short()}" if self.where is not None else ""
        if self.how == "finished":
            return "finished"
        if self.how == "exited":
            return f"exited with status {self.status}"
        if self.how == "signal":
            return f"killed by {self.signal}{at}"
        lines = (self.message or "").strip().splitlines()
        first = lines[0] if lines else ""
        shown = first if len(first) <= MAX_SHOWN else first[:MAX_SHOWN - 3].rstrip() + "..."
        return f"raised {self.exception}{': ' + shown if shown else ''}{at}"


@dataclass(frozen=True)
class SiteSummary:
    """One of a device's top allocation sites (report.sites.AllocationSite, without the full stack)."""

    label: str
    live_at_peak: int
    total_bytes: int
    count: int
    frames: tuple[Frame, ...]  # the site's frame and a couple of its callers, innermost first


@dataclass(frozen=True)
class DeviceSummary:
    """One device report of the rank (what `vramkit run` prints for it) and the files written for it."""

    device: str
    heading: str
    peak_allocated: int
    peak_reserved: int
    allocations: int
    sites: tuple[SiteSummary, ...]
    snapshot: str | None  # None: the file could not be written
    timeline: str | None


@dataclass(frozen=True)
class RunId:
    """What tells one launch from the next in the same directory: torchrun's run id, its restart
    count and the rendezvous address (None where the launcher does not set them)."""

    id: str | None
    restart: int | None
    master: str | None


@dataclass(frozen=True)
class RankSummary:
    rank: int
    world_size: int
    local_rank: int | None
    run: RunId
    host: str
    pid: int
    script: str
    args: tuple[str, ...]
    ending: Ending
    started_at: float  # time.time() when the script started
    wall_time_s: float
    devices: tuple[DeviceSummary, ...]


# ------------------------------------------------------------------------------------------ writing

def _frame_json(f: Frame) -> dict[str, Any]:
    return {"filename": f.filename, "line": f.line, "name": f.name}


def to_json(s: RankSummary) -> dict[str, Any]:
    e = s.ending
    return {
        "format": FORMAT, "version": VERSION,
        "rank": s.rank, "world_size": s.world_size, "local_rank": s.local_rank,
        "run": {"id": s.run.id, "restart": s.run.restart, "master": s.run.master},
        "host": s.host, "pid": s.pid, "script": s.script, "args": list(s.args),
        "exit_status": e.status, "started_at": s.started_at, "wall_time_s": s.wall_time_s,
        "ended": {"how": e.how, "exception": e.exception, "message": e.message, "signal": e.signal,
                  "where": _frame_json(e.where) if e.where is not None else None},
        "devices": [{
            "device": d.device, "heading": d.heading, "peak_allocated": d.peak_allocated,
            "peak_reserved": d.peak_reserved, "allocations": d.allocations,
            "top_sites": [{"label": t.label, "live_at_peak": t.live_at_peak, "total_bytes": t.total_bytes,
                           "count": t.count, "frames": [_frame_json(f) for f in t.frames]} for t in d.sites],
            "snapshot": d.snapshot, "timeline": d.timeline,
        } for d in s.devices],
    }


def write_rank_report(path: str, summary: RankSummary) -> str:
    """Write the summary as JSON through a temporary file and a rename (see the module's doc)."""
    text = json.dumps(to_json(summary), indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    return write_atomically(path, text.encode("utf-8"))


# ------------------------------------------------------------------------------------------ reading

def _kind(value: object) -> str:
    """How a JSON value is named in error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


class _Fields:
    """Typed access to one JSON object of a report; every failure is a RankReportError that names
    the file and the field's path (devices[0].peak_allocated)."""

    def __init__(self, path: str, obj: object, where: str = "") -> None:
        self.path, self.where = path, where
        if not isinstance(obj, dict):
            self.fail("", f"expected a JSON object, got {_kind(obj)}")
        self.obj: dict[str, Any] = obj

    def fail(self, key: str, problem: str) -> NoReturn:
        field = f"{self.where}.{key}" if self.where and key else (self.where or key)
        raise RankReportError(f"{self.path}: {field + ': ' if field else ''}{problem}")

    def get(self, key: str, optional: bool = False) -> Any:
        if key not in self.obj:
            if optional:
                return None
            self.fail(key, "missing (a rank report written by `vramkit run` under torchrun has it)")
        return self.obj[key]

    def integer(self, key: str, optional: bool = False, minimum: int = 0) -> Any:
        value = self.get(key, optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
            self.fail(key, f"expected an integer from {minimum} to 2**63-1"
                           f"{' or null' if optional else ''}, got {_shown(value)}")
        return value

    def string(self, key: str, optional: bool = False, lines: bool = False) -> Any:
        value = self.get(key, optional)
        if not (isinstance(value, str) or (optional and value is None)):
            self.fail(key, f"expected a string{' or null' if optional else ''}, got {_shown(value)}")
        return _printable(value, lines) if value is not None else None

    def number(self, key: str) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self.fail(key, f"expected a number >= 0, got {_shown(value)}")
        return float(value)

    def items(self, key: str) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list):
            self.fail(key, f"expected a list, got {_shown(value)}")
        return value

    def child(self, key: str, value: object) -> _Fields:
        return _Fields(self.path, value, f"{self.where}.{key}" if self.where else key)


def _printable(text: str, lines: bool) -> str:
    """The text with what a terminal would act on (escape sequences, carriage returns; newlines
    unless `lines`) and what cannot be printed at all (lone surrogates, which JSON allows)
    replaced by U+FFFD: a report from elsewhere is shown, never obeyed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (lines and c in "\n\t") else "\ufffd" for c in text)


def _shown(value: object) -> str:
    """A value in an error message: its kind, and the value itself when it is short."""
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else ""
    return f"{_kind(value)} {text}" if text and len(text) <= 40 and value is not None else _kind(value)


def _frame(f: _Fields) -> Frame:
    return Frame(f.string("filename"), f.integer("line"), f.string("name"))


def _ending(f: _Fields, status: int) -> Ending:
    how = f.string("how")
    if how not in HOW:
        f.fail("how", f"expected one of {', '.join(HOW)}, got {_shown(how)}")
    where = f.get("where", optional=True)
    return Ending(how, status, f.string("exception", optional=True), f.string("message", optional=True, lines=True),
                  f.string("signal", optional=True), None if where is None else _frame(f.child("where", where)))


def _site(f: _Fields) -> SiteSummary:
    frames = tuple(_frame(f.child(f"frames[{i}]", x)) for i, x in enumerate(f.items("frames")))
    return SiteSummary(f.string("label"), f.integer("live_at_peak"), f.integer("total_bytes"), f.integer("count"),
                       frames)


def _device(f: _Fields) -> DeviceSummary:
    sites = tuple(_site(f.child(f"top_sites[{i}]", x)) for i, x in enumerate(f.items("top_sites")))
    return DeviceSummary(f.string("device"), f.string("heading"), f.integer("peak_allocated"),
                         f.integer("peak_reserved"), f.integer("allocations"), sites,
                         f.string("snapshot", optional=True), f.string("timeline", optional=True))


def _run(f: _Fields) -> RunId:
    return RunId(f.string("id", optional=True), f.integer("restart", optional=True),
                 f.string("master", optional=True))


def from_json(path: str, obj: object) -> RankSummary:
    """A RankSummary from a parsed report, every field checked (RankReportError otherwise)."""
    f = _Fields(path, obj)
    if f.obj.get("format") != FORMAT:
        f.fail("format", f"is {_shown(f.obj.get('format'))}, not {FORMAT!r}: this is not a rank report of "
                         f"`vramkit run` (those are the vramkit-rankN.json files a torchrun job writes)")
    version = f.get("version")
    if version != VERSION or isinstance(version, bool):
        f.fail("version", f"{_shown(version)} is not supported (this vramkit reads version {VERSION})")
    rank, world_size = f.integer("rank"), f.integer("world_size", minimum=1)
    if rank >= world_size:
        f.fail("rank", f"{rank} is not below the world size {world_size} (ranks are 0 to world_size-1)")
    args = f.items("args")
    if not all(isinstance(a, str) for a in args):
        f.fail("args", "expected a list of strings")
    status = f.integer("exit_status", minimum=-_MAX_INT)
    return RankSummary(
        rank, world_size, f.integer("local_rank", optional=True), _run(f.child("run", f.get("run"))),
        f.string("host"), f.integer("pid"), f.string("script"), tuple(args),
        _ending(f.child("ended", f.get("ended")), status), f.number("started_at"), f.number("wall_time_s"),
        tuple(_device(f.child(f"devices[{i}]", x)) for i, x in enumerate(f.items("devices"))))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")  # json.loads accepts NaN and Infinity by default


def read_rank_report(path: str) -> RankSummary:
    """Read and check one rank's JSON report; RankReportError says what is wrong with it."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read; a directory cannot be one
            raise RankReportError(f"{path}: not a regular file (expected a vramkit-rankN.json file)")
        if st.st_size > MAX_BYTES:
            raise RankReportError(_too_large(path, st.st_size))
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded even if it grew since the stat
    except OSError as exc:
        raise RankReportError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise RankReportError(_too_large(path, len(data)))
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise RankReportError(f"{path}: not UTF-8 text (byte {exc.start}); expected a JSON rank report") from None
    except RecursionError:
        raise RankReportError(f"{path}: not a rank report: JSON nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, NaN, an integer of too many digits
        raise RankReportError(f"{path}: not JSON ({exc}); expected a JSON rank report written by "
                              f"`vramkit run` under torchrun") from None
    return from_json(path, obj)


def _too_large(path: str, size: int) -> str:
    return (f"{path}: {size:,} bytes is over the {MAX_BYTES >> 20} MiB a rank report may have "
            f"(they are a few KiB; is it the right file?)")


def same_run(a: RankSummary, b: RankSummary) -> bool:
    return a.run == b.run and a.world_size == b.world_size


def describe_run(s: RankSummary) -> str:
    parts: Sequence[tuple[str, object]] = (("run id", s.run.id), ("restart", s.run.restart), ("master", s.run.master))
    shown = ", ".join(f"{name} {value}" for name, value in parts if value is not None)
    return f"world size {s.world_size}{', ' + shown if shown else ''}"

