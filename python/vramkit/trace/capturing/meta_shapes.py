"""A meta capture's op outputs from a cache of their shapes, strides and dtypes.

On ``meta`` an op computes nothing: it only decides its outputs' shapes, strides and dtypes
from its arguments'. Many of those decisions are made in Python (``torch._refs`` and the meta
registrations of pointwise ops, FSDP2's custom ops' fake kernels), and in a 70B model of 80
identical layers the same op meets the same argument shapes thousands of times: those kernels
were half of a capture's time. So an op's outputs are remembered by the op and its arguments'
metadata, and the next call with the same metadata gets fresh tensors of those shapes
(``aten::empty_strided``, one C++ call) instead of running the kernel.

Only where that cannot change the capture:
- every tensor argument is a plain meta tensor (no subclass such as a DTensor, whose dispatch
  runs its own ops; no CPU tensor, whose value may matter);
- the op writes into none of its arguments and its schema says no output aliases an input;
- the first run's outputs were fresh storages each: not sharing a storage with an input or with
  each other, at offset 0, exactly as large as their shapes and strides need (else that call is
  never cached: FSDP2's ``all_gather_copy_in`` returns a view of its other output);
- the outputs are tensors, or ints, floats, bools and None beside them (flash attention's
  sequence lengths).
The capture records a cached output's storage as it records any op's (a new storage is an
allocation), and ``tests/unit/test_trace_meta_shapes.py`` holds traces with and without the
cache equal event for event.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ShapeCache", "SHAPES", "tensors_in"]

MAX_ENTRIES = 1 << 16  # cleared when full: a model's distinct (op, shapes) pairs are a few thousand

_PLAIN = (torch.Tensor, nn.Parameter)
_LEAVES = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_OUT_LEAVES = (int, float, bool, type(None))
_MISS = object()
_UNCACHEABLE = object()


class ShapeCache:
    """Op outputs by (op, metadata of its arguments); see the module docstring."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.entries: dict[tuple[Any, ...], Any] = {}
        self.ops_ok: dict[Any, bool] = {}  # op -> whether its schema allows caching
        self.hits = self.misses = 0

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`func(*args, **kwargs)`, or its outputs rebuilt from the cache."""
        ok = self.ops_ok.get(func)
        if ok is None:
            ok = self.ops_ok[func] = _schema_allows(func)
        key = _key(func, args, kwargs) if ok else None
        if key is None:
            return func(*args, **kwargs)
        template = self.entries.get(key, _MISS)
        if template is _UNCACHEABLE:
            return func(*args, **kwargs)
        if template is not _MISS:
            self.hits += 1
            return _rebuild(template)
        out = func(*args, **kwargs)
        self.misses += 1
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        # (Whether outputs are fresh is decided per key: on meta it depends on nothing else.)
        template = _template(out, args, kwargs)
        self.entries[key] = _UNCACHEABLE if template is None else template
        return out


def _schema_allows(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return all(r.alias_info is None for r in schema.returns)


def _key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable description of the arguments' metadata, or None where one is not plain meta
    data (a subclass, a CPU tensor, a generator, an object)."""
    # (the default dtype too: an integer tensor divided by a number comes out in it)
    parts: list[Any] = [func, torch.get_default_dtype()]
    stack: list[Any] = [args, tuple(sorted(kwargs.items()))]
    while stack:
        o = stack.pop()
        t = type(o)
        if t in _PLAIN:
            if o.device.type != "meta":
                return None
            parts.append((tuple(o.shape), o.stride(), o.dtype, o.storage_offset()))
        elif t is tuple or t is list:
            parts.append((t, len(o)))
            stack.extend(o)
        elif t in _LEAVES:
            parts.append((t, o))  # (the type: True and 1 are equal keys otherwise)
        else:
            return None
    return tuple(parts)


def _template(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What `_rebuild` needs to make `out` again, or None where `out` is not fresh storages."""
    items = list(out) if type(out) in (tuple, list) else [out]
    seen: set[int] = set()
    for o in tensors_in((args, kwargs)):
        seen.add(o.untyped_storage()._cdata)
    parts: list[Any] = []
    for o in items:
        if type(o) in _OUT_LEAVES:
            parts.append(("value", o))
            continue
        if type(o) is not torch.Tensor or o.device.type != "meta" or o.layout != torch.strided:
            return None
        storage = o.untyped_storage()
        if storage._cdata in seen or o.storage_offset() != 0 or o.is_conj() or o.is_neg():
            return None
        seen.add(storage._cdata)
        shape, stride = tuple(o.shape), o.stride()
        need = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * o.element_size()
        if storage.nbytes() != need:
            return None
        parts.append(("tensor", shape, stride, o.dtype))
    return (type(out) if type(out) in (tuple, list) else None, tuple(parts))


def _rebuild(template: tuple[Any, ...]) -> Any:
    container, parts = template
    made = [_EMPTY(p[1], p[2], dtype=p[3], device=_META) if p[0] == "tensor" else p[1] for p in parts]
    if container is None:
        return made[0]
    return container(made)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tensors, lists, tuples, dicts of them): what
    ``tree_flatten`` finds among them, in the same order, at a fraction of its cost, which in a
    capture of 64,000 ops was a fifth of the capture's time.

    A loop, not a recursive closure: a closure that calls itself is a reference cycle, which
    would keep the list, and so every tensor in it, alive until Python's cycle collector runs,
    and the capture would record their storages as freed late."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
    return out


_EMPTY = torch.ops.aten.empty_strided.default
_META = torch.device("meta")
SHAPES = ShapeCache()  # one per process: an op's output metadata does not depend on the capture
