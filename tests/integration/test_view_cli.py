"""`vramkit view` as a user runs it: a subprocess that prints its address, answers the page's API
from the file it was given, writes the summary beside the file, and stops on Ctrl-C; bad input
is one line and exit status 1 or 2."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import urllib.request

import vramkit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
import torch_snapshots as ts  # noqa: E402
from test_view_history import random_snapshot  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (os.path.dirname(os.path.dirname(vramkit.__file__)), os.environ.get("PYTHONPATH")) if p))


def vramkit_view(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vramkit", "view", *args], capture_output=True, text=True,
                          timeout=60, env=ENV, check=False)


def test_serves_the_file_and_stops_on_ctrl_c(tmp_path):
    path = ts.write_pickle(random_snapshot(5, steps=400), tmp_path / "train.pickle")
    proc = subprocess.Popen([sys.executable, "-m", "vramkit", "view", path, "--no-browser"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r"Serving the view at (http://127\.0\.0\.1:\d+/)", line)
            if m:
                break
        assert m, lines
        info = json.load(urllib.request.urlopen(m.group(1) + "api/info", timeout=10))
        from vramkit.view import load_history

        assert info == load_history(path, cache=False).info()
        assert re.search(rf"{info['events']:,} events, {info['allocations']:,} allocations", lines[0])
        assert os.path.exists(path + ".vkview")
        page = urllib.request.urlopen(m.group(1), timeout=10).read().decode()
        assert "<canvas" in page
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_input_is_one_line(tmp_path):
    missing = vramkit_view(str(tmp_path / "nope.pickle"), "--no-browser")
    assert missing.returncode == 1 and "No such file" in missing.stderr and missing.stderr.count("\n") == 1
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}).replace(b"}", b"c", 1))
    bad = vramkit_view(str(evil), "--no-browser")
    assert bad.returncode == 1 and bad.stderr.startswith("vramkit view: error: ") and "Traceback" not in bad.stderr
    empty = ts.write_pickle(ts.snapshot([[]], []), tmp_path / "empty.pickle")
    none = vramkit_view(empty, "--no-browser")
    assert none.returncode == 1 and "records no allocation" in none.stderr
    port = vramkit_view(empty, "--port", "70000")
    assert port.returncode == 2 and "port number from 0 to 65535" in port.stderr
    several = ts.write_pickle(ts.snapshot([[ts.alloc(0x10, 512)], [ts.alloc(0x20, 512)]], []), tmp_path / "two.pickle")
    two = vramkit_view(several, "--no-browser")
    assert two.returncode == 1 and "pass a device" in two.stderr
    three = vramkit_view(several, "--device", "5", "--no-browser")
    assert three.returncode == 1 and "device 5 is out of range" in three.stderr
