"""``Timeline``: the offline HTML timeline of a memory snapshot (``vramkit.report.timeline``),
shown inline in a notebook.

The page is the one ``vramkit run`` writes, placed in an ``<iframe srcdoc=...>``: its style
sheet sets ``body``, ``table`` and ``h1`` rules that would otherwise restyle the whole notebook,
and a frame keeps them to itself. The page has no scripts, so the frame is sandboxed.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from typing import Any

from .._core.devices import DeviceLike
from .._core.files import write_atomically
from ..memory.api import memory_snapshot
from ..report.timeline import render_html

__all__ = ["Timeline"]


class Timeline:
    """A snapshot's timeline (allocated and reserved bytes over time, the peak, what was live at
    it and the largest allocation sites) that a notebook displays inline.

    snapshot: a ``memory_snapshot()`` dict (or a PyTorch ``_snapshot()``, or a prediction's
    from ``vramkit.trace.as_snapshot``); it needs a recorded history
    (``vramkit.record_memory_history()``) for the curves. title, top, device: as
    ``vramkit.report.timeline.render_html``. height: the frame's height in pixels.
    """

    def __init__(self, snapshot: Mapping[str, Any], *, title: str = "vramkit memory timeline", top: int = 10,
                 device: int | None = None, height: int = 900) -> None:
        if isinstance(height, bool) or not isinstance(height, int) or height <= 0:
            raise ValueError(f"height must be a positive number of pixels, got {height!r}")
        self.title = title
        self.height = height
        # Rendered now: the page is all that is kept, not the snapshot (which can be large).
        self.page = render_html(snapshot, title=title, top=top, device=device)

    @classmethod
    def of(cls, device: DeviceLike = None, *, title: str | None = None, top: int = 10,
           height: int = 900) -> Timeline:
        """The timeline of a vramkit device's recorded history, as of now."""
        snapshot = memory_snapshot(device)
        name = snapshot.get("vramkit_device", device)
        return cls(snapshot, title=title or f"vramkit memory timeline, {name}", top=top, height=height)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the page to `path` as a standalone HTML file; returns the path."""
        return write_atomically(path, self.page.encode("utf-8", "backslashreplace"))

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.page, quote=True)}" sandbox="" title="{html.escape(self.title)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd"></iframe>')

    def __repr__(self) -> str:
        return f"<Timeline {self.title!r}: display it in a notebook, or save(path) for a standalone page>"
