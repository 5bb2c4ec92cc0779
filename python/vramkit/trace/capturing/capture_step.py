"""Capture a PyTorch training step's storage allocations and frees (``vramkit.trace.capture``).

How: a ``TorchDispatchMode`` sees every ATen operation below autograd, forward and backward
and optimizer alike. An output whose storage was not live before is an allocation; a
``weakref.finalize`` on the storage records its free when the last tensor using it dies. A
storage is identified by its ``StorageImpl`` (``untyped_storage()._cdata``), not by its data
pointer, so ``meta`` tensors (pointer 0) are told apart and meta and cpu captures agree.

Where: global module forward hooks keep a stack of module paths (``layers.3.attn``) for the
forward; after each module's forward its new autograd nodes are labelled with its path, and in
the backward the engine's current node gives the path back. Phases: ``backward`` while the
autograd engine runs, ``optimizer`` between the global optimizer step hooks, ``forward``
from the first module call of a step, ``setup`` while a builder builds.

What: after the run, storages are classified by what holds them: parameters and buffers of the
modules seen, their ``.grad`` (at each optimizer step and at the end of each step), optimizer
state; the rest by phase: a forward allocation still live when the backward starts is a saved
activation, anything else allocated in a step a temporary, anything made while building an
input.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from .autocast_meta import emulate_autocast
from .capture_hooks import deferred_init, fsdp_buffers, storage_resizes
from ..sharding.cpu_offload import offload_on_meta, tag_host
from .cuda_choices import CudaChoices, install as install_choices
from ..sharding.fake_dist import COLLECTIVE_NAMESPACES, check_rank, collectives_by_step, note_collective, one_rank, \
    store_wait_hint
from .meta_values import DataDependentError, MetaValues, tensors_in
from .module_tags import LABEL, install_hooks, restore_blocks, tag_all, tag_args
from ..formats.file_format import ALLOC, CATEGORIES, FREE, PHASE, PHASES, STEP, Trace
from ..sharding.sharding_changes import ShardingChange, sharding_changed, strategy_of

__all__ = ["CaptureError", "capture"]

_SETUP, _FORWARD, _BACKWARD, _OPTIMIZER, _OTHER = range(len(PHASES))
_CAT = {name: i for i, name in enumerate(CATEGORIES)}
PROGRESS_SECONDS = 5.0  # between the progress lines of a long capture
OPS_BETWEEN_CLOCK_READS = 1024  # (a capture runs tens of thousands of ops a second)
# One capture at a time: the hooks and the dispatch mode are process-wide.
_ACTIVE = threading.Lock()


class CaptureError(RuntimeError):
    """The step could not be captured (it raised, or its inputs are on another device); the
    original exception, if any, is the ``__cause__``."""


def _storage_of(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.layout != torch.strided:
        return None
    if is_traceable_wrapper_subclass(t):
        return None  # a DTensor's own "storage" has its global size; its local tensor holds the memory
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Recorder:
    """The events of one capture, and the live storages they refer to."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[tuple[int, int, int]] = []  # (kind, id, size)
        self.initial: list[int] = []  # ids of storages that existed before the capture
        self.size: list[int] = []
        self.dtype: list[str] = []
        self.module: list[str] = []
        self.op: list[str] = []
        self.phase_of: list[int] = []
        self.category: list[int] = []
        self.live: dict[int, tuple[int, Any]] = {}  # StorageImpl address -> (id, finalizer)
        self.open = True
        self.phase = -1
        self.step = -1
        self.backward_seen: set[int] = set()  # steps whose backward has started
        self.first_backward: dict[int, int] = {}  # step -> event index of its first backward event
        self.step_of: list[int] = []
        self.module_stack: list[str] = []
        self.names: dict[int, str] = {}  # id(module) -> qualified name
        self.roots: list[weakref.ref[nn.Module]] = []
        self.optimizers: list[weakref.ref[Any]] = []
        self.offloaded: weakref.WeakSet[Any] = weakref.WeakSet()  # FSDP2 params with CPUOffloadPolicy (cpu_offload)
        self.offload_everything = False  # every optimizer parameter offloaded: its step runs on the CPU
        self.in_optimizer = 0
        self.lock = threading.RLock()
        self.checkpoint_blocks: bool | int = False  # True: every repeated block; k: the first k
        self.checkpoint_total = self.checkpointed_count = 0
        self.autocast: torch.dtype | None = None  # capture(autocast=...): the forward's autocast dtype
        self.autocast_device = "cuda"
        self.region: Any = None
        self.checkpointed: list[nn.Module] = []
        self.saved_forwards: list[Any] = []
        self.thread = threading.get_ident()  # the hooks act only for the capturing thread
        self.collectives: list[tuple[str, int, int]] | None = None  # a sharded capture's group log
        self.collective_marks: list[int] = []  # its length at the start of each step
        self.checkpointed_path = ""

    # ---------------------------------------------------------------- phases

    def current_phase(self) -> int:
        if torch._C._current_graph_task_id() != -1:
            return _BACKWARD
        if self.in_optimizer:
            return _OPTIMIZER
        if self.phase == _FORWARD and self.step in self.first_backward:
            return _OTHER  # after the backward, before the optimizer: clipping, logging
        return self.phase

    def _mark(self) -> int:
        phase = self.current_phase()
        if phase != self._last_marked:
            self.events.append((PHASE, phase, 0))
            self._last_marked = phase
        if phase == _BACKWARD and self.step not in self.first_backward:
            self.first_backward[self.step] = len(self.events)
        return phase

    _last_marked = -1

    # ---------------------------------------------------------------- storages

    def module_path(self, phase: int) -> str:
        if phase == _BACKWARD:
            node = torch._C._current_autograd_node()
            if node is not None:
                try:
                    # torch declares Node.metadata a method; on the engine's nodes it is a dict property
                    meta: dict[str, Any] = node.metadata  # type: ignore[assignment]
                    label: str = meta.get(LABEL, "")
                    return label
                except (RuntimeError, AttributeError):
                    return ""
            return ""
        return self.module_stack[-1] if self.module_stack else ""

    def new_storage(self, st: Any, dtype: torch.dtype | str, op: str, initial: bool = False) -> int:
        key = st._cdata
        n = int(st.nbytes())
        with self.lock:
            i = len(self.size)
            phase = _SETUP if initial else self._mark()
            self.size.append(n)
            self.dtype.append(str(dtype).replace("torch.", ""))
            self.module.append("" if initial else self.module_path(phase))
            self.op.append(op)
            self.phase_of.append(phase)
            self.step_of.append(self.step)
            # A CPU tensor in a meta capture (a host-side scalar such as foreach Adam's
            # torch.tensor(1.0, device="cpu")) is host memory on a GPU run too.
            host = self.device.type == "meta" and st.device.type == "cpu"
            self.category.append(_CAT["host"] if host else _CAT["unknown"])
            if initial:
                self.initial.append(i)
            else:
                self.events.append((ALLOC, i, n))
            fin = weakref.finalize(st, self._freed, key, i)
            fin.atexit = False
            self.live[key] = (i, fin)
        return i

    def _freed(self, key: int, i: int) -> None:
        with self.lock:
            if not self.open:
                return
            entry = self.live.get(key)
            if entry is not None and entry[0] == i:
                del self.live[key]
            self._mark()
            self.events.append((FREE, i, self.size[i]))

    def counts(self, st: Any) -> bool:
        """Whether a storage is memory of this capture: on its device, or a CPU storage in a
        meta capture (host memory on a GPU run). A meta tensor in a CPU capture (a script that
        builds its model on meta before ``to_empty``) holds nothing."""
        return bool(st.device.type == self.device.type or (self.device.type == "meta" and st.device.type == "cpu"))

    def resized(self, st: Any, dtype: str) -> None:
        """`st` was resized in place (``UntypedStorage.resize_``: FSDP frees and re-creates its
        unsharded parameters this way): its old allocation is freed and, if it is not empty
        now, a new one made, as the allocator does."""
        with self.lock:
            entry = self.live.pop(st._cdata, None)
            if entry is not None:
                i, fin = entry
                fin.detach()
                dtype = self.dtype[i]
                self._mark()
                self.events.append((FREE, i, self.size[i]))
        if int(st.nbytes()):
            i = self.new_storage(st, dtype, "aten::resize_ (storage)")
            if self.collectives is not None:  # a sharded capture: FSDP's gathered parameters
                self.category[i] = _CAT["unsharded_parameter"]

    def id_of(self, st: Any) -> int | None:
        entry = self.live.get(st._cdata)
        return entry[0] if entry is not None else None

    def see(self, t: Any, category: str | None = None, module: str | None = None, op: str = "") -> None:
        """Register a tensor's storage if new (as one that existed before the capture, when not
        inside a step) and set its category and module path if given."""
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:  # DTensor: its local shard
                self.see(getattr(t, name), category, module, op)
            return
        st = _storage_of(t)
        if st is None or int(st.nbytes()) == 0:
            return
        i = self.id_of(st)
        if i is None:
            i = self.new_storage(st, t.dtype, op or "(pre-existing)", initial=True)
        if category is not None:
            self.category[i] = _CAT[category]
        if module is not None and not self.module[i]:
            self.module[i] = module

    def close(self) -> None:
        with self.lock:
            self.open = False
            for _, fin in self.live.values():
                fin.detach()
            self.live.clear()


class _CaptureMode(TorchDispatchMode):
    def __init__(self, rec: _Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.rec = rec
        self.values = MetaValues(origin_of=self._origin) if rec.device.type == "meta" else None
        self.progress: Callable[[str], None] | None = None
        self.ops = 0
        self.stage = ""
        self.started = self.last_line = time.monotonic()

    def _still_running(self) -> None:
        """A line every PROGRESS_SECONDS of a long capture: how far it is, and where."""
        now = time.monotonic()
        if self.progress is None or now - self.last_line < PROGRESS_SECONDS:
            return
        self.last_line = now
        where = self.rec.module_stack[-1] if self.rec.module_stack else ""
        self.progress(f"  capture running for {now - self.started:.0f} s: {self.ops:,} ops, in {self.stage}"
                      f"{f', at {where}' if where else ''}")

    def _origin(self, t: torch.Tensor) -> str:
        st = _storage_of(t)
        i = self.rec.id_of(st) if st is not None else None
        return self.rec.op[i] if i is not None else ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        rec = self.rec
        self.ops += 1
        if not self.ops % OPS_BETWEEN_CLOCK_READS:
            self._still_running()
        if rec.collectives is not None and func.namespace in COLLECTIVE_NAMESPACES:
            note_collective(func, args, kwargs, rec.collectives)
        # (on meta the arguments' tensors are needed before the op, and found once for both uses)
        args_in = tensors_in((args, kwargs)) if self.values is not None else None
        out = func(*args, **kwargs) if self.values is None else self.values.run(func, args, kwargs, args_in)
        outs = _plain(tensors_in(out))
        fresh = [(t, st) for t in outs if (st := _storage_of(t)) is not None and rec.counts(st)]
        if not fresh:
            return out
        ins = _plain(tensors_in((args, kwargs)) if args_in is None else args_in)
        for t in ins:
            st = _storage_of(t)
            if st is not None and rec.id_of(st) is None and int(st.nbytes()) and rec.counts(st):
                # Made outside any operation we saw (torch.tensor from Python data, from_numpy):
                # it counts from the moment it is first used.
                rec.new_storage(st, t.dtype, "(first use)")
        name = func._schema.name
        for t, st in fresh:
            if rec.id_of(st) is None and int(st.nbytes()):
                i = rec.new_storage(st, t.dtype, name)
                if func.namespace == "fsdp":  # FSDP2's all_gather_copy_in: its collective's buffers
                    rec.category[i] = _CAT["communication"]
        return out


def _plain(objs: list[Any]) -> list[Any]:
    """`objs` with each tensor subclass wrapper (a DTensor) replaced by its inner tensors: an op
    on DTensors runs its local ops inside the subclass's dispatch, where this mode is off, and
    returns their results wrapped."""
    out: list[Any] = []
    for t in objs:
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            out += _plain([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        else:
            out.append(t)
    return out


def _check_devices(objs: Any, device: torch.device) -> None:
    for obj in tree_flatten(objs)[0]:
        tensors = []
        if isinstance(obj, nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.Tensor):
            tensors = [obj]
        for t in tensors:
            if t.device.type != device.type:
                what = type(obj).__name__
                raise CaptureError(
                    f"a {what} passed to capture() has tensors on {t.device}, but the capture device is "
                    f"{device}: build the model and inputs on it (e.g. inside `with torch.device({device.type!r}):`) "
                    "or pass a builder that creates them (see vramkit.trace.capture)")


# -------------------------------------------------------------------------------- classify


def _classify(rec: _Recorder) -> np.ndarray:
    cat = np.array(rec.category, dtype=np.uint8)
    phase = np.array(rec.phase_of, dtype=np.int64)
    step = np.array(rec.step_of, dtype=np.int64)
    unknown = cat == _CAT["unknown"]
    n = len(rec.size)
    # Where each allocation's FREE falls, to tell saved activations from forward temporaries.
    free_at = np.full(n, np.iinfo(np.int64).max, np.int64)
    alloc_at = np.full(n, -1, np.int64)
    for pos, (kind, i, _) in enumerate(rec.events):
        if kind == FREE:
            free_at[i] = pos
        elif kind == ALLOC:
            alloc_at[i] = pos
    first_bwd = np.array([rec.first_backward.get(int(s), np.iinfo(np.int64).max) for s in step], np.int64)
    fwd = unknown & (phase == _FORWARD)
    activation = fwd & (free_at >= first_bwd) & (first_bwd < np.iinfo(np.int64).max)
    cat[activation] = _CAT["activation"]
    cat[unknown & ~activation & (phase != _SETUP)] = _CAT["temporary"]
    cat[unknown & (phase == _SETUP)] = _CAT["input"]
    if rec.offload_everything:  # FSDP2's CPUOffloadPolicy: the optimizer step runs on the CPU
        cat[unknown & (phase == _OPTIMIZER)] = _CAT["host"]
    return cat


def _to_trace(rec: _Recorder, meta: dict[str, Any]) -> Trace:
    category = _classify(rec)
    # Storages that existed before the capture come first, as allocations at the very start.
    events = [(ALLOC, i, rec.size[i]) for i in rec.initial] + rec.events
    strings: dict[str, dict[str, int]] = {"dtypes": {}, "modules": {}, "ops": {}}

    def index(table: str, values: list[str]) -> np.ndarray:
        t = strings[table]
        return np.array([t.setdefault(v, len(t)) if v else -1 for v in values], dtype=np.int64)

    arr = np.array(events, dtype=np.int64).reshape(-1, 3)
    return Trace.from_columns(
        kind=arr[:, 0], id=arr[:, 1], size=arr[:, 2].astype(np.uint64), alloc_dtype=index("dtypes", rec.dtype),
        alloc_category=category, alloc_module=index("modules", rec.module), alloc_op=index("ops", rec.op),
        dtypes=list(strings["dtypes"]), modules=list(strings["modules"]), ops=list(strings["ops"]), meta=meta)


# -------------------------------------------------------------------------------- capture


def _as_device(device: Any) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'meta' or 'cpu' (or a torch.device), got {device!r}: {exc}") from None
    if dev.type not in ("meta", "cpu"):
        raise ValueError(f"capture runs on 'meta' (nothing allocated) or 'cpu' (a real run), got {str(dev)!r}; "
                         "to predict a GPU, capture on meta and replay the trace on a simulated device")
    return dev


def capture(step_fn: Callable[..., Any], *args: Any, device: Any = "meta", steps: int = 1,
            meta: dict[str, Any] | None = None, checkpoint_blocks: bool | int = False, autocast: Any = None,
            cuda: CudaChoices | bool = True, world_size: int | None = None, rank: int = 0,
            sharding: ShardingChange | None = None, progress: Callable[[str], None] | None = None,
            **kwargs: Any) -> Trace:
    """Run `steps` training steps and return their allocation trace.

    Two forms:

    * a **step**: ``capture(step, model, batch, device="meta", steps=2)`` calls
      ``step(*args, **kwargs)`` `steps` times. Models, optimizers and tensors among the
      arguments must already be on `device`; their storages (parameters, buffers, gradients,
      optimizer state, inputs) count as allocated from the start.
    * a **builder**: if the first call returns a callable (``def build(): model = ...;
      return step``), that first call runs under ``torch.device(device)`` and is recorded as
      the setup phase (parameters, inputs, optimizer), and the returned callable is called
      `steps` times. This is how a 7B-parameter model is traced on meta without its weights
      ever existing.

    On ``meta`` nothing is allocated; on ``cpu`` the step really runs. Either way every
    storage allocation and free is recorded in order with its size, dtype, module path, op
    and phase. With `checkpoint_blocks` (True, or a number k), the model's repeated blocks
    (``repeated_blocks``; all, or the first k) run under ``torch.utils.checkpoint`` for this
    capture, to see what checkpointing them would save. With `autocast` (``torch.bfloat16`` or ``torch.float16``), the model's forward
    runs under ``torch.autocast("cuda", dtype=autocast)`` (on cpu: ``"cpu"``), as mixed-precision
    training does. On meta, ``torch.autocast`` regions (these and the step's own) are emulated
    with autocast's CUDA or CPU op lists (``autocast_meta``), since torch has no meta autocast.
    On meta, the step makes the dispatch choices a CUDA run makes (`cuda`: a ``CudaChoices``,
    True for all of them on an H100's architecture, False for none, when the capture equals a CPU
    capture): dropout's bool mask, the optimizer's foreach (or fused) implementation, the
    attention backend CUDA's rules pick. Small tensors made from constants, ranges and random
    inputs keep CPU values, so data-dependent Python on them (``.item()``, ``if mask.all():``)
    runs as on a GPU (``meta_values``).
    With `world_size` (and `rank`, default 0), the step runs as rank `rank` of a
    `world_size`-rank torch.distributed job, in this process (``fake_dist``): DDP, FSDP2 and
    ZeroRedundancyOptimizer run their own code for that rank, so sharded parameters, gathered
    parameters, reduce-scatter inputs and DDP's buckets are in the trace at that rank's sizes.
    The step's own ``init_process_group`` call is absorbed and torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ...) are set; ``trace.meta["distributed"]`` lists each step's collectives
    and the bytes this rank sends. `sharding` (a ``ShardingChange``) runs the script's DDP or
    FSDP2 calls with a different strategy (FSDP2 instead of DDP, reshard_after_forward, bf16).
    `progress` receives a line every 5 s of a long capture (ops so far, the module running).
    Raises ``CaptureError`` (with the step's exception as cause) if the step raises;
    nothing is returned then.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    dev = _as_device(device)
    if not isinstance(checkpoint_blocks, (bool, int)) or (checkpoint_blocks is not True and checkpoint_blocks < 0):
        raise ValueError(f"checkpoint_blocks must be True, False or a number of blocks >= 0, got {checkpoint_blocks!r}")
    if autocast is not None and autocast not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None, got {autocast!r}")
    if isinstance(cuda, bool):
        cuda = CudaChoices() if cuda else CudaChoices.off()
    elif not isinstance(cuda, CudaChoices):
        raise TypeError(f"cuda must be True, False or a vramkit.trace.CudaChoices, got {type(cuda).__name__}")
    _check_devices((args, kwargs), dev)
    check_rank(world_size, rank)
    if sharding is not None and (world_size is None or not isinstance(sharding, ShardingChange)):
        raise TypeError("sharding must be a vramkit.trace.ShardingChange, for a capture with world_size, got "
                        f"{sharding!r}" + ("" if world_size is not None else " without world_size"))
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("another vramkit.trace.capture is running in this process; captures cannot nest")
    rec = _Recorder(dev)
    rec.checkpoint_blocks = checkpoint_blocks
    rec.autocast, rec.autocast_device = autocast, ("cuda" if dev.type == "meta" else "cpu")
    hooks = install_hooks(rec)
    info = dict(meta or {})
    try:
        emulation = emulate_autocast() if dev.type == "meta" else contextlib.nullcontext()
        sharded = one_rank(world_size, rank, dev) if world_size is not None else contextlib.nullcontext(None)
        with sharded as group, sharding_changed(sharding), torch.device(dev), emulation, \
                install_choices(cuda, dev.type), storage_resizes(rec), \
                (deferred_init(rec) if dev.type == "meta" else contextlib.nullcontext()), \
                (offload_on_meta(rec) if dev.type == "meta" and world_size is not None else contextlib.nullcontext()), \
                (fsdp_buffers(rec) if world_size is not None else contextlib.nullcontext()):
            rec.collectives = group.log if group is not None else None
            if group is not None:  # DDP's buckets: the only tensors all-reduced on the group object
                group.on_allreduce = functools.partial(_buckets, rec)
            tag_args(rec, (args, kwargs))
            mode = _CaptureMode(rec)
            mode.progress = progress
            values = mode.values
            with mode, (values.tolist() if values is not None else contextlib.nullcontext()), \
                    (values.python_data() if values is not None else contextlib.nullcontext()):
                try:
                    _begin_step(rec)
                    mode.stage = "the builder, or step 1"
                    first = _call(step_fn, args, kwargs)
                    if callable(first) and not isinstance(first, (torch.Tensor, nn.Module)):
                        # A builder: what it made is the setup; the callable it returned is the step.
                        _refile_as_setup(rec)
                        step, form, left = first, "builder", steps
                        rec.step = -1
                    else:
                        _end_step(rec)
                        step, form, left = None, "step", steps - 1
                        info["first_return"] = type(first).__name__
                    del first  # a step's return value (a loss, its graph) lives no longer than later ones
                    for k in range(left):
                        _begin_step(rec)
                        mode.stage = f"step {steps - left + k + 1} of {steps}"
                        if step is not None:
                            _call(step, (), {})
                        else:
                            _call(step_fn, args, kwargs)
                        _end_step(rec)
                finally:
                    if rec.region is not None:
                        # A forward interrupted by KeyboardInterrupt/SystemExit skips the post-hook
                        # that closes the autocast region; it must leave the mode stack here.
                        region, rec.region = rec.region, None
                        region.__exit__(None, None, None)
        info.update(source=f"capture:{dev.type}", device=dev.type, steps=steps, form=form,
                    torch_version=torch.__version__)
        if world_size is not None:
            info["strategy"] = strategy_of((m for ref in rec.roots if (r := ref()) is not None for m in r.modules()),
                                           [o for ref in rec.optimizers if (o := ref()) is not None])
            info["distributed"] = collectives_by_step(rec.collective_marks, rec.collectives or [], world_size, rank,
                                                      form)
        if sharding:
            info["sharding_change"] = sharding.describe()
        if checkpoint_blocks:
            info["checkpointed_blocks"] = rec.checkpointed_path
            info["checkpointed_count"] = rec.checkpointed_count
        if autocast is not None:
            info["autocast"] = str(autocast).replace("torch.", "")
        # Whether an optimizer left its implementation to torch (foreach and fused None): on
        # CUDA it then runs foreach, and foreach=False is a change `fit` can suggest.
        info["optimizer_default_implementation"] = any(
            g.get("foreach") is None and not g.get("fused") and not g.get("differentiable")
            for ref in rec.optimizers if (o := ref()) is not None for g in getattr(o, "param_groups", ()))
        if dev.type == "meta":
            info["cuda_choices"] = {"dropout": cuda.dropout, "optimizer": cuda.optimizer, "attention": cuda.attention,
                                    "arch": f"{cuda.arch[0]}.{cuda.arch[1]}"}
        return _to_trace(rec, info)
    finally:
        for h in hooks:
            h.remove()
        restore_blocks(rec)
        rec.close()
        _ACTIVE.release()


def _buckets(rec: _Recorder, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        rec.see(t, "ddp_bucket")


def _call(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except CaptureError:
        raise
    except Exception as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise CaptureError(f"the step {name}() raised {type(exc).__name__}: {exc}; nothing was captured"
                           f"{store_wait_hint(exc)}") from exc


def _begin_step(rec: _Recorder) -> None:
    if rec.collectives is not None:
        rec.collective_marks.append(len(rec.collectives))
    rec.step += 1
    rec.phase = _OTHER
    rec.module_stack.clear()
    rec.events.append((STEP, rec.step, 0))


def _end_step(rec: _Recorder) -> None:
    rec.module_stack.clear()
    tag_all(rec)
    tag_host(rec)  # (after tag_all: FSDP2's offloaded shards, gradients and states are host memory)


def _refile_as_setup(rec: _Recorder) -> None:
    """The first call was a builder: everything it recorded belongs to the setup phase."""
    events = [(PHASE, _SETUP, 0)]
    for kind, value, size in rec.events:
        if kind not in (PHASE, STEP):
            events.append((kind, value, size))
    rec.events = events
    rec._last_marked = _SETUP
    rec.first_backward.clear()
    for i in range(len(rec.phase_of)):
        if rec.step_of[i] == 0:
            rec.phase_of[i] = _SETUP
            rec.step_of[i] = -1
