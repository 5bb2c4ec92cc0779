"""`vramkit view` on a large snapshot: open time, zoom and pan latency, the browser tab's memory.

    python benchmarks/view_open.py                  # a 1 GiB snapshot (17.3 M entries, 11.5 M events)
    python benchmarks/view_open.py --quick          # 200,000 entries, for a smoke run
    python benchmarks/view_open.py --file X.pickle  # your own snapshot

Goals (issue 36): a 1 GB snapshot open in <= 5 s after its first summary, <= 200 ms for any zoom
or pan, the browser tab <= 300 MB. The peer is Python's unpickler on the same file: what
``torch.cuda._memory_viz`` (PyTorch's command-line viewer) and every Python tool do first, and the
least any viewer that reads the pickle whole must pay. pytorch.org/memory_viz itself is a web page
on pytorch.org and cannot be loaded offline here.

Each open is measured in a fresh process (its wall time and its peak resident memory, VmHWM);
zooms are timed at the server (the History's answer) and in headless Chromium (from the page's
request to its finished draw), when chromium, chromedriver and selenium are installed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_CHILD = r"""
import sys, time
t = time.perf_counter()
if sys.argv[1] == "pickle":
    import pickle
    with open(sys.argv[2], "rb") as f:
        pickle.load(f)
else:
    from vramkit.view import load_history
    load_history(sys.argv[2], cache=sys.argv[1] != "nocache")
wall = time.perf_counter() - t
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(wall, int(hwm) * 1024)
"""


def _measure(what: str, path: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, what, path], check=True, capture_output=True, text=True)
    wall, rss = out.stdout.split()
    return float(wall), int(rss)


def _server_latency(path: str, rounds: int) -> dict[str, float]:
    from vramkit.view import load_history

    h = load_history(path)
    n = h.events
    rng = random.Random(0)
    times: dict[str, list[float]] = {"zoom": [], "at": [], "segments": [], "search": []}
    for r in range(rounds):
        span = max(10, int(n * 10 ** -rng.uniform(0, 5)))
        start = rng.randrange(0, n - span + 1)
        t = time.perf_counter()
        h.timeline(start, start + span, 1600, "site")
        times["zoom"].append(time.perf_counter() - t)
        t = time.perf_counter()
        h.at(rng.randrange(n), rng.randrange(1 << 30))
        times["at"].append(time.perf_counter() - t)
        if r < 5:
            t = time.perf_counter()
            h.segments(rng.randrange(n))
            times["segments"].append(time.perf_counter() - t)
            t = time.perf_counter()
            h.search(rng.choice(["attention", "layers.py", "forward_1", "collate"]) + str(r))
            times["search"].append(time.perf_counter() - t)
    return {k: max(v) * 1e3 for k, v in times.items()} | {"zoom_median": statistics.median(times["zoom"]) * 1e3}


def _browser(path: str, rounds: int) -> dict[str, float] | None:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        import psutil
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if not (chromium and driver_path):
        return None
    from vramkit.view import load_history, serve

    server = serve(load_history(path)).start_in_thread()
    options = Options()
    options.binary_location = chromium
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000",
                f"--user-data-dir={tempfile.mkdtemp()}", "--enable-precise-memory-info"]:
        options.add_argument(arg)
    os.environ["SE_OFFLINE"] = "true"
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        d.execute_cdp_cmd("Performance.enable", {})
        t = time.perf_counter()
        d.get(server.url)
        d.set_script_timeout(60)
        d.execute_async_script("const done = arguments[arguments.length-1]; window.vkView.ready.then(() => done());")
        first = time.perf_counter() - t
        n = d.execute_script("return window.vkView.lastTimeline.end")
        rng = random.Random(1)
        zooms = []
        for _ in range(rounds):
            span = max(10, int(n * 10 ** -rng.uniform(0, 5)))
            start = rng.randrange(0, n - span + 1)
            ms = d.execute_async_script(
                "const done = arguments[arguments.length-1]; const t = performance.now();"
                f"window.vkView.zoomTo({start}, {start + span}).then(() => done(performance.now() - t));")
            zooms.append(ms)
        heap = d.execute_cdp_cmd("Performance.getMetrics", {})
        metrics = {m["name"]: m["value"] for m in heap["metrics"]}
        service_pid = d.service.process.pid
        renderers = [p for p in psutil.Process(service_pid).children(recursive=True)
                     if "--type=renderer" in " ".join(p.cmdline())]
        tab_rss = max((p.memory_info().rss for p in renderers), default=0)
        return {"first_draw_s": first, "zoom_max_ms": max(zooms), "zoom_median_ms": statistics.median(zooms),
                "js_heap_mb": metrics.get("JSHeapUsedSize", 0) / 1e6, "tab_rss_mb": tab_rss / 1e6}
    finally:
        d.quit()
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=17_300_000, help="snapshot entries to generate (default 1 GiB)")
    ap.add_argument("--quick", action="store_true", help="200,000 entries, 20 zooms: a smoke run")
    ap.add_argument("--file", help="a snapshot pickle to measure instead of a generated one")
    ap.add_argument("--rounds", type=int, default=40, help="zooms to time (default: %(default)s)")
    ns = ap.parse_args()
    entries, rounds = (200_000, 20) if ns.quick else (ns.entries, ns.rounds)
    tmp = tempfile.mkdtemp(prefix="vkview-bench-")
    try:
        path = ns.file
        if not path:
            from view_data import write_snapshot

            path = os.path.join(tmp, "snapshot.pickle")
            facts = write_snapshot(path, entries)
            print(f"generated {path}: {facts['bytes'] / 2**30:.2f} GiB, {facts['entries']:,} entries, "
                  f"{facts['memory_events']:,} memory events", flush=True)
        size = os.path.getsize(path)
        cache = path + ".vkview"
        if os.path.exists(cache):
            os.remove(cache)
        peer_s, peer_rss = _measure("pickle", path)
        first_s, first_rss = _measure("cache", path)
        open_s, open_rss = _measure("cache", path)
        server = _server_latency(path, rounds)
        browser = _browser(path, rounds)
        rows = [
            ("read the file whole (s)", first_s, peer_s, "first summary vs pickle.load", ""),
            ("peak memory, reading (GB)", first_rss / 1e9, peer_rss / 1e9, "vs pickle.load", ""),
            ("open after the summary (s)", open_s, peer_s, "vs pickle.load", "<= 5 s" + (" met" if open_s <= 5 else
                                                                                         " NOT met")),
            ("peak memory, open (GB)", open_rss / 1e9, peer_rss / 1e9, "vs pickle.load", ""),
            ("server: zoom/pan, max (ms)", server["zoom"], None, "", "<= 200 ms" + (
                " met" if server["zoom"] <= 200 else " NOT met")),
            ("server: zoom/pan, median (ms)", server["zoom_median"], None, "", ""),
            ("server: allocation under cursor, max (ms)", server["at"], None, "", ""),
            ("server: segments at an event, max (ms)", server["segments"], None, "", ""),
            ("server: new search, max (ms)", server["search"], None, "", ""),
        ]
        if browser:
            rows += [
                ("browser: first draw (s)", browser["first_draw_s"], None, "", ""),
                ("browser: zoom/pan to drawn, max (ms)", browser["zoom_max_ms"], None, "",
                 "<= 200 ms" + (" met" if browser["zoom_max_ms"] <= 200 else " NOT met")),
                ("browser: zoom/pan to drawn, median (ms)", browser["zoom_median_ms"], None, "", ""),
                ("browser: tab (renderer) RSS (MB)", browser["tab_rss_mb"], None, "",
                 "<= 300 MB" + (" met" if browser["tab_rss_mb"] <= 300 else " NOT met")),
                ("browser: JS heap (MB)", browser["js_heap_mb"], None, "", ""),
            ]
        print(f"\n`vramkit view` on {size / 2**30:.2f} GiB ({os.path.basename(path)}), {rounds} zooms")
        print(f"{'measure':<44} {'vramkit':>10} {'peer':>10} {'ratio':>7}  goal")
        for name, ours, peer, _, goal in rows:
            ratio = f"{ours / peer:7.2f}" if peer else "       "
            peer_text = f"{peer:10.2f}" if peer is not None else " " * 10
            print(f"{name:<44} {ours:10.2f} {peer_text} {ratio}  {goal}")
        if not browser:
            print("(no browser rows: chromium, chromedriver, selenium or psutil missing)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
