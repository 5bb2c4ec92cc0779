"""Leak watch: memory that grows with every training iteration, and what holds it.

    with vramkit.watch_leaks(device="cpu", warmup=2) as watch:
        for batch in loader:
            loss = train_step(batch)
            total_loss += loss          # the classic: keeps every step's autograd graph alive
            watch.step()                # one iteration done
    print(watch.report())

After each ``step()`` the watch collects garbage and records what is live: the allocated bytes
of vramkit's pool on `device` and, when torch is imported, the bytes of live torch storages
created inside the block on that device type (``vramkit.torch.track``'s meter, here with the
Python frame that created each storage). After `warmup` steps, growth in every step by more
than `tolerance` is a leak; a cache that fills and then stays flat is not.

The report names the allocation sites of what is still live (vramkit's history stacks, and the
creating frame of each torch storage), and, for torch, the tensors that keep an autograd graph
alive across steps: a tensor whose graph reaches back through many iterations, such as
``total_loss`` after ``total_loss += loss``, is listed with the line that created it and the
fix (``loss.item()`` or ``loss.detach()``).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GraphHolder", "LeakReport", "LeakWatch", "watch_leaks"]


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class GraphHolder:
    """A live tensor whose autograd graph spans iterations."""

    site: str  # where its storage was created (file:line (function))
    shape: tuple[int, ...]
    grad_fn: str
    nodes: int  # autograd nodes reachable from it (capped)
    steps: int  # iterations its graph reaches back over (nodes of its grad_fn type in a chain)

    def __str__(self) -> str:
        return (f"tensor {tuple(self.shape)} created at {self.site} holds an autograd graph of {self.nodes:,} nodes "
                f"({self.grad_fn} chained over {self.steps} steps): accumulate loss.item() or loss.detach() instead")


@dataclass
class LeakReport:
    device: str
    steps: int
    warmup: int
    pool_after: list[int] = field(default_factory=list)  # vramkit pool allocated after each measured step
    torch_after: list[int] = field(default_factory=list)  # live torch storage bytes after each measured step
    pool_sites: list[str] = field(default_factory=list)
    torch_sites: list[tuple[str, int]] = field(default_factory=list)  # (site, live bytes) created after warm-up
    graph_holders: list[GraphHolder] = field(default_factory=list)
    tolerance: int = 0

    @staticmethod
    def _growing(values: list[int], tolerance: int) -> bool:
        steps = [b - a for a, b in zip(values, values[1:])]
        return bool(steps) and all(d > tolerance for d in steps)

    @property
    def pool_leaking(self) -> bool:
        return self._growing(self.pool_after, self.tolerance)

    @property
    def torch_leaking(self) -> bool:
        return self._growing(self.torch_after, self.tolerance)

    @property
    def leaking(self) -> bool:
        return self.pool_leaking or self.torch_leaking or bool(self.graph_holders)

    def __str__(self) -> str:
        measured = max(0, self.steps - self.warmup)
        if measured < 2:
            return f"leak watch on {self.device}: {self.steps} steps, too few after {self.warmup} warm-up steps to judge"
        if not self.leaking:
            return f"leak watch on {self.device}: no steady growth over {measured} steps after {self.warmup} warm-up steps"
        if self.pool_leaking or self.torch_leaking:
            lines = [f"leak watch on {self.device}: memory grew in every one of {measured} steps after {self.warmup} "
                     "warm-up steps"]
        else:
            lines = [f"leak watch on {self.device}: autograd graphs kept alive across steps (their saved tensors were "
                     "freed by backward(); the graph nodes still grow every step)"]
        for what, values, leaking in (("vramkit pool", self.pool_after, self.pool_leaking),
                                      ("torch tensors", self.torch_after, self.torch_leaking)):
            if leaking:
                per = (values[-1] - values[0]) / (len(values) - 1)
                lines.append(f"  {what}: +{_fmt(per)} per step ({' -> '.join(_fmt(v) for v in values[-6:])})")
        if self.pool_leaking and self.pool_sites:
            lines.append("  vramkit allocations live, by site:")
            lines += [f"    {s}" for s in self.pool_sites]
        if self.torch_leaking and self.torch_sites:
            lines.append("  torch storages created after the warm-up and still live, by site:")
            lines += [f"    {_fmt(b):>12}  {s}" for s, b in self.torch_sites]
        for h in self.graph_holders:
            lines.append(f"  {h}")
        return "\n".join(lines)


class LeakWatch:
    """See the module docstring; made by ``watch_leaks``."""

    def __init__(self, device: Any = "cpu", warmup: int = 2, tolerance: int = 0, collect: bool = True) -> None:
        from . import _C

        for name, value in (("warmup", warmup), ("tolerance", tolerance)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self._C = _C
        self.device = _C.canonical_device(device)
        self.warmup, self.tolerance, self.collect = warmup, tolerance, collect
        self.steps = 0
        self._pool_after: list[int] = []
        self._torch_after: list[int] = []
        self._meter = None
        self._mode = None
        self._was_recording = False
        self._active = False

    def __enter__(self) -> "LeakWatch":
        C = self._C
        self._was_recording = bool(C.history_enabled(self.device))
        if not self._was_recording:
            C.history_enable(self.device, 100_000)
        if "torch" in sys.modules:
            from .torch import SiteMeter, _MeterMode

            self._meter = SiteMeter(self.device.split(":")[0])
            self._mode = _MeterMode(self._meter)
            self._mode.__enter__()
        self._active = True
        return self

    def step(self) -> None:
        """Mark the end of one iteration: collect garbage and record what is live."""
        if not self._active:
            raise RuntimeError("LeakWatch.step() outside its `with` block")
        if self.collect:
            gc.collect()
        self.steps += 1
        if self.steps > self.warmup:
            self._pool_after.append(self._C.memory_counters(self.device)[0])
            self._torch_after.append(self._meter.current if self._meter is not None else 0)
        if self._meter is not None and self.steps == max(self.warmup, 1):
            self._warm = set(self._meter.site_of)  # storages live at the end of the warm-up
            # Tensors holding an autograd graph now; a leak is one whose graph keeps growing.
            self._graphs_then = _graph_sizes()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._report = self._build_report()
        finally:
            if self._mode is not None:
                self._mode.__exit__(*exc)
            if not self._was_recording:
                self._C.history_enable(self.device, 0)
            self._active = False

    def report(self) -> LeakReport:
        """The findings (after the block; inside it, as of now)."""
        return self._build_report() if self._active else self._report

    def _build_report(self) -> LeakReport:
        r = LeakReport(self.device, self.steps, self.warmup, list(self._pool_after), list(self._torch_after),
                       tolerance=self.tolerance)
        if r.pool_leaking:
            from .sites import allocation_sites, format_bytes

            sites = allocation_sites(self._C.memory_snapshot(self.device))[:5]
            r.pool_sites = [f"{format_bytes(s.live_at_peak):>12}  {s.label}" for s in sites if s.live_at_peak]
        if r.torch_leaking and self._meter is not None:
            warm = getattr(self, "_warm", set())
            by_site: dict[str, int] = {}
            for ptr, (site, n) in list(self._meter.site_of.items()):
                if ptr not in warm:
                    by_site[site] = by_site.get(site, 0) + n
            r.torch_sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:5]
        if self._meter is not None and self.steps - self.warmup >= 2 and getattr(self, "_graphs_then", None):
            r.graph_holders = _graph_holders(self._meter, self._graphs_then, self.steps - max(self.warmup, 1))
        return r


def watch_leaks(device: Any = "cpu", warmup: int = 2, tolerance: int = 0, collect: bool = True) -> LeakWatch:
    """A ``LeakWatch`` context manager: call ``.step()`` once per iteration, then ``.report()``."""
    return LeakWatch(device, warmup, tolerance, collect)


def _chain(fn: Any, kind: str, cap: int = 100_000) -> tuple[int, int]:
    """(nodes reachable from fn, longest chain of `kind` nodes through first inputs), capped."""
    seen, stack, nodes = set(), [fn], 0
    while stack and nodes < cap:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes += 1
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    depth, node = 0, fn
    while node is not None and type(node).__name__ == kind and depth < cap:
        depth += 1
        nexts = [n for n, _ in node.next_functions if n is not None and type(n).__name__ == kind]
        node = nexts[0] if nexts else None
    return nodes, depth


def _live_graph_tensors() -> list:
    """Live tensors with a grad_fn (found with gc.get_objects); tensors whose attributes cannot
    be read (e.g. some nested tensors) are skipped."""
    import warnings

    import torch

    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    out = []
    for t in tensors:
        try:
            if t.grad_fn is not None:
                tuple(t.shape)
                out.append(t)
        except (RuntimeError, NotImplementedError, ReferenceError):
            continue
    return out


def _graph_sizes() -> dict[int, tuple[Any, int]]:
    """id(tensor) -> (weak reference, autograd nodes reachable), for live graph-holding tensors."""
    import weakref

    out = {}
    for t in _live_graph_tensors():
        try:
            out[id(t)] = (weakref.ref(t), _chain(t.grad_fn, type(t.grad_fn).__name__)[0])
        except TypeError:
            continue
    return out


def _graph_holders(meter: Any, then: dict[int, tuple[Any, int]], measured: int) -> list[GraphHolder]:
    """Tensors that held an autograd graph at the end of the warm-up and whose graph has grown
    since: what `total_loss += loss` builds (one AddBackward0 more per step). A graph that is
    merely large (a per-timestep loss summed inside one step) does not grow across steps."""
    out = []
    for ref, nodes_then in then.values():
        obj = ref()
        if obj is None or obj.grad_fn is None:
            continue
        fn = obj.grad_fn
        nodes, depth = _chain(fn, type(fn).__name__)
        if nodes <= nodes_then:
            continue
        try:
            ptr = obj.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            ptr = 0
        site = meter.site_of.get(ptr, ("(not created inside the watch)", 0))[0]
        out.append(GraphHolder(site, tuple(obj.shape), type(fn).__name__, nodes, depth))
    out.sort(key=lambda h: -h.nodes)
    return out[:5]
