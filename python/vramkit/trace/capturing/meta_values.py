"""Values for the small tensors of a meta capture, so data-dependent Python runs as on a GPU.

A meta tensor has a shape but no values, so ``.item()``, ``bool(t)``, ``t.tolist()`` and ops
whose output shape depends on values (``nonzero``, boolean-mask indexing) fail on it. Training
code does this on small tensors that do not depend on the weights: Hugging Face's mask
utilities ask ``(packed_sequence_mask[:, -1] == 0).all()`` of position ids built with
``arange``, losses count labels that are not ``-100``, models check that an attention mask is
all ones. Tracing such a model under ``FakeTensorMode`` instead makes the libraries take their
tracing paths (Hugging Face then builds an explicit packed-sequence mask that a GPU run never
builds), so the prediction would no longer be of the step a GPU runs.

So a meta capture keeps a CPU copy of every small tensor (at most ``LIMIT_BYTES``) whose
inputs all have values: factories (``arange``, ``ones``, ``full``, ``randint``), tensors made
from Python data (``torch.tensor([...])``, which dispatches no op: a function mode sees it),
then any op on such tensors. A random op draws from a seed of a private generator, with the CPU
generator's state restored after it (and a step's own ``generator=`` replaced by the private
one), so the user's generators are untouched; its values are random but within the op's range,
as a real batch's are. An op that writes into a tensor with a value either updates the copy (when all its inputs
have values) or drops the copies of everything sharing that storage. Outputs larger than the
limit, and anything computed from the weights, have no value: a data-dependent question about
one raises ``DataDependentError`` saying which op's output it was and what a capture needs.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..sharding.dtensor_local import NOT_HANDLED, foreach_on_shards
from .meta_shapes import SHAPES, tensors_in

__all__ = ["DataDependentError", "MetaValues", "LIMIT_BYTES", "tensors_in"]

LIMIT_BYTES = 16 << 20  # per tensor: ids, positions and masks of real batches fit; activations do not

_SCALAR = torch.ops.aten._local_scalar_dense.default  # what .item(), bool(), int(), tolist() reach


class DataDependentError(RuntimeError):
    """A meta capture met a question about a tensor's values that it cannot answer."""


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class MetaValues:
    """The CPU values of a capture's small meta tensors (see the module docstring)."""

    def __init__(self, limit_bytes: int = LIMIT_BYTES, origin_of: Callable[[torch.Tensor], str] | None = None) -> None:
        self.limit = limit_bytes
        self.origin_of = origin_of  # the op that made a tensor (the capture's record), for messages
        # id(meta tensor) -> (weak ref to it, its CPU value). The weak ref both tells a reused id
        # apart and drops the entry when the tensor dies.
        self.values: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self.by_storage: dict[int, set[int]] = {}  # meta storage -> ids of tensors with values on it
        self.generator = torch.Generator().manual_seed(0)
        self.computed = 0  # ops run on CPU copies (for tests and the guide's cost figure)

    # ---------------------------------------------------------------- lookup

    def value(self, t: Any) -> torch.Tensor | None:
        if not isinstance(t, torch.Tensor):
            return None
        if t.device.type != "meta":
            return t  # a real tensor in a meta capture (a CPU scalar, a step count) is its own value
        entry = self.values.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def _set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        key = id(t)
        storage = _storage_key(t)

        def forget(_: Any, key: int = key, storage: int | None = storage) -> None:
            entry = self.values.get(key)
            if entry is not None and entry[0]() is None:
                del self.values[key]
            if storage is not None:
                ids = self.by_storage.get(storage)
                if ids is not None:
                    ids.discard(key)
                    if not ids:
                        del self.by_storage[storage]

        self.values[key] = (weakref.ref(t, forget), value)
        if storage is not None:
            self.by_storage.setdefault(storage, set()).add(key)

    def _drop_storage(self, t: torch.Tensor) -> None:
        storage = _storage_key(t)
        if storage is None:
            return
        for key in self.by_storage.pop(storage, set()):
            self.values.pop(key, None)

    @contextlib.contextmanager
    def tolist(self) -> Iterator[None]:
        """``Tensor.tolist`` reads storage without an op (the dispatch mode never sees it) and
        refuses meta; for the capture's duration, a meta tensor with a value answers from it."""
        original = torch.Tensor.tolist
        values = self

        def tolist(t: torch.Tensor) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                value = values.value(t)
                if value is None:
                    raise values._error(t, "its values (.tolist())")
                return value.tolist()
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.Tensor.tolist = original  # type: ignore[method-assign]

    @contextlib.contextmanager
    def python_data(self) -> Iterator[None]:
        """``torch.tensor([...])`` and ``torch.as_tensor(list)`` build a meta tensor without any
        op the dispatch mode sees; a function mode gives them the value of their data."""
        with _PythonData(self):
            yield

    # ---------------------------------------------------------------- dispatch

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            tensors: list[torch.Tensor] | None = None) -> Any:
        """Run `func` on the meta arguments, computing values alongside where it can; answer
        data-dependent ops from values. `tensors`: ``tensors_in((args, kwargs))`` if the caller
        has it already."""
        name = func._schema.name
        metas = [t for t in (tensors_in((args, kwargs)) if tensors is None else tensors) if t.device.type == "meta"]
        known = all(self.value(t) is not None for t in metas)
        if func is _SCALAR:
            (t,) = metas or [args[0]]
            value = self.value(t)
            if value is None:
                raise self._error(t, "its value (.item(), bool(), int() or .tolist())")
            return value.item()
        mutated = _mutated(func, args, kwargs)
        try:
            # Outputs that will have no values: their shapes may come from the cache (meta_shapes).
            out = SHAPES.run(func, args, kwargs) if metas and not known and not mutated else func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            unknown = next((t for t in metas if self.value(t) is None), None)
            if not metas or mutated:
                raise  # nothing to answer from, or an in-place op: its result must be its input
            if unknown is not None:
                if _is_data_dependent(exc):
                    raise self._error(unknown, f"the values of its elements ({name} on meta)") from exc
                raise
            return self._from_values(func, args, kwargs)
        outs = [t for t in tensors_in(out) if t.device.type == "meta"]
        small = all(t.numel() * t.element_size() <= self.limit for t in outs + mutated)
        if known and small and (outs or mutated):
            try:
                cpu_out = self._compute(func, args, kwargs)
            except Exception:  # noqa: BLE001 -- a value we cannot compute is a value we do not have
                cpu_out = _FAILED
            if cpu_out is not _FAILED:
                # An in-place op has updated the CPU copies it wrote; its other outputs (fresh
                # tensors, as native_batch_norm's statistics) get theirs.
                self._attach(out, cpu_out, skip=mutated)
                return out
        for t in mutated:
            self._drop_storage(t)
        return out

    def _from_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op meta cannot run (nonzero, masked_select, unique: output shapes from values;
        .cpu() of a meta tensor), computed from the inputs' values: outputs meant for another
        device are the CPU results themselves; meta outputs get the CPU results' shapes, and
        their values when small enough."""
        cpu_out = self._compute(func, args, kwargs)
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != "meta":
            return cpu_out  # x.cpu(), x.to("cpu"): real data, as the step asked
        out = tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                       if isinstance(v, torch.Tensor) else v, cpu_out)
        self._attach(out, cpu_out)
        return out

    def _compute(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def to_cpu(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return self.value(v)
            if isinstance(v, torch.device) and v.type == "meta":
                return torch.device("cpu")
            if isinstance(v, torch.Generator):
                return self.generator  # the step's own generator is not advanced by a copy
            return v

        cpu_args, cpu_kwargs = tree_map(to_cpu, (args, kwargs))
        if cpu_kwargs.get("device") == "meta":
            cpu_kwargs["device"] = torch.device("cpu")
        self.computed += 1
        if torch.Tag.nondeterministic_seeded in func.tags and not any(
                isinstance(v, torch.Generator) for v in tree_flatten((cpu_args, cpu_kwargs))[0]):
            # Random ops without a generator argument draw from the CPU default generator: its
            # state is saved and restored around a draw from a seed of our own (only the CPU
            # generator: torch.manual_seed would reseed the user's CUDA generators too).
            seed = int(torch.randint(1 << 62, (1,), generator=self.generator))
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                return func(*cpu_args, **cpu_kwargs)
        return func(*cpu_args, **cpu_kwargs)

    def _attach(self, out: Any, cpu_out: Any, skip: Sequence[torch.Tensor] = ()) -> None:
        metas, _ = tree_flatten(out)
        cpus, _ = tree_flatten(cpu_out)
        if len(metas) != len(cpus):
            return
        for m, c in zip(metas, cpus):
            if (isinstance(m, torch.Tensor) and isinstance(c, torch.Tensor) and m.device.type == "meta"
                    and m.shape == c.shape and m.numel() * m.element_size() <= self.limit
                    and not any(m is w for w in skip)):
                self._set(m, c)

    def _error(self, t: torch.Tensor, what: str) -> DataDependentError:
        made_by = self.origin_of(t) if self.origin_of is not None else ""
        size = t.numel() * t.element_size()
        why = (f"it is {size:,} bytes, above the {self.limit >> 20} MiB up to which a meta capture keeps values"
               if size > self.limit else
               "it was computed from tensors without values (the weights, or a tensor made without data)")
        return DataDependentError(
            f"the step needs {what} of a meta tensor of shape {tuple(t.shape)} made by {made_by or 'an op'}, and {why}. "
            "A meta capture knows the values of small tensors made from Python data, ranges and random inputs "
            "(ids, positions, masks), not of activations; capture a scaled-down copy of the model with "
            "device='cpu', or make the step's shapes independent of those values (see the guide: "
            "docs/will-it-fit.md, 'Models with data-dependent shapes')")


_FAILED = object()
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)


class _PythonData(TorchFunctionMode):
    def __init__(self, values: MetaValues) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a graph dynamo traces: its tensors have no values
            return func(*args, **kwargs)
        if getattr(func, "__name__", "").startswith("_foreach_"):  # the optimizer on FSDP2's DTensors
            out = foreach_on_shards(func, args, kwargs)
            if out is not NOT_HANDLED:
                return out
        out = func(*args, **kwargs)
        if (func in _FROM_DATA and isinstance(out, torch.Tensor) and out.device.type == "meta" and args
                and not isinstance(args[0], torch.Tensor)
                and out.numel() * out.element_size() <= self.values.limit):
            try:
                with _disable_current_modes():  # the copy is not the step's: no capture sees it
                    value = func(*args, **{**kwargs, "device": "cpu", "dtype": out.dtype})
                    value = value.detach() if isinstance(value, torch.Tensor) else value
            except Exception:  # noqa: BLE001 -- data a CPU tensor cannot hold: no value
                return out
            if isinstance(value, torch.Tensor) and value.shape == out.shape:
                self.values._set(out, value)
        return out


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The meta tensors `func` writes into (in-place and out= arguments), from its schema."""
    out: list[torch.Tensor] = []
    schema = func._schema
    if not schema.is_mutable:
        return out
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                out.append(t)
    return out


def _is_data_dependent(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("meta tensors", "data-dependent", "Meta' backend", "meta backend",
                                   "data dependent"))
