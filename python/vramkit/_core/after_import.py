"""A post-import hook: ``AfterImport("torch", callback)`` on ``sys.meta_path`` calls
``callback(module)`` once ``import torch`` has executed torch's ``__init__``, before the
importing code can use it. ``vramkit run`` arms torch's memory recording this way, and the OOM
post-mortem its out-of-memory observer, without importing torch for scripts that never do."""

from __future__ import annotations

import importlib.abc
import importlib.util
import threading
from typing import Any

__all__ = ["AfterImport"]


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` once `import NAME` has executed the module (a post-import hook)."""

    def __init__(self, name: str, callback: Any) -> None:
        self.name, self.callback = name, callback
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)  # the finders after this one
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            callback(module)

        # this loader instance serves this one module
        loader.exec_module = exec_module  # type: ignore[method-assign]  # a post-import hook, on purpose
        return spec
