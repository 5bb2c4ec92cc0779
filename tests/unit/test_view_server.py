"""vramkit.view's server without a browser: its routes, its refusals and the page's isolation.

FakeHistory, defined here, is a small deterministic history (5,000 events of allocations and
frees, one 1 GiB allocation that makes the peak, one OOM) with the API the real history
provides; the browser test (tests/integration/test_view_browser.py) imports it from here.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import urllib.error
import urllib.request

import pytest

from vramkit.view import serve
from vramkit.view.server import CSP

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeHistory:
    """A synthetic history whose answers the tests can recompute exactly."""

    EVENTS = 5000
    BIG_ALLOC, BIG_FREE, BIG_SIZE = 2500, 2600, 1 << 30  # the peak lies inside [2500, 2600)
    OOM_EVENT, OOM_SIZE = 3000, 2 << 30
    BASE, BIG_ADDR, SEGMENT = 0x7F0000000000, 0x7F8000000000, 32 << 20  # 8 small blocks a segment
    T0, DT = 1_700_000_000_000_000, 250  # microseconds: the history spans 1.25 s
    SITES = ["attention", "mlp", "embedding"]  # site 3 (every fourth allocation) is "other"
    WINDOW = 600  # zoomed in to at most this many events, timeline() lists the allocations

    def __init__(self, segments_known: bool = True, seed: int = 7):
        self.segments_known = segments_known
        rng = random.Random(seed)
        self.allocs: list[dict] = []
        self.ops: list[tuple[str, int]] = []  # per event: ("alloc"|"free", id) or ("oom", -1)
        live: list[int] = []
        big = -1
        for e in range(self.EVENTS):
            if e == self.OOM_EVENT:
                self.ops.append(("oom", -1))
            elif e == self.BIG_ALLOC:
                big = self._alloc(e, self.BIG_SIZE, self.BIG_ADDR)
                live.append(big)
            elif e == self.BIG_FREE:
                self._free(e, big)
                live.remove(big)
            elif live and (rng.random() < 0.4 or len(live) > 120):  # grows to ~120 live, then holds
                victim = rng.choice([i for i in live if i != big] or live)
                self._free(e, victim)
                live.remove(victim)
            else:
                n = len(self.allocs)
                live.append(self._alloc(e, rng.choice([512, 4096, 65536, 1 << 20]) * rng.randint(1, 4),
                                        self.BASE + n * (4 << 20)))
        # Per event, after its operation: live bytes and each grouping's bytes per group.
        self.live_bytes: list[int] = []
        self.group_bytes = {g: [] for g in self.groupings()}
        total, per = 0, {g: dict.fromkeys(self._ids(g), 0) for g in self.groupings()}
        for kind, i in self.ops:
            if kind != "oom":
                size = self.allocs[i]["size"] * (1 if kind == "alloc" else -1)
                total += size
                for g in per:
                    per[g][self.group_of(i, g)] += size
            self.live_bytes.append(total)
            for g in per:
                self.group_bytes[g].append(dict(per[g]))
        self.peak_bytes = max(self.live_bytes)
        self.peak_event = self.live_bytes.index(self.peak_bytes)

    def _alloc(self, e: int, size: int, addr: int) -> int:
        i = len(self.allocs)
        self.allocs.append({"id": i, "size": size, "addr": addr, "stream": i % 2, "alloc_event": e, "free_event": None})
        self.ops.append(("alloc", i))
        return i

    def _free(self, e: int, i: int) -> None:
        self.allocs[i]["free_event"] = e
        self.ops.append(("free", i))

    # --- groups and frames ---------------------------------------------------------------
    @staticmethod
    def groupings() -> list[str]:
        return ["site", "category"]

    def groups(self, grouping: str) -> list[dict]:
        if grouping == "site":
            return [{"id": i, "label": s, "color": i} for i, s in enumerate(self.SITES)] + \
                   [{"id": -1, "label": "other", "color": 3}]
        return [{"id": 0, "label": "small", "color": 0}, {"id": 1, "label": "large", "color": 1}]

    def _ids(self, grouping: str) -> list[int]:
        return [g["id"] for g in self.groups(grouping)]

    def group_of(self, i: int, grouping: str) -> int:
        if grouping == "site":
            return i % 4 if i % 4 < 3 else -1
        return 0 if self.allocs[i]["size"] < 1 << 20 else 1

    def frames(self, i: int) -> list[dict]:
        site = self.SITES[i % 4] if i % 4 < 3 else "helper"
        return [{"filename": "model.py", "line": 100 + i, "name": f"{site}_forward"},
                {"filename": "train.py", "line": 7, "name": "step"}]

    def matches(self, i: int, text: str) -> bool:
        return any(text in f["filename"] or text in f["name"] for f in self.frames(i))

    def time(self, e: int) -> int:
        return self.T0 + e * self.DT

    def live_at(self, e: int) -> list[int]:
        """The allocations live after event e, in allocation order (the stacking order)."""
        return [a["id"] for a in self.allocs if a["alloc_event"] <= e
                and (a["free_event"] is None or e < a["free_event"])]

    def _event(self, e: int) -> None:
        if not 0 <= e < self.EVENTS:
            raise ValueError(f"event {e} out of range: 0 <= event < {self.EVENTS}")

    # --- the API ---------------------------------------------------------------------------
    def info(self) -> dict:
        return {"file": "fake_snapshot.pickle", "device": "cuda:0", "events": self.EVENTS,
                "allocations": len(self.allocs), "peak_bytes": self.peak_bytes, "peak_event": self.peak_event,
                "time_us": [self.time(0), self.time(self.EVENTS - 1)], "groupings": self.groupings(),
                "groups": {g: self.groups(g) for g in self.groupings()},
                "ooms": [{"event": self.OOM_EVENT, "size": self.OOM_SIZE, "device_free": 123456789,
                          "time_us": self.time(self.OOM_EVENT)}],
                "segments_known": self.segments_known}

    def timeline(self, start: int, end: int, width: int, grouping: str, search: str | None) -> dict:
        if not 0 <= start < end <= self.EVENTS:
            raise ValueError(f"bad range [{start}, {end}): need 0 <= start < end <= {self.EVENTS}")
        if not 1 <= width <= 8192:
            raise ValueError(f"width {width} out of range: 1 <= width <= 8192")
        if grouping not in self.groupings():
            raise ValueError(f"unknown grouping {grouping!r}; known: {', '.join(self.groupings())}")
        w = min(width, end - start)
        x = [start + i * (end - start) // w for i in range(w + 1)]
        top, low, bands = [], [], {g: [] for g in self._ids(grouping)}
        for i in range(w):
            span = range(x[i], x[i + 1])
            peak = max(span, key=lambda e: self.live_bytes[e])
            top.append(self.live_bytes[peak])
            low.append(min(self.live_bytes[e] for e in span))
            for g in bands:
                bands[g].append(self.group_bytes[grouping][peak][g])
        match = None
        if search:
            per_event = self._match_bytes(search)
            match = [max(per_event[x[i]:x[i + 1]]) for i in range(w)]
        return {"start": start, "end": end, "width": w, "x": x, "max": top, "min": low,
                "bands": [{"id": g, "bytes": b} for g, b in bands.items()],
                "time_us": [self.time(e) for e in x[:-1]], "match": match,
                "allocations": self._polygons(start, end, grouping) if end - start <= self.WINDOW else None}

    def _match_bytes(self, text: str) -> list[int]:
        out, total = [], 0
        for kind, i in self.ops:
            if kind != "oom" and self.matches(i, text):
                total += self.allocs[i]["size"] * (1 if kind == "alloc" else -1)
            out.append(total)
        return out

    def _polygons(self, start: int, end: int, grouping: str) -> list[dict]:
        # Each allocation's [lo, hi) band, stacked in allocation order: a point where it appears
        # or its lo changes (an allocation below it was freed), and a last point where it ends.
        points: dict[int, list[list[int]]] = {}
        live = self.live_at(start)
        for e in range(start, end):
            kind, j = self.ops[e]
            if e > start and kind == "alloc":
                live.append(j)
            elif e > start and kind == "free":
                live.remove(j)
            lo = 0
            for i in live:
                size = self.allocs[i]["size"]
                if i not in points or points[i][-1][1] != lo:
                    points.setdefault(i, []).append([e, lo, lo + size])
                lo += size
        out = []
        for i, pts in points.items():
            free = self.allocs[i]["free_event"]
            pts.append([min(free, end) if free is not None else end, pts[-1][1], pts[-1][2]])
            out.append({"id": i, "group": self.group_of(i, grouping), "points": pts})
        return out

    def at(self, event: int, y: int) -> dict:
        self._event(event)
        if y < 0:
            raise ValueError(f"y {y} out of range: y >= 0")
        live, lo, found = self.live_at(event), 0, None
        for i in live:
            a = self.allocs[i]
            if lo <= y < lo + a["size"]:
                free = a["free_event"]
                found = {**a, "alloc_time_us": self.time(a["alloc_event"]),
                         "free_time_us": self.time(free) if free is not None else None,
                         "group": self.groups("site")[self._ids("site").index(self.group_of(i, "site"))]["label"],
                         "lo": lo, "hi": lo + a["size"], "frames": self.frames(i)}
                break
            lo += a["size"]
        return {"event": event, "live_bytes": self.live_bytes[event], "live_count": len(live), "allocation": found}

    def segments(self, event: int) -> dict:
        self._event(event)
        live = set(self.live_at(event))
        segs: dict[int, dict] = {}
        for a in self.allocs:  # a segment exists once any of its blocks was allocated (never released)
            if a["alloc_event"] > event:
                break
            big = a["size"] == self.BIG_SIZE
            key = -1 if big else a["id"] // 8
            seg = segs.setdefault(key, {"addr": self.BIG_ADDR if big else self.BASE + key * self.SEGMENT,
                                        "size": self.BIG_SIZE if big else self.SEGMENT, "stream": 0, "blocks": []})
            if a["id"] in live:
                seg["blocks"].append({"addr": a["addr"], "size": a["size"], "id": a["id"]})
        listed = sorted(segs.values(), key=lambda s: s["addr"])
        return {"event": event, "reserved": sum(s["size"] for s in listed),
                "allocated": self.live_bytes[event], "segments": listed[:2000], "truncated": len(listed) > 2000}

    def search(self, text: str) -> dict:
        if not text:
            raise ValueError("empty search text: give part of a file name, function or module")
        hits = [a["id"] for a in self.allocs if self.matches(a["id"], text)]
        stacks = {tuple((f["filename"], f["line"], f["name"]) for f in self.frames(i)) for i in hits}
        return {"text": text, "stacks": len(stacks), "allocations": len(hits),
                "peak_bytes": max(self._match_bytes(text)) if hits else 0}


# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake():
    return FakeHistory()


@pytest.fixture(scope="module")
def server(fake):
    s = serve(fake).start_in_thread()
    yield s
    s.close()


def get(server, path, method="GET", headers=None):
    """(status, headers, body bytes) of one request, errors included."""
    request = urllib.request.Request(server.url.rstrip("/") + path, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def get_json(server, path):
    status, headers, body = get(server, path)
    assert headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    return status, json.loads(body), body


def test_fake_history_is_consistent(fake):
    """The fake itself: bands add up to the max, and at() finds what the polygons show."""
    t = fake.timeline(2450, 2650, 100, "site", "attention")
    for i in range(t["width"]):
        assert sum(b["bytes"][i] for b in t["bands"]) == t["max"][i]
        assert t["min"][i] <= t["max"][i] and 0 <= t["match"][i] <= t["max"][i]
    assert max(t["max"]) == fake.peak_bytes and fake.BIG_SIZE < fake.peak_bytes < fake.BIG_SIZE + (1 << 29)
    for poly in t["allocations"][::7]:
        event, lo, hi = poly["points"][0]
        assert fake.at(event, (lo + hi) // 2)["allocation"]["id"] == poly["id"]


def test_server_binds_loopback_and_closes(fake):
    s = serve(fake)
    assert s.url == f"http://127.0.0.1:{s.port}/" and s.port > 0
    s.start_in_thread()
    assert get(s, "/api/info")[0] == 200
    s.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(s.url + "api/info", timeout=2)


def test_json_routes_answer_what_the_history_answers(server, fake):
    cases = {
        "/api/info": fake.info(),
        "/api/timeline?start=0&end=5000&width=640&grouping=site": fake.timeline(0, 5000, 640, "site", None),
        "/api/timeline?start=2450&end=2650&width=300&grouping=category&search=mlp":
            fake.timeline(2450, 2650, 300, "category", "mlp"),
        "/api/timeline?start=10&end=20&width=5&grouping=site&search=": fake.timeline(10, 20, 5, "site", None),
        "/api/at?event=2550&y=1000": fake.at(2550, 1000),
        "/api/segments?event=4000": fake.segments(4000),
        "/api/search?text=attention_forward": fake.search("attention_forward"),
        "/api/search?text=model%2Epy%20x": fake.search("model.py x"),
    }
    for path, expected in cases.items():
        status, body, raw = get_json(server, path)
        assert status == 200, (path, body)
        assert body == expected, path
        assert b", " not in raw[:2000] and b": " not in raw[:2000]  # compact separators
    assert fake.at(2550, 1000)["allocation"] is not None


@pytest.mark.parametrize("path, words", [
    ("/api/timeline?end=10&width=5&grouping=site", ["'start'", "integer"]),
    ("/api/timeline?start=1.5&end=10&width=5&grouping=site", ["'start'", "decimal integer", "1.5"]),
    ("/api/timeline?start=+1&end=10&width=5&grouping=site", ["'start'", "decimal integer"]),
    ("/api/timeline?start=0x10&end=10&width=5&grouping=site", ["'start'"]),
    ("/api/timeline?start=0&end=10&width=5", ["'grouping'", "missing"]),
    ("/api/timeline?start=0&end=10&width=5&grouping=site&zoom=2", ["unknown parameter 'zoom'", "allowed", "search"]),
    ("/api/timeline?start=0&start=1&end=10&width=5&grouping=site", ["more than once"]),
    ("/api/timeline?start=0&end=5001&width=5&grouping=site", ["bad range", "5000"]),  # the history's ValueError
    ("/api/timeline?start=5&end=5&width=5&grouping=site", ["bad range"]),
    ("/api/timeline?start=0&end=10&width=0&grouping=site", ["width", "8192"]),
    ("/api/timeline?start=0&end=10&width=9000&grouping=site", ["width", "8192"]),
    ("/api/timeline?start=0&end=10&width=5&grouping=color", ["unknown grouping", "site, category"]),
    ("/api/at?event=1", ["'y'"]),
    ("/api/at?event=-1&y=0", ["out of range"]),
    ("/api/at?event=1&y=abc", ["'y'", "'abc'"]),
    ("/api/segments?event=" + "9" * 40, ["'event'", "decimal integer"]),
    ("/api/segments", ["'event'"]),
    ("/api/search", ["'text'"]),
    ("/api/search?text=", ["empty search text"]),
    ("/api/info?x=1", ["unknown parameter 'x'", "none"]),
])
def test_bad_parameters_are_400_with_a_reason(server, path, words):
    status, body, _ = get_json(server, path)
    assert status == 400, body
    assert set(body) == {"error"}
    for word in words:
        assert word in body["error"], (word, body["error"])


def test_unknown_paths_and_methods_are_404_json(server):
    for path, method in [("/nope", "GET"), ("/api/", "GET"), ("/api/info/x", "GET"), ("/favicon.ico", "GET"),
                         ("/api/info", "POST"), ("/", "PUT"), ("/api/info", "DELETE")]:
        status, headers, body = get(server, path, method=method)
        assert status == 404, (path, method)
        assert headers["Content-Type"] == "application/json"
        assert "GET" in json.loads(body)["error"]


def test_history_bugs_are_500_json(fake):
    class Broken(FakeHistory):
        def segments(self, event):
            raise RuntimeError("segment table corrupt")

        def search(self, text):
            return {"text": text, "peak_bytes": float("nan")}

    s = serve(Broken()).start_in_thread()
    try:
        status, body, _ = get_json(s, "/api/segments?event=3")
        assert status == 500 and body == {"error": "RuntimeError: segment table corrupt"}
        status, body, _ = get_json(s, "/api/search?text=x")
        assert status == 500 and "JSON" in body["error"]
        assert get_json(s, "/api/info")[0] == 200  # the server keeps serving
    finally:
        s.close()


def test_page_is_html_with_a_csp_and_no_external_references(server):
    status, headers, body = get(server, "/")
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["Content-Security-Policy"] == CSP
    assert headers["Cache-Control"] == "no-store"
    assert CSP.startswith("default-src 'self'; ") and "connect-src" not in CSP  # fetch: own origin only
    html = body.decode("utf-8")
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert "http://" not in html and "https://" not in html
    # No protocol-relative or other external loads: scripts and styles are inline only.
    assert not re.search(r"""(src|href)\s*=\s*["']?(//|[a-z]+:(?!,))""", html, re.I), "external reference"
    assert not re.search(r"<script[^>]*\bsrc\b", html, re.I) and not re.search(r"<link[^>]*stylesheet", html, re.I)
    assert "@import" not in html and not re.search(r"url\((?!data:)", html)
    assert get(server, "/index.html")[2] == body


def test_foreign_host_header_is_refused(server):
    # A page elsewhere that rebinds its own name to 127.0.0.1 sends that name as Host.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/api/info", headers={"Host": f"evil.example:{server.port}"})
        response = conn.getresponse()
        assert response.status == 403 and "rebinding" in json.loads(response.read())["error"]
        conn.request("GET", "/api/info", headers={"Host": f"localhost:{server.port}"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_requests_are_recorded_and_not_logged(server, capfd):
    get(server, "/api/info")
    get(server, "/api/at?event=3&y=0")
    get(server, "/nope", method="POST")
    assert list(server.requests)[-3:] == ["/api/info", "/api/at?event=3&y=0", "POST /nope"]
    out, err = capfd.readouterr()
    assert err == "" and out == ""


def test_page_ships_in_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    assert "vramkit.view" in tool["packages"]
    assert "page.html" in tool["package-data"]["vramkit.view"]
