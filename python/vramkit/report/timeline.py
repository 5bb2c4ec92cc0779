"""An offline HTML timeline of a memory snapshot: allocated and reserved bytes over time, the peak,
and what was alive at the peak.

PyTorch's own HTML views load their viewer from a CDN, which fails on the offline clusters where
memory problems are usually debugged. This page is one self-contained file: inline CSS and SVG,
no scripts, no fonts or images from anywhere (the peak marker and the curves carry SVG <title>
tooltips instead of scripted hover). For interactive views, open the pickle at pytorch.org/memory_viz.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._core.files import write_atomically
from .sites import Frame, LiveAllocation, MemoryReplay, allocation_sites, format_bytes, replay, user_frames

__all__ = ["downsample", "render_html", "write_html"]

MAX_POINTS = 2000  # plotted points per curve, whatever the trace length

_W, _H = 960, 360  # SVG size
_ML, _MR, _MT, _MB = 80, 20, 20, 50  # margins: left (y labels), right, top, bottom (x labels)


def _e(value: Any) -> str:
    # Lone surrogates (a non-UTF-8 file name as Python decodes it, or such a name in a snapshot)
    # cannot be written as UTF-8: show them as \udcxx escapes instead of failing the page.
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return html.escape(text, quote=True)


def downsample(n: int, series: Sequence[Sequence[int]], max_points: int = MAX_POINTS) -> list[int]:
    """Indices of at most about `max_points` of `n` points that keep every series' extremes.

    The points are cut into buckets; each bucket keeps its first point and the points where each
    series has its minimum and maximum, so peaks and troughs survive (a plain stride would skip
    a short-lived peak). The last point is always kept.
    """
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    if n <= max_points:
        return list(range(n))
    per_bucket = 1 + 2 * len(series)
    buckets = max(1, max_points // per_bucket)
    keep = {n - 1}
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        keep.add(lo)
        for s in series:
            chunk = range(lo, hi)
            keep.add(min(chunk, key=s.__getitem__))
            keep.add(max(chunk, key=s.__getitem__))
    return sorted(keep)


def _nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks."""
    raw = span / ticks if span > 0 else 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _byte_ticks(top: int) -> tuple[list[int], int, str]:
    """Y ticks in a binary unit: (tick values in bytes, unit size, unit name)."""
    unit, name = 1, "B"
    for u, nm in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= u:
            unit, name = u, nm
            break
    step = _nice_step(top / unit) * unit
    ticks = [int(i * step) for i in range(math.ceil(top / step) + 1)]  # the last tick is at or above top
    return ticks, unit, name


def _stack_text(frames: Sequence[Frame], depth: int = 4) -> str:
    user = user_frames(frames)
    return " \u2190 ".join(f.short() for f in user[:depth]) or "(no Python stack)"


def _svg(r: MemoryReplay) -> str:
    n = len(r.allocated)
    t0 = r.time_us[0]
    xs = [(t - t0) / 1e6 for t in r.time_us] if r.has_time else [float(i) for i in range(n)]
    x_span = (xs[-1] - xs[0]) or 1.0
    top = max(max(r.reserved), max(r.allocated), 1)
    ticks, unit, unit_name = _byte_ticks(top)
    y_top = max(top, ticks[-1], 1)
    pw, ph = _W - _ML - _MR, _H - _MT - _MB

    def px(x: float) -> float:
        return _ML + (x - xs[0]) / x_span * pw

    def py(y: int) -> float:
        return _MT + ph - y / y_top * ph

    keep = downsample(n, [r.allocated, r.reserved])
    if r.peak_index not in keep:  # downsample keeps maxima, but make the marked point certain
        keep = sorted(set(keep) | {r.peak_index})

    def step_path(values: Sequence[int]) -> str:
        # Memory changes in steps: hold each value until the next event.
        parts = [f"M{px(xs[keep[0]]):.1f},{py(values[keep[0]]):.1f}"]
        for i in keep[1:]:
            parts.append(f"H{px(xs[i]):.1f}V{py(values[i]):.1f}")
        return "".join(parts)

    out = [(f'<svg class="plot" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
            f'aria-label="allocated and reserved bytes over time">')]
    for v in ticks:
        y = py(v)
        out.append(f'<line class="grid" x1="{_ML}" y1="{y:.1f}" x2="{_W - _MR}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{_ML - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{_e(f"{v / unit:g} {unit_name}")}</text>')
    step = _nice_step(x_span)
    k = math.ceil(xs[0] / step)
    while k * step <= xs[-1] + 1e-12:
        x = px(k * step)
        label = f"{k * step:g}" if r.has_time else f"{int(k * step)}"
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{_MT}" x2="{x:.1f}" y2="{_MT + ph}"/>'
                   f'<text class="tick" x="{x:.1f}" y="{_MT + ph + 16}" text-anchor="middle">{_e(label)}</text>')
        k += 1
    x_label = "time since the first recorded event (s)" if r.has_time else "event index"
    out.append(f'<text class="axis" x="{_ML + pw / 2:.1f}" y="{_H - 10}" text-anchor="middle">{_e(x_label)}</text>')
    out.append(f'<text class="axis" transform="translate(16,{_MT + ph / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle">bytes</text>')
    out.append(f'<rect class="frame" x="{_ML}" y="{_MT}" width="{pw}" height="{ph}"/>')
    alloc_path = step_path(r.allocated)
    out.append(f'<path class="area" d="{alloc_path}H{px(xs[keep[-1]]):.1f}V{py(0):.1f}H{px(xs[keep[0]]):.1f}Z"/>')
    out.append(f'<path class="reserved" d="{step_path(r.reserved)}"><title>reserved</title></path>')
    out.append(f'<path class="allocated" d="{alloc_path}"><title>allocated</title></path>')
    peak_x, peak_y = px(xs[r.peak_index]), py(r.peak_allocated)
    when = f"{xs[r.peak_index]:.3f} s" if r.has_time else f"event {r.peak_index}"
    out.append(f'<line class="peak" x1="{peak_x:.1f}" y1="{_MT}" x2="{peak_x:.1f}" y2="{_MT + ph}"/>'
               f'<circle class="peak" cx="{peak_x:.1f}" cy="{peak_y:.1f}" r="5">'
               f'<title>{_e(f"peak allocated {format_bytes(r.peak_allocated)} at {when}")}</title></circle>')
    anchor = "end" if peak_x > _ML + pw * 0.7 else "start"
    dx = -8 if anchor == "end" else 8
    out.append(f'<text class="peaklabel" x="{peak_x + dx:.1f}" y="{max(peak_y - 8, _MT + 12):.1f}" '
               f'text-anchor="{anchor}">{_e("peak " + format_bytes(r.peak_allocated))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _live_table(live: Sequence[LiveAllocation], top: int) -> str:
    if not live:
        return "<p>Nothing was allocated at the peak.</p>"
    rows = []
    for rank, a in enumerate(live[:top], 1):
        frame = a.frame or (a.frames[0] if a.frames else None)
        site = frame.short() if frame else a.label
        note = " (before history)" if a.before_history else ""
        rows.append(f"<tr><td>{rank}</td><td class=num>{_e(format_bytes(a.size))}</td>"
                    f"<td><code>{a.address:#x}</code></td><td>{_e(site + note)}</td>"
                    f"<td class=stack>{_e(_stack_text(a.frames))}</td></tr>")
    more = len(live) - min(top, len(live))
    tail = f"<p>{more} smaller live allocations not shown.</p>" if more > 0 else ""
    return ("<table><thead><tr><th>#</th><th>size</th><th>address</th><th>allocated at</th>"
            "<th>stack (innermost first)</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>" + tail)


def _sites_table(snapshot: Mapping[str, Any], r: MemoryReplay, top: int) -> str:
    sites = allocation_sites(snapshot, r.device, replayed=r)
    if not sites:
        return "<p>No allocations were recorded.</p>"
    rows = [f"<tr><td>{rank}</td><td class=num>{_e(format_bytes(s.live_at_peak))}</td>"
            f"<td class=num>{_e(format_bytes(s.total_bytes))}</td><td class=num>{s.count}</td>"
            f"<td>{_e(s.label)}</td><td class=stack>{_e(_stack_text(s.frames))}</td></tr>"
            for rank, s in enumerate(sites[:top], 1)]
    return ("<table><thead><tr><th>#</th><th>live at peak</th><th>total allocated</th><th>count</th>"
            "<th>site</th><th>stack (innermost first)</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 12px} h2{font-size:16px;margin:24px 0 8px}
.figures{display:flex;flex-wrap:wrap;gap:8px 24px;margin:0 0 12px;padding:0}
.figures div{min-width:150px} .figures dt{color:#666;font-size:12px} .figures dd{margin:0;font-size:18px}
svg.plot{max-width:100%;height:auto;border:1px solid #ddd;background:#fff}
.grid{stroke:#eee} .frame{fill:none;stroke:#bbb} .tick{font-size:11px;fill:#555} .axis{font-size:12px;fill:#333}
.area{fill:#4c78a8;fill-opacity:.18;stroke:none} .allocated{fill:none;stroke:#4c78a8;stroke-width:1.5}
.reserved{fill:none;stroke:#e45756;stroke-width:1.5;stroke-dasharray:5 3}
line.peak{stroke:#222;stroke-dasharray:2 3} circle.peak{fill:#222} .peaklabel{font-size:12px;font-weight:600}
.legend span{display:inline-block;margin-right:18px} .swatch{display:inline-block;width:18px;height:3px;
vertical-align:middle;margin-right:6px} .note{color:#666}
table{border-collapse:collapse;width:100%} th,td{border-bottom:1px solid #eee;padding:4px 8px;text-align:left;
vertical-align:top} td.num{text-align:right;white-space:nowrap} td.stack{font-size:12px;color:#555}
code{font-size:12px}
"""


def render_html(snapshot: Mapping[str, Any], *, title: str, top: int = 10, device: int | None = None) -> str:
    """A self-contained HTML page plotting a snapshot's allocated and reserved bytes over time.

    device: which trace to plot (index into device_traces); None means the snapshot's own device.
    top: how many rows the tables of live allocations and allocation sites show.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be a non-negative int, got {top!r}")
    r = replay(snapshot, device)
    name = snapshot.get("vramkit_device", f"device {r.device}")
    duration = (r.time_us[-1] - r.time_us[0]) / 1e6 if r.has_time else None
    figures = [
        ("device", str(name)),
        ("peak allocated", format_bytes(r.peak_allocated)),
        ("peak reserved", format_bytes(r.peak_reserved)),
        ("allocated now", format_bytes(r.allocated[-1])),
        ("reserved now", format_bytes(r.reserved[-1])),
        ("events recorded", f"{r.num_events:,}"),
        ("allocations recorded", f"{r.num_allocs:,}"),
        ("time span", f"{duration:.3f} s" if duration is not None else "n/a"),
    ]
    notes = []
    if r.allocated[0] or r.reserved[0]:
        notes.append(f"When the recorded history begins, {format_bytes(r.allocated[0])} was already allocated "
                     f"and {format_bytes(r.reserved[0])} reserved (recording started late, or the ring buffer "
                     f"dropped older events); the curves start there.")
    if not r.num_events:
        notes.append("The snapshot holds no recorded events: call vramkit.record_memory_history() before the "
                     "code to observe.")
    when = (f"{(r.time_us[r.peak_index] - r.time_us[0]) / 1e6:.3f} s after the first event" if r.has_time
            else f"after event {r.peak_index}")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        '<dl class="figures">' + "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in figures) + "</dl>",
        "".join(f'<p class="note">{_e(n)}</p>' for n in notes),
        ('<p class="legend"><span><i class="swatch" style="background:#4c78a8"></i>allocated</span>'
         '<span><i class="swatch" style="background:#e45756"></i>reserved (segments held from the device)</span>'
         '<span>\u25cf peak allocated</span></p>'),
        _svg(r),
        f"<h2>Largest live allocations at the peak ({_e(format_bytes(r.peak_allocated))}, {_e(when)})</h2>",
        _live_table(r.live_at_peak, top),
        "<h2>Largest allocation sites (by bytes live at the peak, then total bytes)</h2>",
        _sites_table(snapshot, r, top),
        ('<p class="note">For interactive views, drop the snapshot pickle onto pytorch.org/memory_viz '
         "(the page reads the file locally; nothing is uploaded).</p>"),
        "</body></html>",
    ]
    return "\n".join(parts)


def write_html(path: str, snapshot: Mapping[str, Any], *, title: str, top: int = 10,
               device: int | None = None) -> str:
    """Write render_html() to `path` (UTF-8); returns the path. The page is written to a
    temporary name and renamed, so a failure leaves no partial file."""
    page = render_html(snapshot, title=title, top=top, device=device)
    return write_atomically(path, page.encode("utf-8", "backslashreplace"))
