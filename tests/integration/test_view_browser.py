"""The `vramkit view` page in a real headless Chromium, driven by selenium.

The page is served by vramkit.view.serve over FakeHistory (tests/unit/test_view_server.py), whose
answers the tests recompute: the header, zooming (API calls, mouse wheel, drag, shift-drag
brush, buttons and inputs), grouping, search, the allocation under a click, the segments and the
OOM points. After every test the browser's console must hold no error, the page must have
recorded none, and every request the page made must have gone to the local server.

Needs Debian's chromium and chromium-driver and the selenium package; the module skips without
them. Selenium is pointed at both binaries and SE_OFFLINE is set, so selenium-manager never
tries to download a driver. The whole module takes well under a minute (one browser for all).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from urllib.parse import parse_qs, urlsplit

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    webdriver = None
if not (CHROMIUM and CHROMEDRIVER and webdriver):
    pytest.skip("the browser test of vramkit view needs Chromium, its driver and selenium: "
                "apt-get install -y chromium chromium-driver; pip install 'selenium>=4.20' "
                f"(found chromium={CHROMIUM}, chromedriver={CHROMEDRIVER}, selenium={webdriver is not None})",
                allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
from test_view_server import FakeHistory  # noqa: E402

from vramkit.view import serve  # noqa: E402

BUDGET_S = 60  # the whole module; a test that ends past it fails


def human(b: int) -> str:
    """The page's byte format (human() in page.html): three significant digits, binary units."""
    v, i, units = abs(b), 0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    s = str(v) if i == 0 else f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2}f}"
    return ("-" if b < 0 else "") + s + " " + units[i]


class Page:
    """One browser tab on one server, with its console and network logs gathered as it goes."""

    def __init__(self, driver, server, fake):
        self.driver, self.server, self.fake = driver, server, fake
        self.console: list[dict] = []
        self.urls: list[str] = []

    def open(self) -> None:
        self.driver.get(self.server.url)
        self.wait_ready()
        assert self.call("window.vkView.ready")["start"] == 0

    def wait_ready(self) -> None:
        WebDriverWait(self.driver, 10, poll_frequency=0.02).until(
            lambda d: d.execute_script("return document.body.dataset.state") == "ready")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def call(self, expression: str):
        """Await a promise in the page; its value, or an AssertionError with the page's error."""
        result = self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"Promise.resolve({expression}).then(v => done({{ok: true, value: v === undefined ? null : v}}),"
            " e => done({ok: false, error: String(e && e.message || e)}));")
        assert result["ok"], result["error"]
        self.wait_ready()
        return result["value"]

    def vk(self, name: str):
        return self.js(f"return window.vkView.{name}")

    def text(self, element_id: str) -> str:
        return self.driver.find_element(By.ID, element_id).text

    def canvas(self) -> str:
        return self.js("return document.getElementById('tl').toDataURL()")

    def new_requests(self, since: int, route: str) -> list[dict]:
        """The queries of the requests for /api/<route> the server got after the first `since`."""
        out = []
        for path in list(self.server.requests)[since:]:
            parts = urlsplit(path)
            if parts.path == "/api/" + route:
                out.append({k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()})
        return out

    def drain(self) -> None:
        self.console += self.driver.get_log("browser")
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            # Chromium's own pages (the new-tab page it starts with) load chrome:// resources;
            # every other request, whatever made it, is counted.
            if message["method"] == "Network.requestWillBeSent" \
                    and not message["params"].get("documentURL", "").startswith("chrome:"):
                self.urls.append(message["params"]["request"]["url"])

    def check(self) -> None:
        """No console error, no error shown by the page, no request to anywhere but the server."""
        self.drain()
        errors = [e["message"] for e in self.console if e["level"] in ("SEVERE", "ERROR")]
        self.console.clear()
        page_errors = self.js("return window.vkView ? window.vkView.errors.slice() : ['no vkView']")
        foreign = [u for u in self.urls if not u.startswith(self.server.url) and not u.startswith("data:")]
        assert not errors, f"browser console errors: {errors}"
        assert not page_errors, f"errors shown by the page: {page_errors}"
        assert not foreign, f"requests that left the server: {foreign}"


@pytest.fixture(scope="module")
def budget():
    return time.monotonic()


@pytest.fixture(scope="module")
def driver(tmp_path_factory, budget):
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}", "--window-size=1400,1000",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-extensions", "--force-device-scale-factor=1"]:
        options.add_argument(arg)
    # Console messages and the network log (which URLs the page requested) for Page.check.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # selenium-manager must not look for a driver online
        d = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    d.set_script_timeout(15)
    d.set_page_load_timeout(15)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def fake():
    return FakeHistory()


@pytest.fixture(scope="module")
def server(fake):
    s = serve(fake).start_in_thread()
    yield s
    s.close()


@pytest.fixture
def page(driver, server, fake, budget):
    p = Page(driver, server, fake)
    if driver.current_url != server.url:
        p.open()
    else:
        p.call("window.vkView.zoomTo(0, 5000)")
    yield p
    p.check()
    assert time.monotonic() - budget < BUDGET_S, f"the browser tests took over {BUDGET_S} s"


def plot_width(page: Page) -> int:
    return int(page.new_requests(0, "timeline")[-1]["width"])


def test_header_and_first_draw(page, fake):
    info = fake.info()
    assert page.text("h-file") == "fake_snapshot.pickle"
    meta = page.text("h-meta")
    for part in ["cuda:0", "5,000 events", f"{info['allocations']:,} allocations",
                 f"peak {human(fake.peak_bytes)} at event {fake.peak_event:,}", "span 1.25 s", "1 OOM"]:
        assert part in meta, (part, meta)
    assert human(fake.peak_bytes).endswith(" GiB")
    first = page.new_requests(0, "timeline")[0]
    assert first["start"] == "0" and first["end"] == "5000" and first["grouping"] == "site"
    width = int(first["width"])
    assert 800 < width < 1400  # one bucket per CSS pixel of the plot
    assert page.vk("lastTimeline") == fake.timeline(0, 5000, width, "site", None)
    stats = page.vk("stats")
    assert stats["bands"] == 4 and stats["allocations"] == 0 and stats["draws"] >= 1 and stats["ooms"] == 1


def test_zoom_to_fetches_that_range_and_redraws(page, fake):
    before, n = page.canvas(), len(page.server.requests)
    drawn = page.call("window.vkView.zoomTo(1000, 2000)")
    asked = page.new_requests(n, "timeline")
    assert asked and asked[-1]["start"] == "1000" and asked[-1]["end"] == "2000"
    assert drawn == fake.timeline(1000, 2000, int(asked[-1]["width"]), "site", None)
    assert page.canvas() != before
    assert page.js("return [document.getElementById('i-from').value, document.getElementById('i-to').value]") \
        == ["1000", "2000"]
    # A range the history would refuse is refused by the page itself, without a request.
    assert "zoomTo needs" in page.call("window.vkView.zoomTo(5, 3).catch(e => e.message)")
    assert page.vk("view()") == {"start": 1000, "end": 2000}


def test_zoomed_in_far_draws_each_allocation(page, fake):
    t = page.call("window.vkView.zoomTo(2450, 2650)")
    assert t["allocations"] and t["allocations"] == fake.timeline(2450, 2650, t["width"], "site", None)["allocations"]
    stats = page.vk("stats")
    assert stats["allocations"] == len(t["allocations"]) and stats["bands"] == 0


def test_mouse_and_buttons_zoom_and_pan(page, driver):
    canvas = driver.find_element(By.ID, "tl")
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(canvas), 0, -500).perform()
    page.wait_ready()
    view = page.vk("view()")
    assert view["end"] - view["start"] < 5000 * 0.7  # the wheel zoomed in around the cursor (centre)
    assert view["start"] < 2500 < view["end"]
    last = page.new_requests(0, "timeline")[-1]
    assert int(last["start"]) <= view["start"] and view["end"] <= int(last["end"])

    ActionChains(driver).click_and_hold(canvas).move_by_offset(-200, 0).release().perform()
    page.wait_ready()
    panned = page.vk("view()")
    assert panned["start"] > view["start"] + 1
    assert panned["end"] - panned["start"] == pytest.approx(view["end"] - view["start"])

    page.call("window.vkView.zoomTo(0, 5000)")
    width = plot_width(page)
    ActionChains(driver).move_to_element_with_offset(canvas, -200, 0).key_down(Keys.SHIFT).click_and_hold() \
        .move_by_offset(width // 5, 0).release().key_up(Keys.SHIFT).perform()
    page.wait_ready()
    brushed = page.vk("view()")
    assert brushed["end"] - brushed["start"] == pytest.approx(1000, rel=0.05)  # a fifth of the plot

    driver.find_element(By.ID, "b-out").click()
    page.wait_ready()
    out = page.vk("view()")
    assert out["end"] - out["start"] == pytest.approx(2 * (brushed["end"] - brushed["start"]))
    driver.find_element(By.ID, "b-reset").click()
    page.wait_ready()
    assert page.vk("view()") == {"start": 0, "end": 5000}

    for element_id, value in [("i-from", "300"), ("i-to", "700")]:
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    field.send_keys(Keys.ENTER)
    page.wait_ready()
    assert page.vk("view()") == {"start": 300, "end": 700}
    assert page.vk("lastTimeline.start") == 300 and page.vk("lastTimeline.end") == 700


def test_grouping_changes_the_legend_and_the_request(page, driver, fake):
    assert "attention" in page.text("legend")
    n = len(page.server.requests)
    t = page.call("window.vkView.setGrouping('category')")
    legend = page.text("legend")
    assert "small" in legend and "large" in legend and "attention" not in legend
    assert page.new_requests(n, "timeline")[-1]["grouping"] == "category"
    assert t == fake.timeline(0, 5000, t["width"], "category", None)
    assert page.vk("stats.bands") == 2
    Select(driver.find_element(By.ID, "s-group")).select_by_value("site")
    page.wait_ready()
    assert "attention" in page.text("legend") and page.vk("lastTimeline.bands.length") == 4


def test_search_overlays_the_matching_bytes(page, driver, fake):
    box = driver.find_element(By.ID, "i-search")
    box.clear()
    box.send_keys("attention", Keys.ENTER)
    page.wait_ready()
    found = fake.search("attention")
    assert f"{found['allocations']:,} allocations in {found['stacks']:,} stacks match" in page.text("search-info")
    asked = page.new_requests(0, "timeline")[-1]
    assert asked["search"] == "attention"
    t = page.vk("lastTimeline")
    assert t["match"] == fake.timeline(0, 5000, t["width"], "site", "attention")["match"]
    assert page.vk("stats.match") is True and "matches “attention”" in page.text("legend")
    t = page.call("window.vkView.zoomTo(2000, 2100)")  # the search stays on while zooming
    assert t["match"] is not None and page.new_requests(0, "timeline")[-1]["search"] == "attention"
    page.call("window.vkView.search('')")
    assert page.vk("stats.match") is False and page.vk("lastTimeline.match") is None


def test_click_shows_the_allocation_and_its_frames(page, driver, fake):
    big = next(a for a in fake.allocs if a["size"] == fake.BIG_SIZE)
    lo = sum(fake.allocs[i]["size"] for i in fake.live_at(2550) if i < big["id"])
    y = lo + 12345
    expected = fake.at(2550, y)
    assert expected["allocation"]["id"] == big["id"]
    page.call("window.vkView.zoomTo(2450, 2650)")
    assert page.call(f"window.vkView.clickAt(2550, {y})") == expected
    panel = page.text("at")
    for f in expected["allocation"]["frames"]:
        assert f"{f['filename']}:{f['line']} {f['name']}" in panel
    assert human(fake.BIG_SIZE) in panel and hex(big["addr"]) in panel and "event 2,600" in panel
    page.call(f"window.vkView.clickAt(2550, {fake.live_bytes[2550] + 10})")
    assert "nothing allocated here" in page.text("at")

    # A real click in the plot asks for the point under it and pins the panel.
    n = len(page.server.requests)
    ActionChains(driver).move_to_element_with_offset(driver.find_element(By.ID, "tl"), 0, 100).click().perform()
    page.wait_ready()
    at = page.vk("lastAt")
    assert at == fake.at(at["event"], int(page.new_requests(n, "at")[-1]["y"]))
    assert 2450 <= at["event"] < 2650 and page.new_requests(n, "segments")
    driver.find_element(By.ID, "b-unpin").click()


def test_hover_shows_what_is_under_the_cursor(page, driver, fake):
    page.js("document.getElementById('b-unpin').click(); window.vkView.lastAt = null")
    n = len(page.server.requests)
    canvas = driver.find_element(By.ID, "tl")
    ActionChains(driver).move_to_element_with_offset(canvas, -150, 150).move_by_offset(5, -3) \
        .move_by_offset(5, -3).perform()
    WebDriverWait(driver, 10, poll_frequency=0.02).until(
        lambda d: d.execute_script("return window.vkView.lastAt !== null && document.getElementById('at').textContent"))
    time.sleep(0.2)  # let the last of the throttled requests land
    asked = page.new_requests(n, "at")
    assert 1 <= len(asked) <= 3 and not page.new_requests(n, "segments")  # hovering does not load segments
    at = page.vk("lastAt")
    assert at == fake.at(int(asked[-1]["event"]), int(asked[-1]["y"]))
    assert f"event {at['event']:,}:" in page.text("at")


def test_segments_panel(page, fake):
    page.call("window.vkView.clickAt(4000, 0)")
    expected = fake.segments(4000)
    assert page.vk("lastSegments") == expected
    totals = page.text("seg-totals")
    assert f"{len(expected['segments'])} segments" in totals
    assert f"reserved {human(expected['reserved'])}" in totals and f"allocated {human(expected['allocated'])}" in totals
    assert page.text("seg-title") == "at event 4,000"
    assert page.js("return document.getElementById('segc').height") > 0


def test_oom_points_zoom_to_the_oom(page, driver, fake):
    page.call("window.vkView.zoomTo(0, 1000)")
    assert page.vk("stats.ooms") == 0
    n = len(page.server.requests)
    Select(driver.find_element(By.ID, "s-oom")).select_by_index(1)
    page.wait_ready()
    view = page.vk("view()")
    assert view["start"] < fake.OOM_EVENT < view["end"]
    asked = page.new_requests(n, "timeline")[-1]
    assert int(asked["start"]) < fake.OOM_EVENT < int(asked["end"])
    assert page.vk("stats.ooms") == 1
    assert "OOM at event 3,000 (2.00 GiB)" in page.text("s-oom")


def test_only_the_server_was_asked(page, server):
    page.drain()
    assert page.urls and all(u.startswith(server.url) for u in page.urls)
    routes = {"/", "/api/info", "/api/timeline", "/api/at", "/api/segments", "/api/search"}
    assert {urlsplit(p).path for p in server.requests} <= routes
    assert "/favicon.ico" not in server.requests


@pytest.mark.parametrize("fault", [
    "setTimeout(() => { throw new Error('boom from the test') }, 0)",
    "Promise.reject(new Error('boom from the test'))",
    "console.error('boom from the test')",
    "window.vkView.zoomTo(0, 99999999)",  # an API call the page refuses, left unhandled
])
def test_a_javascript_error_fails_the_check(page, fault):
    page.js(fault)
    time.sleep(0.3)
    with pytest.raises(AssertionError, match="boom from the test|zoomTo needs"):
        page.check()
    page.open()  # a fresh page, with no error, for the fixture's own check


def test_file_without_segment_events(driver, page):
    other = serve(FakeHistory(segments_known=False)).start_in_thread()
    page.check()  # what the browser logged so far belongs to the first server
    try:
        p = Page(driver, other, other.history)
        p.open()
        assert "records no segment events" in p.text("seg-title")
        p.call("window.vkView.clickAt(10, 0)")
        assert "records no segment events" in p.text("seg-totals")
        assert not p.new_requests(0, "segments") and p.vk("lastAt")["event"] == 10
        p.check()
    finally:
        other.close()
        page.open()
