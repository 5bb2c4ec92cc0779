"""`vramkit view FILE`: explore a memory history in the browser, served from this machine.

    vramkit view vramkit-snapshot.pickle [--device N] [--port P] [--no-browser] [--no-cache]

FILE is a snapshot pickle (torch.cuda.memory._dump_snapshot(), vramkit.dump_snapshot(), the
post-mortem's snapshot) of any pickle protocol, or a .vktrace. It is read as plain data (a
pickle that names any class or function is refused) by vramkit's C reader, summarized once
(FILE.vkview beside it) and served on 127.0.0.1 to a page that asks only for what it shows.
"""

from __future__ import annotations

import argparse
import sys
import time
import webbrowser
from typing import Any

from .common import PROG, _non_negative_int

__all__ = ["add_command", "cmd_view"]


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {value}")
    return value


def add_command(commands: Any) -> None:
    """Add `view` to the `vramkit` command's subparsers."""
    view = commands.add_parser(
        "view", help="explore a memory snapshot or trace in the browser (local, offline; millions of events)",
        description="Serve a page on this machine that draws a snapshot pickle's (or .vktrace's) active memory "
                    "over time by allocation, with zoom, the stack of the allocation under the cursor, the "
                    "segments at any event, search by frame or module, and the out-of-memory points. The file "
                    "is summarized once (FILE.vkview beside it) and the page fetches only what it shows.")
    view.add_argument("file", metavar="FILE", help="a snapshot pickle (any protocol) or a .vktrace file")
    view.add_argument("--device", type=_non_negative_int, default=None, metavar="N",
                      help="which device's trace in a snapshot with several (default: the only one with entries)")
    view.add_argument("--host", default="127.0.0.1",
                      help="the address to listen on (default: %(default)s, this machine only)")
    view.add_argument("--port", type=_port, default=0, metavar="P", help="the port (default: any free one)")
    view.add_argument("--no-browser", action="store_true", help="print the address instead of opening a browser")
    view.add_argument("--no-cache", action="store_true",
                      help="summarize the file again and write no FILE.vkview")


def cmd_view(ns: argparse.Namespace) -> int:
    from ..trace.formats.file_format import TraceFormatError
    from ..view import load_history, serve

    start = time.perf_counter()
    try:
        history = load_history(ns.file, device=ns.device, cache=not ns.no_cache)
    except (OSError, TraceFormatError, ValueError) as exc:
        print(f"{PROG} view: error: {exc}", file=sys.stderr)
        return 1
    if not history.events:
        print(f"{PROG} view: error: {ns.file}: records no allocation or free on {history.device}; record with "
              "torch.cuda.memory._record_memory_history() (or vramkit's history) before taking the snapshot",
              file=sys.stderr)
        return 1
    try:
        server = serve(history, host=ns.host, port=ns.port)
    except OSError as exc:
        print(f"{PROG} view: error: cannot listen on {ns.host}:{ns.port}: {exc}", file=sys.stderr)
        return 1
    info = history.info()
    print(f"{ns.file}: {info['events']:,} events, {info['allocations']:,} allocations on {history.device} "
          f"(read in {time.perf_counter() - start:.1f} s)")
    print(f"Serving the view at {server.url}  (Ctrl-C to stop)", flush=True)
    if not ns.no_browser:
        webbrowser.open(server.url)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
