"""PyTorch helpers: ``track()``, a meter of live tensor storage bytes (CPU included).

``with vramkit.torch.track() as m: ...`` counts the bytes of every tensor storage created by a
torch operation inside the block (through a ``TorchDispatchMode``) until the storage is freed
(a ``weakref.finalize`` on the storage). ``m.current`` is the live total, ``m.peak`` its maximum
since the start or the last ``m.reset_peak()``. Each storage counts once (by its data pointer),
whatever the number of views of it. Storages that existed before the block (parameters, inputs
created outside) are not counted, nor are outputs that alias an operation's inputs.

Note: this module is ``vramkit.torch``; inside the package ``import torch`` (absolute import)
is always the real PyTorch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from types import FrameType
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveMeter", "SiteMeter", "track", "use_as_cuda_allocator"]


def use_as_cuda_allocator() -> Any:
    """Make vramkit PyTorch's CUDA allocator for this process (before torch initializes CUDA):
    every CUDA tensor then comes from vramkit's cuda:N pool, so vramkit's counters, summaries,
    snapshots and OOM figures describe them. See vramkit.torch.allocator."""
    from .allocator import use_as_cuda_allocator as use

    return use()


def _storage(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        if t.is_sparse or t.device.type == "meta":
            return None
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(tree: Any) -> list[Any]:
    """The tensors in an ATen operation's arguments or result: ATen's schemas nest tensors only in
    tuples, lists and the kwargs dict, so this is pytree's flatten without its generality (and at a
    fraction of its cost, which is most of the meter's overhead per operation)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found


class LiveMeter:
    """Bytes of live tensor storages created while the meter was tracking."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[int, object]] = {}
        self._lock = threading.Lock()

    def reset_peak(self) -> None:
        """Set ``peak`` to ``current``."""
        with self._lock:
            self.peak = self.current

    @property
    def num_storages(self) -> int:
        return len(self._live)

    def _free(self, ptr: int, token: object) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is not None and entry[1] is token:
                del self._live[ptr]
                self.current -= entry[0]

    def _add(self, st: torch.UntypedStorage) -> None:
        ptr = st.data_ptr()
        n = st.nbytes()
        if ptr == 0 or n == 0:
            return
        with self._lock:
            if ptr in self._live:
                return
            token = object()
            self._live[ptr] = (n, token)
            self.current += n
            if self.current > self.peak:
                self.peak = self.current
        fin = weakref.finalize(st, self._free, ptr, token)
        fin.atexit = False

    def _record(self, args: Any, kwargs: Any, out: Any) -> None:
        new = [s for s in map(_storage, _tensors(out)) if s is not None]
        if not new:
            return
        seen = {s.data_ptr() for s in map(_storage, _tensors((args, kwargs))) if s is not None}
        for st in new:
            if st.data_ptr() not in seen:
                self._add(st)

    def __repr__(self) -> str:
        return f"LiveMeter(current={self.current:,} B, peak={self.peak:,} B, storages={len(self._live)})"


# vramkit's own frames are skipped: the package directory, above torch/.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_site() -> str:
    """file:line (function) of the innermost frame that is neither torch's nor vramkit's."""
    f: FrameType | None = sys._getframe(2)
    torch_dir = os.sep + "torch" + os.sep
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_HERE) and torch_dir not in name and not name.startswith("<"):
            return f"{os.path.basename(name)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "(unknown)"


class SiteMeter(LiveMeter):
    """A LiveMeter for storages on one device type ("cpu", "cuda") that also records the Python
    frame creating each storage: ``site_of`` (pointer -> (site, bytes)), ``live_by_site``, and
    ``at_peak`` (live bytes by site when the peak was last raised). Used by the leak watch and
    the pytest plugin to name where memory came from."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.site_of: dict[int, tuple[str, int]] = {}
        self.live_by_site: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}

    def _add(self, st: torch.UntypedStorage) -> None:
        if st.device.type != self.device_type:
            return
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr == 0 or n == 0 or ptr in self._live:
            return
        site = _caller_site()
        peak = self.peak
        super()._add(st)
        with self._lock:
            self.site_of[ptr] = (site, n)
            self.live_by_site[site] = self.live_by_site.get(site, 0) + n
            if self.current > peak:
                self.at_peak = dict(self.live_by_site)

    def _free(self, ptr: int, token: object) -> None:
        super()._free(ptr, token)
        with self._lock:
            entry = self.site_of.pop(ptr, None) if ptr not in self._live else None
            if entry is not None:
                self.live_by_site[entry[0]] -= entry[1]


class _MeterMode(TorchDispatchMode):
    def __init__(self, meter: LiveMeter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.meter._record(args, kwargs, out)
        return out


@contextlib.contextmanager
def track(meter: LiveMeter | None = None) -> Iterator[LiveMeter]:
    """Count live tensor storage bytes created inside the block; yields the ``LiveMeter``.

    The meter keeps counting frees after the block ends (``current`` goes down as the tensors
    created inside die), but no longer counts new tensors.
    """
    m = meter if meter is not None else LiveMeter()
    with _MeterMode(m):
        yield m
