"""`vramkit run` as one rank of a distributed job (torchrun, or any launcher that sets RANK and
WORLD_SIZE): per-rank files, a JSON summary per rank, and on rank 0 the merged report.

    torchrun --nproc_per_node 2 -m vramkit run train.py

Each rank writes its snapshots and timelines with the rank in the name, before the device
suffix (vramkit-snapshot-rank1.pickle, vramkit-snapshot-rank1-torch-cpu.pickle,
vramkit-timeline-rank1-cuda1.html), and its summary (rank_report.py) to vramkit-rank1.json.
Rank 0 prints its full report, then waits (at most --wait-ranks seconds) for the other ranks'
summaries and prints the merged report (merge.py); the other ranks print a short block, each
line prefixed with the rank, so that torchrun's interleaved output stays readable.

Nothing is lost when a rank fails. A script that raises or exits still gets its report. When a
worker fails, torchrun's agent sends SIGTERM to the others and SIGKILLs them 30 s later; so a
rank installs a SIGTERM handler for the script's run that raises Terminated (a SystemExit, so
the script's `except Exception:` lets it through) in the script, and the rank writes its report
saying "killed by SIGTERM" and exits with 143, as the signal would have. Rank 0, once signalled,
waits for the others only a few seconds, since they are being stopped too and a SIGKILLed rank
never writes. A rank killed by SIGKILL writes nothing, and the merged report says it has no
report. A signal that arrives while the main thread is blocked inside a C call (a collective
waiting for a peer that died) runs the handler only when that call returns; gloo returns an
error as soon as the peer's socket closes, but a call that blocks past torchrun's 30 s is
SIGKILLed and its rank has no report.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from ..report.sites import Frame, format_bytes, is_internal_frame
from .common import PROG
from .merge import device_label, merged_report
from .rank_report import (MAX_MESSAGE, DeviceSummary, Ending, RankReportError, RankSummary, RunId, SiteSummary,
                          describe_run, read_rank_report, same_run)

if TYPE_CHECKING:
    from ..report.sites import AllocationSite
    from .run_torch import DeviceReport

__all__ = ["RankEnv", "SignalTrap", "Terminated", "WholeLines", "collect_ranks", "ending_of", "rank_env", "ranked_path"]

SIGNAL_GRACE_S = 5.0  # after a SIGTERM, how long rank 0 still waits for the others' reports (at least)
KILL_AFTER_S = 25.0  # ...but never past this after the signal: torchrun SIGKILLs 30 s after its SIGTERM
POLL_S = 0.1
SITES_KEPT = 10  # allocation sites per device kept in the summary (at least; --top more)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int | None
    run: RunId


def _env_int(environ: Mapping[str, str], name: str, minimum: int) -> int:
    text = environ[name]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"the environment says this is a rank of a distributed job, but {name}={text!r} is not "
                         f"an integer >= {minimum} (torchrun sets RANK, WORLD_SIZE and LOCAL_RANK to integers, "
                         f"0 <= RANK < WORLD_SIZE)")
    return value


def rank_env(environ: Mapping[str, str]) -> RankEnv | None:
    """The rank this process is, when RANK and WORLD_SIZE say it is one of a job of 2 or more; None
    otherwise (a plain run, or a job of one: its report is the plain one). ValueError: values that
    cannot be (not integers, RANK >= WORLD_SIZE)."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    world_size, rank = _env_int(environ, "WORLD_SIZE", 1), _env_int(environ, "RANK", 0)
    if rank >= world_size:
        raise ValueError(f"the environment says this is a rank of a distributed job, but RANK={rank} is not below "
                         f"WORLD_SIZE={world_size} (ranks are 0 to WORLD_SIZE-1)")
    if world_size == 1:
        return None
    local_rank = _env_int(environ, "LOCAL_RANK", 0) if "LOCAL_RANK" in environ else None
    restart = (_env_int(environ, "TORCHELASTIC_RESTART_COUNT", 0)
               if "TORCHELASTIC_RESTART_COUNT" in environ else None)
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    master = f"{addr}:{port}" if addr is not None and port is not None else None
    return RankEnv(rank, world_size, local_rank, RunId(environ.get("TORCHELASTIC_RUN_ID"), restart, master))


def ranked_path(path: str, rank: int) -> str:
    """'vramkit-snapshot.pickle' -> 'vramkit-snapshot-rank1.pickle' (the device suffix follows)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-rank{rank}{ext}"


# ----------------------------------------------------------------------------------- the signal

class Terminated(SystemExit):
    """Raised inside the script when the rank is told to stop (torchrun's SIGTERM). A SystemExit
    with the status the signal would give (128 + 15), so that `except Exception:` in the script
    does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class SignalTrap:
    """SIGTERM, while the script runs, as Terminated raised in it; afterwards only noted (received_at),
    so that the report is written whole and rank 0 cuts its wait short. Installed only in the main
    thread (Python runs handlers there only); restore() puts the previous handler back."""

    def __init__(self) -> None:
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._raising = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # an in-process run on another thread: signal.signal would raise
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed, self._raising = True, True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        if self._raising:
            self._raising = False  # once: what runs after it (the report) must not be cut short
            raise Terminated(signum)

    def script_ended(self) -> None:
        self._raising = False

    def restore(self) -> None:
        if self._installed:
            # None: the previous handler was not set from Python; the default is what stood
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def where_of(exc: BaseException) -> Frame | None:
    """The innermost frame of the user's code in the exception's traceback (for Terminated: the line
    the script was running when the signal came)."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_internal_frame(code.co_filename):
            found = Frame(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


def ending_of(exc: BaseException | None, status: int) -> Ending:
    """How the script ended: returned or sys.exit (exc None), raised exc, or was stopped by a signal."""
    if isinstance(exc, Terminated):
        return Ending("signal", status, signal=signal.Signals(exc.signum).name, where=where_of(exc))
    if exc is None or isinstance(exc, SystemExit):
        return Ending("finished" if status == 0 else "exited", status)
    try:
        message = str(exc)[:MAX_MESSAGE]
    except Exception:  # noqa: BLE001 -- a broken __str__ must not cost the report
        message = "(the exception's message could not be read)"
    return Ending("raised", status, type(exc).__name__, message, where=where_of(exc))


def terminated_note(ending: Ending, env: RankEnv) -> str:
    where = f" at {ending.where.short()}" if ending.where is not None else ""
    return (f"{PROG} run: rank {env.rank}: {ending.signal} received{where}; the script was stopped "
            f"(torchrun stops every rank when one fails); writing this rank's report")


# --------------------------------------------------------------------------------- the summary

def summarize(env: RankEnv, script: str, args: Sequence[str], ending: Ending, started_at: float, wall_s: float,
              reports: Sequence[DeviceReport], sites: Sequence[Sequence[AllocationSite]],
              files: Sequence[tuple[str | None, str | None]]) -> RankSummary:
    """The rank's summary from what `vramkit run` printed and wrote; sites[i] and files[i] (snapshot,
    timeline; None where not written) belong to reports[i]."""
    devices = tuple(DeviceSummary(
        r.device, r.heading, r.peak_allocated, r.peak_reserved, r.allocations,
        tuple(SiteSummary(s.label, s.live_at_peak, s.total_bytes, s.count, s.frames[:3]) for s in site_list),
        snap, page) for r, site_list, (snap, page) in zip(reports, sites, files))
    return RankSummary(env.rank, env.world_size, env.local_rank, env.run, socket.gethostname(), os.getpid(),
                       script, tuple(args), ending, started_at, wall_s, devices)


def short_report(s: RankSummary, json_path: str, notes: Sequence[str]) -> str:
    """What a rank other than 0 prints: a few lines, each prefixed, written at once."""
    prefix = f"[{PROG} rank {s.rank} of {s.world_size}]"
    ended = f"{s.ending.text()} (exit status {s.ending.status})"
    lines = [f"{os.path.basename(s.script)} {ended} after {s.wall_time_s:.2f} s"]
    for d in s.devices:
        if d.allocations or d.peak_allocated:
            lines.append(f"{device_label(d)}: peak allocated {format_bytes(d.peak_allocated)}, peak reserved "
                         f"{format_bytes(d.peak_reserved)}, {d.allocations:,} allocations")
    lines += [f"Note: {n}" for n in notes]
    written = sum((d.snapshot is not None) + (d.timeline is not None) for d in s.devices)
    lines.append(f"report: {json_path} (and {written} snapshot and timeline files); rank 0 prints the merged report")
    return "".join(f"{prefix} {line}\n" for line in lines)


class WholeLines(io.TextIOBase):
    """A stdout for rank 0's report that passes on whole lines only, at most PIPE_BUF bytes per write.
    Every rank of a torchrun job writes to the same pipe, unbuffered (`python -u`), and print()
    writes a line's text and its newline in two calls: another rank's block (one write, so never
    split) would otherwise land inside one of rank 0's lines."""

    CHUNK = 4096  # PIPE_BUF on Linux: a write up to this size is never interleaved with another's

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream, self.pending = stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            chunk = ""
            for line in (lines + "\n").splitlines(keepends=True):
                if chunk and len((chunk + line).encode("utf-8", "replace")) > self.CHUNK:
                    self._put(chunk)
                    chunk = ""
                chunk += line
            self._put(chunk)
        return len(text)

    def _put(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def flush(self) -> None:
        if self.pending:
            self._put(self.pending)
            self.pending = ""
        self.stream.flush()


# ----------------------------------------------------------------------------- rank 0 waits

@dataclass
class _Seen:
    """What rank 0 found at one rank's path so far."""

    stamp: tuple[int, int, int] | None = None  # (mtime, size, inode) last read: each version is read once
    summary: RankSummary | None = None
    problem: str | None = None  # unreadable, or another rank's file
    stale: str | None = None  # a report of another run (an earlier launch in this directory)


def _look(path: str, rank: int, me: RankSummary, seen: _Seen) -> None:
    try:
        st = os.stat(path)
    except OSError:
        return  # not written yet (written files appear whole: a temporary name, then a rename)
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    if stamp == seen.stamp:
        return
    seen.stamp = stamp
    try:
        s = read_rank_report(path)
    except RankReportError as exc:
        seen.problem = f"unreadable report: {exc}"
        return
    if s.rank != rank:
        seen.problem = f"unreadable report: {path} is the report of rank {s.rank}"
    elif not same_run(s, me):
        seen.stale = f"{path} is from another run ({describe_run(s)}; this run: {describe_run(me)})"
    else:
        seen.summary, seen.stale = s, None


def _deadline(start: float, wait_s: float, me: RankSummary, trap: SignalTrap | None, own_cost: float) -> float:
    """When rank 0 stops waiting. A signal means the job is being torn down: a few seconds more (as
    long as rank 0's own report took, at least SIGNAL_GRACE_S), never close to torchrun's SIGKILL.
    Rank 0 failing on its own: no wait, since torchrun stops the other ranks only after it exits."""
    deadline = start + wait_s
    if trap is not None and trap.received_at is not None:
        since = max(trap.received_at, start)
        return min(deadline, since + max(SIGNAL_GRACE_S, own_cost), trap.received_at + KILL_AFTER_S)
    if me.ending.status != 0:
        return start
    return deadline


def collect_ranks(me: RankSummary, json_base: str, wait_s: float, trap: SignalTrap | None,
                  own_cost: float) -> tuple[dict[int, RankSummary], dict[int, str]]:
    """Rank 0: the other ranks' summaries as they appear, until all are in or the wait is over.
    Returns ({rank: summary}, {rank: why there is none, where it is not the plain 'no report'})."""
    seen = {k: _Seen() for k in range(1, me.world_size)}
    start, told = time.monotonic(), False
    while True:
        for k, state in seen.items():
            if state.summary is None and state.problem is None:
                _look(ranked_path(json_base, k), k, me, state)
        missing = [k for k, state in seen.items() if state.summary is None and state.problem is None]
        deadline = _deadline(start, wait_s, me, trap, own_cost)
        if not missing or time.monotonic() >= deadline:
            break
        if not told:
            print(f"Waiting up to {deadline - time.monotonic():.0f} s for the reports of rank"
                  f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}...", flush=True)
            told = True
        time.sleep(POLL_S)
    if trap is not None and trap.received_at is not None and missing:
        print("Stopped waiting: SIGTERM received (torchrun stops every rank when one fails, and a rank it "
              "kills writes no report)", flush=True)
    found = {0: me} | {k: s.summary for k, s in seen.items() if s.summary is not None}
    problems = {k: s.problem or f"no report yet: {s.stale}" for k, s in seen.items()
                if s.summary is None and (s.problem or s.stale)}
    return found, problems


def finish_rank_zero(me: RankSummary, json_path: str, json_base: str, wait_s: float, trap: SignalTrap | None,
                     own_cost: float, top: int) -> None:
    """Rank 0, after its own report: wait for the others and print the merged report."""
    print(f"Rank report (rank 0 of {me.world_size}): {json_path}")
    if me.ending.status != 0 and (trap is None or trap.received_at is None):
        print(f"Rank 0 did not finish (exit status {me.ending.status}), so it does not wait for the other ranks' "
              f"reports: torchrun stops them only once rank 0 has exited.")
    found, problems = collect_ranks(me, json_base, wait_s, trap, own_cost)
    print()
    sys.stdout.write(merged_report(found, me.world_size, problems, top))
    stem, ext = os.path.splitext(json_base)
    print(f"Merge the reports again (once every rank has ended): {PROG} merge {stem}-rank*{ext}")
