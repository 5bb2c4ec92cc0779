"""The offline HTML timeline, on traces recorded on fresh sim devices."""

from __future__ import annotations

import os
import random
import re

import pytest

import vramkit
from vramkit.report.sites import device_trace
from vramkit.report.timeline import MAX_POINTS, downsample, render_html

MiB = 1 << 20


def alloc_weights(device: str) -> vramkit.Buffer:
    return vramkit.empty(24 * MiB, device=device)


def alloc_activation(device: str) -> vramkit.Buffer:
    return vramkit.empty(6 * MiB, device=device)


@pytest.fixture
def recorded(sim):
    """A fresh sim device recording its history.

    The tests take memory as Buffers, freed on their own device when dropped: raw_free() takes
    only an address and every sim device hands out the same addresses.
    """
    vramkit.record_memory_history(True, device=sim)
    yield sim
    vramkit.record_memory_history(False, device=sim)


def allocated_path(page: str) -> str:
    return re.search(r'<path class="allocated" d="([^"]+)"', page).group(1)


def y_values(path: str) -> list[float]:
    """The y coordinates of an 'M x,y H x V y ...' step path."""
    return [float(path[1:].split("H")[0].split(",")[1])] + [float(v) for v in re.findall(r"V([-\d.]+)", path)]


def test_page_is_self_contained_and_shows_the_peak(recorded):
    w = alloc_weights(recorded)
    acts = [alloc_activation(recorded) for _ in range(3)]  # peak: 24 + 18 = 42 MiB
    acts.clear()
    page = render_html(vramkit.memory_snapshot(recorded), title="step <1> & co")
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page
    assert "<title>step &lt;1&gt; &amp; co</title>" in page
    assert "peak 42.0 MiB" in page
    assert re.findall(r"""\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.IGNORECASE) == []
    assert "<script" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    live_table = page[page.index("Largest live allocations"):page.index("Largest allocation sites")]
    assert live_table.count("<tr>") == 1 + 4  # header + weights + three activations
    assert live_table.index("24.0 MiB") < live_table.index("6.0 MiB")
    assert "in alloc_weights" in live_table and "in alloc_activation" in live_table
    del w


def test_curves_peak_and_final_values_in_the_plot(recorded):
    w = alloc_weights(recorded)
    a = alloc_activation(recorded)
    del a  # allocated: 24, 30 (peak), 24 MiB; the plot ends at 24 MiB
    page = render_html(vramkit.memory_snapshot(recorded), title="t")
    ys = y_values(allocated_path(page))
    top_px, bottom_px = min(ys), max(ys)  # pixel y grows downwards
    # y is linear in bytes, and the curve starts at 0 bytes: the ratio of heights is the ratio of bytes
    height = bottom_px - top_px
    assert ys[0] == bottom_px
    assert (bottom_px - ys[-1]) / height == pytest.approx(24 / 30, abs=0.01)
    assert "<dd>30.0 MiB</dd>" in page  # peak allocated headline
    assert f"<dd>{vramkit.memory_reserved(recorded) / MiB:.1f} MiB</dd>" in page  # reserved now
    del w


def allocated_from(device: str, filename: str, name: str) -> tuple[vramkit.Buffer, dict]:
    """A buffer allocated by a function that claims to be `name` in `filename`, and the snapshot."""

    def allocate(device: str) -> vramkit.Buffer:
        return vramkit.empty(MiB, device=device)

    allocate.__code__ = allocate.__code__.replace(co_name=name, co_filename=filename)
    b = allocate(device)
    return b, vramkit.memory_snapshot(device)


def test_frame_text_is_escaped(recorded):
    evil = "<script>alert(1)</script>"
    b, snapshot = allocated_from(recorded, "/tmp/<img src=x>.py", evil)
    assert any(f["name"] == evil for e in device_trace(snapshot) for f in e["frames"])  # the premise
    page = render_html(snapshot, title="t")
    assert evil not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    del b


def test_lone_surrogates_are_escaped_and_the_page_is_written(recorded, tmp_path):
    """A script path that is not UTF-8 reaches Python as lone surrogates (os.fsdecode): the page
    shows them escaped instead of raising UnicodeEncodeError after the report."""
    from vramkit.report.timeline import write_html

    odd = "/data/caf\udce9/train.py"  # b"/data/caf\xe9/train.py" decoded by the filesystem encoding
    b, snapshot = allocated_from(recorded, odd, "step\ud800")
    assert any(f["filename"] == odd for e in device_trace(snapshot) for f in e["frames"])  # the premise
    path = write_html(str(tmp_path / "t.html"), snapshot, title=f"vramkit timeline: {odd}")
    page = open(path, encoding="utf-8").read()  # valid UTF-8 throughout
    assert "caf\\udce9" in page and "step\\ud800" in page
    del b


def test_a_failed_write_leaves_no_partial_page(recorded, tmp_path, monkeypatch):
    from vramkit._core import files as _files
    from vramkit.report.timeline import write_html

    b = vramkit.empty(MiB, device=recorded)
    snapshot = vramkit.memory_snapshot(recorded)
    target = tmp_path / "t.html"
    target.write_text("the previous page")
    real_fdopen = _files.os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])  # half of it reaches the disk, then it is full
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(_files.os, "fdopen", FullDisk)
    with pytest.raises(OSError, match="No space left"):
        write_html(str(target), snapshot, title="t")
    assert target.read_text() == "the previous page"
    assert os.listdir(tmp_path) == ["t.html"]  # no temporary left behind
    del b


def test_long_trace_is_downsampled_but_keeps_the_spike(recorded):
    w = alloc_weights(recorded)
    for i in range(6000):
        a = vramkit.empty(MiB if i != 4321 else 64 * MiB, device=recorded)  # one short spike
        del a
    page = render_html(vramkit.memory_snapshot(recorded), title="t")
    path = allocated_path(page)
    assert path.count("H") <= MAX_POINTS + 1
    assert "peak 88.0 MiB" in page  # 24 MiB + the 64 MiB spike
    ys = y_values(path)
    assert min(ys) == pytest.approx(float(re.search(r'<circle class="peak" cx="[\d.]+" cy="([\d.]+)"', page).group(1)))
    assert len(page) < 400_000
    del w


def test_downsample_keeps_extremes_and_bounds_size():
    rng = random.Random(7)
    series = [rng.randrange(1000) for _ in range(100_000)]
    series[54_321] = 5000
    series[77_777] = -5
    other = [rng.randrange(10) for _ in range(100_000)]
    keep = downsample(len(series), [series, other], max_points=1000)
    assert len(keep) <= 1000 + 1 and keep == sorted(set(keep))
    assert 54_321 in keep and 77_777 in keep and keep[-1] == len(series) - 1
    assert downsample(5, [series[:5]]) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_points"):
        downsample(10, [series], max_points=2)


def test_empty_history_renders_a_note(sim):
    w = alloc_weights(sim)
    page = render_html(vramkit.memory_snapshot(sim), title="t")
    assert "<svg" in page and "no recorded events" in page
    assert "<dd>24.0 MiB</dd>" in page  # peak allocated: what is allocated now
    del w


def test_bad_top_is_rejected(sim):
    with pytest.raises(ValueError, match="top"):
        render_html(vramkit.memory_snapshot(sim), title="t", top=-1)
