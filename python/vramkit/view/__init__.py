"""View: ``vramkit view FILE``, a local web page to explore a huge memory history.

The server (``serve``) answers a page that draws the active-memory timeline, zooms and pans,
and asks the history object only for what the current view shows, so histories of millions of
events stay fast in the browser. Everything runs on this machine; the page reaches no network.
"""

from .history import History
from .loading import load_history
from .server import ViewServer, serve

__all__ = ["History", "ViewServer", "load_history", "serve"]
