"""The `vramkit` command: the parser and the dispatch to one module per subcommand.

    vramkit run [--allocator torch|vramkit] [--html PATH] [--snapshot PATH] ... [SCRIPT [ARGS...]]
                                                                     (run.py)
    vramkit fit SCRIPT --device-memory 24GiB [--batch-size N] ...   (predict.py)
    vramkit replay TRACE --device-memory 40GiB ...                   (predict.py)
    vramkit smi [--watch SECONDS] [--kill-stale] ...                 (smi.py)
    vramkit merge [--top N] vramkit-rank*.json                       (merge.py)
    vramkit view FILE [--device N] [--port P] [--no-browser]         (view.py)

The modules of this package are the only ones in vramkit that print.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .common import PROG, _exit_status

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Memory tools for vramkit's caching allocator.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .merge import add_command as add_merge
    from .predict import add_commands
    from .run import add_command as add_run
    from .smi import add_command as add_smi
    from .view import add_command as add_view

    add_run(commands)
    add_commands(commands)
    add_smi(commands)
    add_merge(commands)
    add_view(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vramkit` console script and of `python -m vramkit`; returns the exit status."""
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports bad usage itself (status 2) or --help (status 0)
        return _exit_status(exc.code)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if ns.command == "run":
            from .run import cmd_run

            return cmd_run(ns)
        if ns.command in ("fit", "replay"):
            from .predict import cmd_fit, cmd_replay

            return cmd_fit(ns) if ns.command == "fit" else cmd_replay(ns)
        if ns.command == "view":
            from .view import cmd_view

            return cmd_view(ns)
        if ns.command == "merge":
            from .merge import cmd_merge

            return cmd_merge(ns)
        from .smi import cmd_smi

        return cmd_smi(ns)
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT (128 + 2), as an interrupted
        # command-line tool gives; the traceback would only show where vramkit happened to be.
        print(f"\n{PROG} {ns.command}: interrupted", file=sys.stderr)
        return 130
