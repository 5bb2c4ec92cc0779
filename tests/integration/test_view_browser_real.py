"""The `vramkit view` page over a real history: a snapshot pickle read by vramkit's C reader
(not a stand-in), served and driven in headless Chromium. What the page shows is checked against
the History's own answers, and those against the events (tests/unit/test_view_history.py checks
the History against a brute-force recomputation and vramkit's Python importer)."""

from __future__ import annotations

import os
import sys

import pytest

# (skips this module too without Chromium); the browser fixtures are that module's
from test_view_browser import Page, budget, driver, human  # noqa: E402, F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
import torch_snapshots as ts  # noqa: E402
from test_view_history import random_snapshot  # noqa: E402

from vramkit.view import load_history, serve  # noqa: E402

@pytest.fixture(scope="module")
def history(tmp_path_factory):
    path = ts.write_pickle(random_snapshot(21, steps=6000), tmp_path_factory.mktemp("real") / "train.pickle")
    return load_history(path)


@pytest.fixture(scope="module")
def real_page(driver, history):
    server = serve(history).start_in_thread()
    page = Page(driver, server, history)
    page.open()
    yield page
    page.check()
    server.close()


def test_real_history_in_the_browser(real_page, history):
    page, info = real_page, history.info()
    meta = page.text("h-meta")
    assert f"{info['events']:,} events" in meta and f"{info['allocations']:,} allocations" in meta
    assert f"peak {human(info['peak_bytes'])}" in meta
    width = int(page.new_requests(0, "timeline")[-1]["width"])
    assert page.vk("lastTimeline") == history.timeline(0, info["events"], width, "site", None)
    # zoomed in far: each allocation on its own, as the history stacks them
    page.call("window.vkView.zoomTo(1000, 1400)")
    t = page.vk("lastTimeline")
    assert t["allocations"] and t == history.timeline(1000, 1400, t["width"], "site", None)
    # the allocation under a point, with its frames in the panel
    band = max(t["allocations"], key=lambda b: b["points"][0][2] - b["points"][0][1])
    event, lo, hi = band["points"][0]
    got = page.call(f"window.vkView.clickAt({event}, {(lo + hi) // 2})")
    assert got == history.at(event, (lo + hi) // 2) and got["allocation"]["id"] == band["id"]
    panel = page.text("at")
    for f in got["allocation"]["frames"]:
        assert f"{f['filename']}:{f['line']} {f['name']}" in panel
    # search by frame: the overlay is the history's answer
    page.call("window.vkView.search('model.py')")
    found = history.search("model.py")
    assert f"{found['allocations']:,} allocations in {found['stacks']:,} stacks match" in page.text("search-info")
    t = page.vk("lastTimeline")
    assert t["match"] == history.timeline(t["start"], t["end"], t["width"], "site", "model.py")["match"]
    # the segments at the clicked event
    page.call(f"window.vkView.clickAt({event}, 0)")
    assert page.vk("lastSegments") == history.segments(event)
    # the out-of-memory points are marked, every one of them once the view is whole again
    page.call(f"window.vkView.zoomTo(0, {info['events']})")
    assert page.vk("stats")["ooms"] == len(info["ooms"]) > 0


def test_durations_read_as_clock_time(real_page):
    """Found by looking at the page: 4 min 59.7 s was written "4 min 60 s"."""
    page = real_page
    for us, text in [(999, "999 µs"), (1500, "1.50 ms"), (59.9e6, "59.9 s"), (299.7e6, "5 min 0 s"),
                     (432.4e6, "7 min 12 s"), (3_661e6, "1 h 1 min")]:
        assert page.js(f"return dur({us})") == text, us


def test_axis_times_keep_their_resolution_when_zoomed(real_page):
    """Found by looking at the page: zoomed in past the first minute every label read "6 min 27 s"."""
    page = real_page
    assert page.js("return dur(387.4123e6, 5e3)") == "6 min 27.412 s"
    assert page.js("return dur(387.4123e6, 2e5)") == "6 min 27.4 s"
    assert page.js("return dur(387.4123e6, 5e6)") == "6 min 27 s"
