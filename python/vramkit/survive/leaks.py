"""Leak watch: memory that grows with every training iteration, and what holds it.

    with vramkit.watch_leaks(device="cpu", warmup=2) as watch:
        for batch in loader:
            loss = train_step(batch)    # ...opt.step(): each optimizer step is a watch step
            total_loss += loss          # the classic: keeps every step's autograd graph alive
    print(watch)                        # the report

**Steps.** A step is one training iteration. With torch imported, each ``step()`` of the first
torch optimizer that steps inside the block is a watch step (torch's global optimizer hook; a
second optimizer in the same iteration, as in a GAN, does not count again). ``watch.step()``
marks steps explicitly instead: from its first call on, optimizer steps no longer count, and
what they recorded before is dropped, so a loop calling both counts each iteration once.
``auto_step=False`` counts only explicit steps. A block that records no step, or too few to
judge, says so at exit with a ``LeakWatchWarning``.

After each step the watch collects garbage and records what is live: the allocated bytes of
vramkit's pool on `device` and, when torch is imported, the bytes of live torch storages
created inside the block on that device type (``vramkit.torch.track``'s meter, here with the
Python frame that created each storage), and the autograd graphs held by live tensors. After
`warmup` steps, growth in every step by more than `tolerance` is a leak; a cache that fills and
then stays flat is not.

**Autograd graphs** are followed by where they were created, not by tensor identity: at each
step the watch looks at the live tensors that torch operations inside the block returned (the
meter keeps weak references to them) and groups those holding a graph by the line that created
their storage. A line whose deepest graph gets deeper at every step is a graph carried across
steps: ``total_loss += loss`` and ``total_loss = total_loss + loss`` alike (the second makes a
new tensor each step and drops the old one), or an RNN state never detached. A line with one
more graph-holding tensor at every step is a list of losses (``losses.append(loss)``). Each is
reported with its line and the fix. Each step walks only the graph nodes created since the
step before: the figures measured for a graph are left on its root node (in the node's
``metadata`` dict, under "vramkit.leak_watch"), and later walks stop there.

The report also names the allocation sites of what is still live (vramkit's history stacks,
and the creating frame of each torch storage).
"""

from __future__ import annotations

import gc
import itertools
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._core.sizes import format_size
from .._core.text_html import TextAsHtml
from ..memory.api import memory_counters
from .leak_graphs import GraphWalk, SiteGraphs, chain_length, graph_meter

if TYPE_CHECKING:
    from ..torch.meters import _MeterMode
__all__ = ["GraphHolder", "LeakReport", "LeakWatch", "LeakWatchWarning", "watch_leaks"]

_EXPLICIT, _OPTIMIZER = "watch.step()", "optimizer steps"
_OUTSIDE = "(before the watch)"  # the site of storages created before the block
_tokens = itertools.count(1)


class LeakWatchWarning(RuntimeWarning):
    """A leak watch ended without enough steps to judge: nothing, or too little, was checked."""


@dataclass
class GraphHolder:
    """Live tensors created at one line whose autograd graphs grow across steps: one graph that
    gets deeper every step (count 1), or one more graph every step (count > 1)."""

    site: str  # where the storage was created (file:line (function))
    shape: tuple[int, ...]
    grad_fn: str
    nodes: int  # autograd nodes in the (deepest) graph held, leaf accumulators not counted
    steps: int  # steps the graph reaches back over (at least)
    count: int = 1  # live tensors from this site holding graphs of their own

    def __str__(self) -> str:
        shape = tuple(self.shape)
        where = "created before the watch" if self.site == _OUTSIDE else f"created at {self.site}"
        if self.count > 1:
            return (f"{self.count} tensors {shape} {where} each hold an autograd graph "
                    f"({self.grad_fn}, {self.nodes:,} nodes), one more every step: keep loss.item() or "
                    "loss.detach() instead")
        if self.grad_fn.startswith(("Add", "Sub", "Sum", "Mean")):
            advice = "accumulate loss.item() or loss.detach() instead"
        else:
            advice = "detach() the state you carry into the next step (e.g. hidden = hidden.detach())"
        return (f"tensor {shape} {where} holds an autograd graph of {self.nodes:,} nodes "
                f"({self.grad_fn} chained over {self.steps} steps): {advice}")


@dataclass
class LeakReport(TextAsHtml):
    device: str
    steps: int
    warmup: int
    pool_after: list[int] = field(default_factory=list)  # vramkit pool allocated after each measured step
    torch_after: list[int] = field(default_factory=list)  # live torch storage bytes after each measured step
    pool_sites: list[str] = field(default_factory=list)
    torch_sites: list[tuple[str, int]] = field(default_factory=list)  # (site, live bytes) created after warm-up
    graph_holders: list[GraphHolder] = field(default_factory=list)
    tolerance: int = 0
    graph_after: list[int] = field(default_factory=list)  # autograd nodes held by live tensors, each measured step
    step_source: str = ""  # "watch.step()", "optimizer steps", or "" (no step)

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
        if self.steps == 0:
            return (f"leak watch on {self.device}: no step was recorded, so nothing was checked: call watch.step() "
                    "at the end of each iteration, or step a torch optimizer inside the block")
        if measured < 2:
            return f"leak watch on {self.device}: {self.steps} steps, too few after {self.warmup} warm-up steps to judge"
        counted = f" ({_OPTIMIZER})" if self.step_source == _OPTIMIZER else ""
        if not self.leaking:
            return (f"leak watch on {self.device}: no steady growth over {measured} steps{counted} after "
                    f"{self.warmup} warm-up steps")
        if self.pool_leaking or self.torch_leaking:
            lines = [f"leak watch on {self.device}: memory grew in every one of {measured} steps{counted} after "
                     f"{self.warmup} warm-up steps"]
        else:
            lines = [f"leak watch on {self.device}: autograd graphs kept alive across steps (their saved tensors were "
                     "freed by backward(); the graph nodes still grow every step)"]
        for what, values, leaking in (("vramkit pool", self.pool_after, self.pool_leaking),
                                      ("torch tensors", self.torch_after, self.torch_leaking)):
            if leaking:
                per = (values[-1] - values[0]) / (len(values) - 1)
                lines.append(f"  {what}: +{format_size(per)} per step ({' -> '.join(format_size(v) for v in values[-6:])})")
        if self.pool_leaking and self.pool_sites:
            lines.append("  vramkit allocations live, by site:")
            lines += [f"    {s}" for s in self.pool_sites]
        if self.torch_leaking and self.torch_sites:
            lines.append("  torch storages created after the warm-up and still live, by site:")
            lines += [f"    {format_size(b):>12}  {s}" for s, b in self.torch_sites]
        if self.graph_holders and len(self.graph_after) > 1:
            lines.append("  autograd nodes held by live tensors: "
                         + " -> ".join(f"{n:,}" for n in self.graph_after[-6:]))
        for h in self.graph_holders:
            lines.append(f"  {h}")
        return "\n".join(lines)


class LeakWatch(TextAsHtml):
    """See the module docstring; made by ``watch_leaks``. ``steps`` counts the steps recorded,
    ``step_source`` says what marked them, ``graph_nodes_walked`` the graph nodes each measured
    step had to walk (the watch's own cost)."""

    def __init__(self, device: Any = "cpu", warmup: int = 2, tolerance: int = 0, collect: bool = True,
                 auto_step: bool = True) -> None:
        from .. import _C

        for name, value in (("warmup", warmup), ("tolerance", tolerance)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name, value in (("collect", collect), ("auto_step", auto_step)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self._C = _C
        self.device = _C.canonical_device(device)
        self.warmup, self.tolerance, self.collect, self.auto_step = warmup, tolerance, collect, auto_step
        self.step_source = ""
        self._meter: Any = None  # the graph meter (a LiveMeter subclass, see graph_meter) while torch is watched
        self._mode: _MeterMode | None = None
        self._was_recording = False
        self._state = "not started"
        self._hook = None  # the optimizer hook's handle while registered
        self._pacer: Any = None  # weak reference to the optimizer whose steps are watch steps
        self._clear()

    def _clear(self) -> None:
        """Forget every step recorded (explicit steps taking over from optimizer steps)."""
        self.steps = 0
        self._token = next(_tokens)  # graph figures left on nodes under another token are not used
        self._tagged: set[int] = set()  # sequence numbers of the graph roots measured at the last step
        self.graph_nodes_walked: list[int] = []  # graph nodes each measured step expanded (the watch's cost)
        self._pool_after: list[int] = []
        self._torch_after: list[int] = []
        self._graph_after: list[int] = []
        self._graph_series: list[dict[str, tuple[int, int]]] = []  # site -> (count, depth), each measured step
        self._graph_latest: dict[str, SiteGraphs] = {}
        self._warm: set[int] = set()

    def __enter__(self) -> "LeakWatch":
        C = self._C
        self._was_recording = bool(C.history_enabled(self.device))
        if not self._was_recording:
            C.history_enable(self.device, 100_000)
        if "torch" in sys.modules:
            from ..torch.meters import _MeterMode

            self._meter = graph_meter(self.device.split(":")[0])
            self._mode = _MeterMode(self._meter)
            self._mode.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's is unannotated
            if self.auto_step:
                self._hook = _register_optimizer_hook(self._on_optimizer_step)
        self._state = "active"
        return self

    def step(self) -> None:
        """Mark the end of one iteration: collect garbage and record what is live."""
        if self._state != "active":
            raise RuntimeError("LeakWatch.step() outside its `with` block")
        if self.step_source != _EXPLICIT:
            # Explicit steps take over: optimizer steps recorded so far were the same iterations.
            self._remove_hook()
            self._clear()
            self.step_source = _EXPLICIT
        self._record()

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state != "active" or self.step_source == _EXPLICIT:
            return
        pacer = self._pacer() if self._pacer is not None else None
        if pacer is None:
            self._pacer = weakref.ref(optimizer)
        elif pacer is not optimizer:
            return  # a second optimizer in the same iteration
        self.step_source = _OPTIMIZER
        self._record()

    def _record(self) -> None:
        if self.collect:
            gc.collect()
        self.steps += 1
        if self.steps > self.warmup:
            self._pool_after.append(memory_counters(self.device).allocated)
            self._torch_after.append(self._meter.current if self._meter is not None else 0)
            if self._meter is not None:
                self._measure_graphs()
        if self._meter is not None and self.steps == max(self.warmup, 1):
            self._warm = set(self._meter.site_of)  # storages live at the end of the warm-up

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self._report = self._build_report()
        finally:
            self._remove_hook()
            if self._mode is not None:
                self._mode.__exit__(exc_type, *exc)  # type: ignore[no-untyped-call]  # (as __enter__)
            if not self._was_recording:
                self._C.history_enable(self.device, 0)
            self._state = "finished"
        if exc_type is None:
            self._warn_if_unjudged()

    def _warn_if_unjudged(self) -> None:
        if self.steps == 0:
            how = "call watch.step() at the end of each iteration"
            if self.auto_step:
                how += " or step a torch optimizer inside the block (each of its steps is a watch step)"
            warnings.warn(f"vramkit.watch_leaks: no step was recorded, so nothing was checked: {how}",
                          LeakWatchWarning, stacklevel=3)
        elif self.steps - self.warmup < 2:
            recorded = "1 step was" if self.steps == 1 else f"{self.steps} steps were"
            warnings.warn(f"vramkit.watch_leaks: only {recorded} recorded; judging growth needs at least "
                          f"{self.warmup + 2} ({self.warmup} warm-up steps and 2 measured)", LeakWatchWarning,
                          stacklevel=3)

    def report(self) -> LeakReport:
        """The findings (after the block; inside it, as of now)."""
        if self._state == "active":
            return self._build_report()
        if self._state == "finished":
            return self._report
        return LeakReport(self.device, 0, self.warmup, tolerance=self.tolerance)

    def __str__(self) -> str:
        return str(self.report())

    def __repr__(self) -> str:
        counted = f" ({self.step_source})" if self.step_source else ""
        return f"LeakWatch(device={self.device!r}, warmup={self.warmup}, steps={self.steps}{counted}, {self._state})"

    def _build_report(self) -> LeakReport:
        r = LeakReport(self.device, self.steps, self.warmup, list(self._pool_after), list(self._torch_after),
                       tolerance=self.tolerance, graph_after=list(self._graph_after), step_source=self.step_source)
        if r.pool_leaking:
            from ..report.sites import allocation_sites, format_bytes

            sites = allocation_sites(self._C.memory_snapshot(self.device))[:5]
            r.pool_sites = [f"{format_bytes(s.live_at_peak):>12}  {s.label}" for s in sites if s.live_at_peak]
        if r.torch_leaking and self._meter is not None:
            by_site: dict[str, int] = {}
            for ptr, (site, n) in list(self._meter.site_of.items()):
                if ptr not in self._warm:
                    by_site[site] = by_site.get(site, 0) + n
            r.torch_sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:5]
        r.graph_holders = self._graph_holders()
        return r

    # ------------------------------------------------------------------------- autograd graphs

    def _site_of(self, tensor: Any) -> str:
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return _OUTSIDE
        site: str = self._meter.site_of.get(ptr, (_OUTSIDE, 0))[0]
        return site

    def _measure_graphs(self) -> None:
        """Record, for each creation site, how many live tensors hold a graph and how deep the
        deepest is; remember each graph's measurement on its root node for the next step."""
        roots: dict[int, tuple[Any, Any]] = {}  # id(grad_fn) -> (grad_fn, a tensor holding it)
        for t in self._meter.graph_tensors():
            roots.setdefault(id(t.grad_fn), (t.grad_fn, t))
        walk = GraphWalk(self._token, self.steps, self._tagged, set(roots))
        sites: dict[str, SiteGraphs] = {}
        root_site: dict[int, str] = {}
        total = 0
        for key, (fn, t) in roots.items():
            nodes, depth, oldest, reached = walk.measure(fn)
            total += nodes
            site = root_site[key] = self._site_of(t)
            s = sites.setdefault(site, SiteGraphs())
            s.count += 1
            if depth > s.depth or s.count == 1:
                s.depth, s.nodes, s.oldest = depth, nodes, oldest
                s.shape, s.grad_fn, s.contains = tuple(t.shape), type(fn).__name__, reached
        for s in sites.values():
            s.contains = {root_site[k] for k in s.contains if k in root_site}
        self._tagged = walk.tagged_now
        self._graph_after.append(total)
        self._graph_series.append({site: (s.count, s.depth) for site, s in sites.items()})
        self._graph_latest = sites
        self.graph_nodes_walked.append(walk.expanded)

    def _newest_graph_by_site(self) -> dict[str, Any]:
        """The grad_fn created last (highest sequence number) among live tensors, per site."""
        newest: dict[str, tuple[int, Any]] = {}
        for t in self._meter.graph_tensors():
            fn = t.grad_fn
            try:
                order = fn._sequence_nr()
            except (AttributeError, RuntimeError):
                order = 0
            site = self._site_of(t)
            if site not in newest or order > newest[site][0]:
                newest[site] = (order, fn)
        return {site: fn for site, (_, fn) in newest.items()}

    def _graph_holders(self) -> list[GraphHolder]:
        """Sites whose deepest graph got deeper at every measured step, or whose count of
        graph-holding tensors grew at every measured step."""
        series = self._graph_series
        if len(series) < 2:
            return []
        deepening, multiplying = set(), set()
        for site in set().union(*series):
            counts = [step.get(site, (0, 0))[0] for step in series]
            depths = [step.get(site, (0, 0))[1] for step in series]
            if all(b > a for a, b in zip(depths, depths[1:])):
                deepening.add(site)
            elif all(b > a for a, b in zip(counts, counts[1:])):
                multiplying.add(site)
        out = []
        newest = self._newest_graph_by_site() if deepening else {}
        for site in deepening:
            s = self._graph_latest[site]
            if (s.contains - {site}) & deepening:
                continue  # a loss computed from a carried state: the state's own line is the cause
            # The tensor measured last may be gone (rebinding); the newest one from its line holds the chain now.
            fn = newest.get(site)
            chain = chain_length(fn) if fn is not None and type(fn).__name__ == s.grad_fn else 0
            out.append(GraphHolder(site, s.shape, s.grad_fn, s.nodes, max(chain, self.steps - s.oldest + 1)))
        for site in multiplying:
            s = self._graph_latest[site]
            out.append(GraphHolder(site, s.shape, s.grad_fn, s.nodes, 1, s.count))
        out.sort(key=lambda h: (h.count > 1, -h.nodes, -h.count))
        return out[:5]


def _register_optimizer_hook(hook: Any) -> Any:
    """torch's global optimizer step post-hook (every optimizer's step() calls it); None if this
    torch has none."""
    try:
        import importlib

        register = importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook
    except (ImportError, AttributeError):
        return None
    return register(hook)


def watch_leaks(device: Any = "cpu", warmup: int = 2, tolerance: int = 0, collect: bool = True,
                auto_step: bool = True) -> LeakWatch:
    """A ``LeakWatch`` context manager. Steps are the first torch optimizer's steps, or
    ``.step()`` calls once the code makes one (``auto_step=False``: only those); after the
    block, ``print(watch)`` shows the report (``watch.report()`` returns it)."""
    return LeakWatch(device, warmup, tolerance, collect, auto_step)


