"""The local web server behind ``vramkit view``: one page and a small JSON API over a history.

The page (page.html, beside this file) draws only what the current zoom shows and asks the
server for it, so a history of ten million events never crosses the socket whole: the history
object does the heavy work (bucketing, stacking, searching) and the server only parses the
query, calls it and writes compact JSON.

Only the standard library is used, and by default the server listens on 127.0.0.1 alone. The
page is sent with a Content-Security-Policy that lets it talk to this server and nothing else.
"""

from __future__ import annotations

import collections
import importlib.resources
import ipaddress
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, urlsplit

__all__ = ["ViewServer", "serve"]

# The page may reach its own origin (fetch of /api/...) and inline code; nothing else, so a
# snapshot's file names and stack frames cannot be sent anywhere by the page.
CSP = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:"

# Integers as the page writes them: an optional minus and decimal digits, nothing else ("1.0",
# " 1", "+1", "1e3" and "0x10" are refused). 30 digits is far beyond any byte count or event index
# and keeps int() cheap on hostile input.
_INT = re.compile(r"-?[0-9]{1,30}")

# How many request paths ViewServer.requests keeps: enough for a test or a debugging session,
# bounded so that hours of hovering do not grow the server's memory.
_REQUEST_LOG = 100_000


class BadRequest(Exception):
    """A query the API does not accept; its message says what was wrong and what is allowed."""


def _int(params: Dict[str, str], name: str) -> int:
    value = params.get(name)
    if value is None:
        raise BadRequest(f"missing parameter {name!r}: an integer is required")
    if not _INT.fullmatch(value):
        raise BadRequest(f"parameter {name!r} must be a decimal integer, got {value!r}")
    return int(value)


def _text(params: Dict[str, str], name: str) -> str:
    value = params.get(name)
    if value is None:
        raise BadRequest(f"missing parameter {name!r}: a text is required")
    return value


def _optional_text(params: Dict[str, str], name: str) -> Optional[str]:
    # An empty search box means no search, so "search=" is the same as leaving it out.
    value = params.get(name)
    return value if value else None


# Each route: the parameters it accepts (anything else is refused, so a typo in the page is an
# error rather than a silently ignored option) and how it calls the history.
Route = Tuple[Tuple[str, ...], Callable[[Any, Dict[str, str]], Any]]
ROUTES: Dict[str, Route] = {
    "/api/info": ((), lambda h, p: h.info()),
    "/api/timeline": (("start", "end", "width", "grouping", "search"), lambda h, p: h.timeline(
        _int(p, "start"), _int(p, "end"), _int(p, "width"), _text(p, "grouping"), _optional_text(p, "search"))),
    "/api/at": (("event", "y"), lambda h, p: h.at(_int(p, "event"), _int(p, "y"))),
    "/api/segments": (("event",), lambda h, p: h.segments(_int(p, "event"))),
    "/api/search": (("text",), lambda h, p: h.search(_text(p, "text"))),
}


def _parse_query(query: str, allowed: Tuple[str, ...]) -> Dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16)
    except ValueError as e:
        raise BadRequest(f"malformed query string: {e}") from None
    params: Dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            allowed_text = ", ".join(allowed) if allowed else "none"
            raise BadRequest(f"unknown parameter {name!r}; allowed: {allowed_text}")
        if name in params:
            raise BadRequest(f"parameter {name!r} given more than once")
        params[name] = value
    return params


def _dumps(body: Any) -> bytes:
    # Compact, and strict: NaN and Infinity are not JSON, so the page's parser would refuse them.
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    # HTTP/1.1 keeps the page's connections open between its many small requests.
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        # The page makes a request per hover; logging each to stderr would flood the terminal.
        pass

    def do_GET(self) -> None:
        view = self.server.view
        view.requests.append(self.path)
        if not self._host_allowed():
            self._json(403, {"error": "this server answers only requests addressed to "
                                      f"{view.host}:{view.port} (DNS rebinding protection)"})
            return
        parts = urlsplit(self.path)
        if parts.path in ("/", "/index.html"):
            self._send(200, view.page, "text/html; charset=utf-8", {"Content-Security-Policy": CSP})
            return
        route = ROUTES.get(parts.path)
        if route is None:
            self._not_found()
            return
        allowed, call = route
        try:
            params = _parse_query(parts.query, allowed)
            with view.history_lock:
                result = call(view.history, params)
        except BadRequest as e:
            self._json(400, {"error": str(e)})
        except ValueError as e:  # the history's word on an out-of-range argument
            self._json(400, {"error": str(e)})
        except Exception as e:  # a bug in the history: report it to the page, keep serving
            self._json(500, {"error": f"{type(e).__name__}: {e}"})
        else:
            try:
                data = _dumps(result)
            except (TypeError, ValueError) as e:  # e.g. a numpy integer or a NaN in the answer
                self._json(500, {"error": f"{parts.path} answered what JSON cannot hold: {e}"})
            else:
                self._send(200, data, "application/json", {})

    def _not_found(self) -> None:
        routes = ", ".join(["/", *ROUTES])
        self._json(404, {"error": f"no such resource: {self.command} {urlsplit(self.path).path}; "
                                  f"the server answers GET on {routes}"})

    # Everything but GET is refused the same way as an unknown path. A request body is read first
    # so that the kept-alive connection stays in step.
    def _refuse(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if length.isdigit() and 0 < int(length) <= 1 << 20:
            self.rfile.read(int(length))
        elif length != "0":
            self.close_connection = True
        self.server.view.requests.append(f"{self.command} {self.path}")
        self._not_found()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def do_HEAD(self) -> None:
        self.server.view.requests.append(f"HEAD {self.path}")
        self._send(404, b"", "application/json", {})

    def _host_allowed(self) -> bool:
        # A web page elsewhere could point a name of its own at 127.0.0.1 and read the API from
        # the victim's browser (DNS rebinding); such requests carry that name in Host. A server
        # bound to loopback therefore answers only to loopback names.
        view = self.server.view
        if not _is_loopback(view.host):
            return True
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return _is_loopback(name.strip("[]"))

    def _json(self, status: int, body: Any) -> None:
        self._send(status, _dumps(body), "application/json", {})

    def _send(self, status: int, data: bytes, content_type: str, headers: Dict[str, str]) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The page aborts superseded requests (a zoom that moved on): nothing to report.
            self.close_connection = True


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    view: "ViewServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Aborted connections are routine (see _Handler._send); anything else is left to the
        # handler's own 500 replies, so the terminal stays quiet.
        pass


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class ViewServer:
    """A running ``vramkit view`` server over one history object.

    ``url`` is the page's address. ``requests`` records the path (with query) of each request
    received, newest last, so that tests can check what the page asked for.
    """

    def __init__(self, history: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.history = history
        self.requests: Deque[str] = collections.deque(maxlen=_REQUEST_LOG)
        # Requests are answered on threads of their own, but the history is asked one call at a
        # time: it need not be thread-safe, and its calls are short (the page asks per view).
        self.history_lock = threading.Lock()
        # Read once: the page is a package file that does not change while the server runs.
        self.page = importlib.resources.files("vramkit.view").joinpath("page.html").read_bytes()
        cls = _HTTPServer6 if ":" in host else _HTTPServer
        self._httpd = cls((host, port), _Handler)
        self._httpd.view = self
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread: Optional[threading.Thread] = None
        self._serving: Optional[threading.Thread] = None  # the thread inside serve_forever

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def serve_forever(self) -> None:
        """Answer requests until close() is called (from another thread) or KeyboardInterrupt."""
        self._serving = threading.current_thread()
        try:
            self._httpd.serve_forever(poll_interval=0.05)  # also how long close() may wait
        finally:
            self._serving = None

    def start_in_thread(self) -> "ViewServer":
        """Serve from a daemon thread (it does not keep the process alive); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.serve_forever, name="vramkit-view", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        serving = self._serving
        # shutdown() waits for serve_forever to return, so it must not be called from inside it
        # (a request handler closing the server would wait for itself).
        if serving is not None and serving is not threading.current_thread():
            self._httpd.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> "ViewServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request_paths(self) -> List[str]:
        """The recorded requests, oldest first, as a list (a snapshot of ``requests``)."""
        return list(self.requests)


def serve(history: Any, host: str = "127.0.0.1", port: int = 0) -> ViewServer:
    """Bind a view server for ``history`` (port 0: any free port); call serve_forever or start_in_thread."""
    return ViewServer(history, host, port)
