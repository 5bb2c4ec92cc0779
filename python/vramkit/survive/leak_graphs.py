"""The leak watch's autograd graphs (``leaks.py``): which live tensors hold graphs, and how
deep and how old each graph is, measured one step at a time. ``GraphWalk`` walks a step's
graphs and leaves its figures on each root node (in the node's ``metadata``, under ``TAG``),
so a later walk stops there and a graph that grows by k nodes a step costs about k nodes to
follow; ``graph_meter`` keeps weak references to the tensors the block's operations return,
the candidates, without scanning the garbage collector's objects."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SiteGraphs", "GraphWalk", "TAG", "WALK_CAP", "chain_length", "graph_meter"]

TAG = "vramkit.leak_watch"  # the key of the measurement a watch leaves in a graph node's metadata
WALK_CAP = 200_000  # graph nodes one step expands at most (a first walk of a huge graph stays bounded)


@dataclass
class SiteGraphs:
    """The graph-holding tensors of one creation site at one step."""

    count: int = 0  # distinct graph roots
    depth: int = 0  # of the deepest graph
    nodes: int = 0  # of the deepest graph
    oldest: int = 0  # the earliest step the deepest graph reaches back to
    shape: tuple[int, ...] = ()
    grad_fn: str = ""
    # other sites whose graphs the deepest one reaches (graph-root ids while measuring, then site names)
    contains: set[Any] = field(default_factory=set)


class GraphWalk:
    """One step's walks over autograd graphs. A walk stops at a node that carries this watch's
    measurement (made at an earlier step, or earlier in this one), so a graph that grows by k
    nodes a step costs about k nodes a step to follow, not its whole size."""

    def __init__(self, token: int, step: int, tagged_before: set[int], root_ids: set[int]) -> None:
        self.token, self.step, self.tagged_before, self.root_ids = token, step, tagged_before, root_ids
        self.tagged_now: set[int] = set()
        self.expanded = 0

    def _known(self, node: Any) -> tuple[int, int, int] | None:
        """(nodes, depth, oldest step) measured earlier on this node, or None."""
        try:
            seq = node._sequence_nr()
        except (AttributeError, RuntimeError):
            seq = None  # no sequence numbers in this torch: look at every node's metadata
        if seq is not None and seq not in self.tagged_before and seq not in self.tagged_now:
            return None
        try:
            tag = node.metadata.get(TAG)
        except (AttributeError, RuntimeError):
            return None
        return tag[1:] if isinstance(tag, tuple) and tag[0] == self.token else None

    def measure(self, root: Any) -> tuple[int, int, int, set[int]]:
        """(nodes, depth, oldest step, ids of other roots reached) of the graph below `root`,
        which is then tagged with its figures."""
        depth_of: dict[int, tuple[int, int]] = {}  # id(node) -> (depth, oldest step)
        keep = []  # the node wrappers stay alive during the walk, so their ids stay unique
        reached: set[int] = set()
        nodes = 0
        stack: list[tuple[Any, Any]] = [(root, None)]
        while stack:
            node, kids = stack.pop()
            k = id(node)
            if kids is not None:  # every child is measured: this node is one deeper than the deepest
                below = [depth_of.get(id(c), (0, self.step)) for c in kids]
                depth_of[k] = (1 + max((d for d, _ in below), default=0),
                               min((o for _, o in below), default=self.step))
                continue
            if k in depth_of:
                continue
            keep.append(node)
            if k in self.root_ids and node is not root:
                reached.add(k)
            known = self._known(node)
            if known is not None:
                nodes += known[0]
                depth_of[k] = (known[1], known[2])
                continue
            if self.expanded >= WALK_CAP:
                depth_of[k] = (1, self.step)
                continue
            self.expanded += 1
            if type(node).__name__ != "AccumulateGrad":  # leaf accumulators are shared by every step's graph
                nodes += 1
            kids = [c for c, _ in getattr(node, "next_functions", ()) if c is not None]
            stack.append((node, kids))
            stack.extend((c, None) for c in kids if id(c) not in depth_of)
        depth, oldest = depth_of[id(root)]
        self._tag(root, nodes, depth, oldest)
        return nodes, depth, oldest, reached

    def _tag(self, root: Any, nodes: int, depth: int, oldest: int) -> None:
        try:
            root.metadata[TAG] = (self.token, nodes, depth, oldest)
            self.tagged_now.add(root._sequence_nr())
        except (AttributeError, RuntimeError, TypeError):
            pass


def chain_length(fn: Any, cap: int = 100_000) -> int:
    """Length of the chain of nodes of fn's type through their inputs (AddBackward0 over AddBackward0
    for `total += loss`: one per step), capped."""
    kind, depth, node, keep = type(fn).__name__, 0, fn, []
    while node is not None and type(node).__name__ == kind and depth < cap:
        keep.append(node)
        depth += 1
        nexts = [n for n, _ in node.next_functions if n is not None and type(n).__name__ == kind]
        node = nexts[0] if nexts else None
    return depth


def graph_meter(device_type: str) -> Any:
    """A SiteMeter (storage bytes and sites on `device_type`) that also keeps weak references to
    the tensors the operations inside the block return, on any device: the candidates for
    holding autograd graphs, found without scanning the garbage collector's objects."""
    from ..torch.meters import SiteMeter, _tensors

    class GraphMeter(SiteMeter):
        def __init__(self) -> None:
            super().__init__(device_type)
            self.tensors: Any = weakref.WeakValueDictionary()  # id -> tensor; an entry goes when its tensor dies

        def _record(self, args: Any, kwargs: Any, out: Any) -> None:
            super()._record(args, kwargs, out)
            for t in _tensors(out):
                try:
                    self.tensors[id(t)] = t
                except TypeError:  # a tensor subclass without weak references
                    continue

        def graph_tensors(self) -> list[Any]:
            """Live tensors from operations inside the block that hold an autograd graph (those
            whose attributes cannot be read, e.g. some nested tensors, are skipped)."""
            out = []
            for t in list(self.tensors.values()):
                try:
                    if t.grad_fn is not None:
                        tuple(t.shape)
                        out.append(t)
                except (RuntimeError, NotImplementedError, ReferenceError):
                    continue
            return out

    return GraphMeter()
