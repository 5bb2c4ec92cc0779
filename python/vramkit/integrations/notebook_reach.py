"""``Reach``: the memory that some Python objects keep alive, for ``%vram_free``.

A walk from the objects through what they refer to, counting the storage behind each NumPy
array, torch tensor and vramkit ``Buffer`` it meets, once per storage (a view, a second
reference or a ``torch.from_numpy`` alias of the same memory counts once). The walk follows
containers, instance attributes, exceptions with their tracebacks and the local variables of
the tracebacks' frames, tensors' gradients and the tensors their autograd graphs saved.

It stops at modules, classes, functions and code: a function reaches its module's globals,
and through them everything, so following it would charge every holder with the whole
program. Memory reachable only through a closure or a generator is therefore not counted.
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import sys
import types
import weakref
from collections.abc import Iterable
from typing import Any, Callable

import numpy as np

from .. import _C

__all__ = ["Reach", "WALK_LIMIT"]

WALK_LIMIT = 200_000  # objects one walk looks at, at most: a list of a million floats stays cheap

StorageKey = tuple[str, int]  # (device, address of the first byte)

# Objects with nothing to count inside (skipped without being remembered as visited).
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice)

# Objects the walk does not enter: see the module docstring.
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
           types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, types.WrapperDescriptorType,
           types.MethodWrapperType, types.MethodDescriptorType, types.GetSetDescriptorType,
           types.MemberDescriptorType, property, classmethod, staticmethod, weakref.ReferenceType,
           functools.partialmethod)


class Reach:
    """Storages reachable from the objects given to ``add``; ``nbytes`` is their total.

    ``skip`` holds ids of objects never entered (the notebook's namespace, the shell), so that
    a holder is not charged with everything those reach. ``truncated`` says the walk stopped
    at ``limit`` objects: the figures are then a lower bound.
    """

    def __init__(self, skip: Iterable[int] = (), limit: int = WALK_LIMIT) -> None:
        self.storages: dict[StorageKey, int] = {}
        self.truncated = False
        self._skip = frozenset(skip)
        self._limit = limit
        self._steps = 0

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def by_device(self) -> dict[str, int]:
        """Bytes per device, largest first."""
        totals: dict[str, int] = collections.defaultdict(int)
        for (device, _), n in self.storages.items():
            totals[device] += n
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def add(self, *roots: Any) -> Reach:
        """Walk from `roots`; returns self. Storages already counted are not counted again."""
        stack: list[Any] = list(roots)
        seen: set[int] = set()
        # Objects made during the walk (a frame's locals, a saved tensor unpacked from a graph)
        # are kept until it ends: an id must not be reused by another object while it is in
        # `seen`. Dropped at the end, so a Reach never keeps memory alive itself.
        keep: list[Any] = []
        while stack:
            obj = stack.pop()
            if isinstance(obj, _ATOMS) or id(obj) in seen or id(obj) in self._skip:
                continue
            if self._steps >= self._limit:
                self.truncated = True
                break
            self._steps += 1
            seen.add(id(obj))
            keep.append(obj)
            try:
                self._visit(obj, stack.append)
            except (AttributeError, RuntimeError, TypeError, ValueError, NotImplementedError):
                # The user's objects can run code here (a __class__ property answering
                # isinstance, a tensor subclass's accessors): one that fails holds nothing.
                continue
        keep.clear()
        return self

    def _count(self, device: str, address: int, nbytes: int) -> None:
        if address and nbytes > 0:
            key = (device, address)
            self.storages[key] = max(nbytes, self.storages.get(key, 0))

    def _visit(self, obj: Any, push: Callable[[Any], None]) -> None:
        """Count what `obj` is, or push what it refers to."""
        if isinstance(obj, np.ndarray):
            self._array(obj, push)
        elif isinstance(obj, _C.Buffer):
            self._count(obj.device, obj.ptr, obj.nbytes)
        elif _is_tensor(obj):
            self._tensor(obj, push)
        elif _is_graph_node(obj):
            _graph_node(obj, push)
        elif isinstance(obj, types.TracebackType):
            push(obj.tb_frame)
            push(obj.tb_next)
        elif isinstance(obj, types.FrameType):
            # Its locals only: its globals are a module's (or the notebook's namespace), and the
            # frames it was called from are in the same traceback.
            push(obj.f_locals)
        elif isinstance(obj, BaseException):
            for ref in (obj.args, obj.__traceback__, obj.__cause__, obj.__context__, getattr(obj, "__dict__", None)):
                push(ref)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                push(key)
                push(value)
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            for item in obj:
                push(item)
        elif isinstance(obj, types.MethodType):
            push(obj.__self__)
        elif not isinstance(obj, _OPAQUE):
            for ref in gc.get_referents(obj):
                push(ref)

    def _array(self, a: np.ndarray[Any, Any], push: Callable[[Any], None]) -> None:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base  # a view keeps its whole base alive, not only the part it shows
        base = root.base
        if base is None or not (isinstance(base, _C.Buffer) or _is_tensor(base)):
            self._count("cpu", root.__array_interface__["data"][0], root.nbytes)
        if base is not None:
            push(base)  # a vramkit Buffer or a torch tensor counts as itself (one key per storage)
        if root.dtype.hasobject:
            for item in itertools.islice(root.flat, self._limit):
                push(item)

    def _tensor(self, t: Any, push: Callable[[Any], None]) -> None:
        try:
            if t.device.type != "meta" and not t.is_sparse:
                st = t.untyped_storage()
                self._count(str(st.device), st.data_ptr(), st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            pass  # a tensor subclass without a storage of its own (a wrapper): its __dict__ follows
        try:
            # A leaf's gradient lives on it; a non-leaf's graph holds what backward will need
            # (reading .grad of a non-leaf only warns and gives None).
            push(t.grad if t.is_leaf else t.grad_fn)
        except (RuntimeError, AttributeError):
            pass
        push(getattr(t, "__dict__", None))


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: without torch there are no tensors
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_graph_node(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.autograd.graph.Node)


_saved_by_type: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes through which a graph node type shows what it saved for backward
    (looked up once per type: dir() is slow next to the walk)."""
    names = _saved_by_type.get(node_type)
    if names is None:
        every = dir(node_type)
        names = tuple([n for n in every if n.startswith("_saved_")]
                      + [n for n in ("saved_tensors", "variable") if n in every])
        _saved_by_type[node_type] = names
    return names


def _graph_node(node: Any, push: Callable[[Any], None]) -> None:
    for nxt, _ in getattr(node, "next_functions", ()):
        push(nxt)
    for name in _saved_names(type(node)):
        try:
            push(getattr(node, name))
        except (RuntimeError, AttributeError):
            continue  # freed by a backward already (torch raises), or not set on this node
    push(getattr(node, "__dict__", None))  # a custom autograd Function's ctx attributes
