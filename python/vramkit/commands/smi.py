"""`vramkit smi`: GPUs and the processes holding their memory, stale ones flagged.

    vramkit smi [--watch SECONDS] [--kill-stale [--yes] [--other-users] [--signal TERM|KILL|INT]]

Without a driver (libnvidia-ml.so.1 cannot be loaded; VRAMKIT_NVML_LIBRARY overrides the name)
it says so and exits 2. `--kill-stale` asks on the terminal before each signal unless --yes,
and never signals another user's process without --other-users (see vramkit.smi.kill_stale).

Exit status: 0 ok, 2 no NVIDIA driver (or bad usage), 1 any other failure. Like every module of vramkit.commands, it prints; no
other part of vramkit does.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from typing import Any

from .._core.errors import VramkitError
from .common import PROG

__all__ = ["add_command", "cmd_smi"]

OK, FAILED, NO_DRIVER = 0, 1, 2
CLEAR = "\033[H\033[2J"  # cursor home, clear screen: what `watch` does between frames


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value}")
    return value


def add_command(commands: Any) -> None:
    smi = commands.add_parser(
        "smi", help="list GPUs and the processes holding their memory, stale ones included",
        description="List each GPU (name, memory used/total, utilisation) and each process holding GPU memory "
                    "(pid, user, memory, state, command line), from NVML joined with /proc. Stale processes, "
                    "which hold memory but will not release it by themselves (exited pids, zombies, stopped or "
                    "orphaned processes), are flagged with the reason.")
    smi.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS",
                     help="refresh every SECONDS until Ctrl-C, like `watch -n SECONDS nvidia-smi`")
    smi.add_argument("--kill-stale", action="store_true",
                     help="offer to signal each stale process of yours (asks y/N for each unless --yes)")
    smi.add_argument("--yes", action="store_true", help="with --kill-stale: do not ask")
    smi.add_argument("--include-orphans", action="store_true",
                     help="with --kill-stale: also signal processes flagged as orphaned (parent 1), which is a "
                          "guess: daemons and nohup jobs have parent 1 too")
    smi.add_argument("--other-users", action="store_true",
                     help="with --kill-stale: include other users' processes (needs the permission to signal them)")
    smi.add_argument("--signal", choices=("TERM", "KILL", "INT"), default="TERM",
                     help="with --kill-stale: the signal to send (default: %(default)s)")


def _frame() -> str:
    from ..survive import smi

    gpus = smi.devices()
    procs = smi.processes()
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    return smi.format_table(gpus, procs, width=width)


def _ask(process: Any, sig_name: str) -> bool:
    from ..report.sites import format_bytes

    used = "N/A" if process.used_memory is None else format_bytes(process.used_memory)
    command = process.command or "?"
    if len(command) > 60:
        command = command[:57] + "..."
    question = (f"Send SIG{sig_name} to pid {process.pid} ({process.user}: {command}; {used} on GPU {process.gpu}; "
                f"{process.stale_reason})? [y/N] ")
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        print()
        return False


def _kill(ns: argparse.Namespace) -> int:
    from ..survive import smi

    procs = smi.processes()
    if not any(p.stale for p in procs):
        print("No stale processes.")
        return OK
    sig = getattr(signal, "SIG" + ns.signal)
    outcomes = smi.kill_stale((lambda p: True) if ns.yes else (lambda p: _ask(p, ns.signal)), sig=sig,
                              other_users=ns.other_users, procs=procs, orphans=ns.include_orphans)
    for o in outcomes:
        print(f"pid {o.process.pid}: {o.detail}")
    return OK


def cmd_smi(ns: argparse.Namespace) -> int:
    from ..survive import smi

    if ns.watch is not None and ns.kill_stale:
        print(f"{PROG} smi: error: --kill-stale cannot be combined with --watch", file=sys.stderr)
        return NO_DRIVER  # bad usage, as argparse reports it
    try:
        if ns.watch is None:
            print(_frame())
            return _kill(ns) if ns.kill_stale else OK
        while True:
            frame = _frame()
            stamp = time.strftime("%a %b %d %H:%M:%S %Y")
            sys.stdout.write(f"{CLEAR}Every {ns.watch:g}s: {PROG} smi    {stamp}\n\n{frame}\n")
            sys.stdout.flush()
            time.sleep(ns.watch)
    except KeyboardInterrupt:
        if ns.watch is not None:
            print()
            return OK
        return 130
    except smi.NVMLUnavailableError as exc:
        print(f"{PROG} smi: no NVIDIA driver: {exc}", file=sys.stderr)
        return NO_DRIVER
    except (VramkitError, OSError) as exc:
        print(f"{PROG} smi: error: {exc}", file=sys.stderr)
        return FAILED
