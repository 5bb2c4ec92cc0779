"""``vramkit.leaks``: the leak watch's public names, under the import path the docs show.
The code lives in ``vramkit.survive.leaks``."""

from __future__ import annotations

from .survive.leaks import GraphHolder, LeakReport, LeakWatch, LeakWatchWarning, watch_leaks

__all__ = ["GraphHolder", "LeakReport", "LeakWatch", "LeakWatchWarning", "watch_leaks"]
