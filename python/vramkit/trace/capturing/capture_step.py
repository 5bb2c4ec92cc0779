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
input. The record and that classification are ``recorder.py``; this module runs the step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from .autocast_meta import emulate_autocast
from .compiled_regions import compiled_regions
from .inductor_on_meta import install_compile
from .capture_hooks import deferred_init, fsdp_buffers, storage_resizes, stream_synchronizations
from ..sharding.cpu_offload import offload_on_meta, tag_host
from .cuda_choices import CudaChoices, install as install_choices
from .conv_workspaces import ConvWorkspaces
from .cuda_streams import cuda_streams_on_meta
from ..sharding.fake_dist import COLLECTIVE_NAMESPACES, check_rank, collectives_by_step, note_collective, one_rank, \
    store_wait_hint
from .meta_values import MetaValues, tensors_in
from .module_tags import compiled_optimizer_step, install_hooks, restore_blocks, tag_all, tag_args
from .recorder import CATEGORY_INDEX, OTHER, SETUP, Recorder, storage_of, to_trace
from ..formats.file_format import PHASE, STEP, Trace
from ..sharding.sharding_changes import ShardingChange, sharding_changed, strategy_of

__all__ = ["CaptureError", "capture"]

# Tensor.record_stream's op, looked up once: the check runs for every op a capture sees.
_RECORD_STREAM = torch.ops.aten.record_stream.default
PROGRESS_SECONDS = 5.0  # between the progress lines of a long capture
OPS_BETWEEN_CLOCK_READS = 1024  # (a capture runs tens of thousands of ops a second)
# One capture at a time: the hooks and the dispatch mode are process-wide.
_ACTIVE = threading.Lock()


class CaptureError(RuntimeError):
    """The step could not be captured (it raised, or its inputs are on another device); the
    original exception, if any, is the ``__cause__``."""


class _CaptureMode(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.rec = rec
        self.values = MetaValues(origin_of=self._origin) if rec.device.type == "meta" else None
        self.workspaces: ConvWorkspaces | None = None  # set by capture() on meta with CUDA's workspaces on
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
        st = storage_of(t)
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
        if func is _RECORD_STREAM:
            # The allocator's business, not the kernel's (meta has none): the storage's block
            # waits at its free for this stream.
            st = storage_of(args[0])
            if st is not None and rec.counts(st):
                rec.used_on(st, args[1])
            return None
        if self.workspaces is not None and func in ConvWorkspaces.ops:
            return self.workspaces.run(self._run_op, func, args, kwargs)  # (cuDNN's, modelled)
        return self._run_op(func, args, kwargs)

    def _run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one op and record the storages it made."""
        rec = self.rec
        # (on meta the arguments' tensors are needed before the op, and found once for both uses)
        args_in = tensors_in((args, kwargs)) if self.values is not None else None
        out = func(*args, **kwargs) if self.values is None else self.values.run(func, args, kwargs, args_in)
        outs = _plain(tensors_in(out))
        fresh = [(t, st) for t in outs if (st := storage_of(t)) is not None and rec.counts(st)]
        if not fresh:
            return out
        ins = _plain(tensors_in((args, kwargs)) if args_in is None else args_in)
        for t in ins:
            st = storage_of(t)
            if st is not None and rec.id_of(st) is None and int(st.nbytes()) and rec.counts(st):
                # Made outside any operation we saw (torch.tensor from Python data, from_numpy):
                # it counts from the moment it is first used.
                rec.new_storage(st, t.dtype, "(first use)")
        name = func._schema.name
        for t, st in fresh:
            if rec.id_of(st) is None and int(st.nbytes()):
                i = rec.new_storage(st, t.dtype, name)
                if func.namespace == "fsdp":  # FSDP2's all_gather_copy_in: its collective's buffers
                    rec.category[i] = CATEGORY_INDEX["communication"]
        return out


class _CompilingCaptureMode(_CaptureMode):
    # Dynamo compiles under this mode (off while it compiles, on while the compiled
    # artifact runs) instead of skipping every frame; compiled_regions.py says how.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


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
    attention backend CUDA's rules pick, cuDNN's convolution workspaces (modelled sizes,
    ``conv_workspaces``; ``trace.meta["estimated_bytes"]`` says so). Small tensors made from constants, ranges and random
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
    ``torch.compile``d regions (modules, functions, ``optimizer.step``) are captured as compiled
    (on meta, inductor's partition, fusion and buffer plan without running a kernel; issue 33),
    each compiled afresh as a run's first step compiles it, and listed in
    ``trace.meta["compiled_regions"]``, each ``how`` "compiled" or "eager upper bound" (an
    unmodelled backend), with ``why``.
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
    rec = Recorder(dev)
    rec.checkpoint_blocks = checkpoint_blocks
    rec.autocast, rec.autocast_device = autocast, ("cuda" if dev.type == "meta" else "cpu")
    rec.hold_buckets = dev.type == "meta" and cuda.nccl
    hooks = install_hooks(rec)
    info = dict(meta or {})
    # No cyclic garbage collection during the capture: a tensor held by a reference cycle (a
    # Hugging Face GPT-2's logits) lives until the collector runs, which a real step triggers
    # at its own moments and a capture, making many more Python objects, far more often; with
    # the collector off, such tensors count as long as a step can hold them (the safe side).
    collecting = gc.isenabled()
    gc.disable()
    try:
        emulation = emulate_autocast() if dev.type == "meta" else contextlib.nullcontext()
        sharded = one_rank(world_size, rank, dev) if world_size is not None else contextlib.nullcontext(None)
        with sharded as group, sharding_changed(sharding), torch.device(dev), emulation, \
                install_choices(cuda, dev.type), storage_resizes(rec), stream_synchronizations(rec), \
                (deferred_init(rec) if dev.type == "meta" else contextlib.nullcontext()), \
                (cuda_streams_on_meta(rec) if dev.type == "meta" else contextlib.nullcontext()), \
                (offload_on_meta(rec) if dev.type == "meta" and world_size is not None else contextlib.nullcontext()), \
                (fsdp_buffers(rec) if world_size is not None else contextlib.nullcontext()), \
                compiled_regions(dev.type, rec.names, install_compile, compiled_optimizer_step(rec)) as compiled:
            rec.collectives = group.log if group is not None else None
            if group is not None:  # DDP's buckets: the only tensors all-reduced on the group object
                group.on_allreduce = functools.partial(_buckets, rec)
            tag_args(rec, (args, kwargs))
            mode = _CompilingCaptureMode(rec)
            mode.progress = progress
            if dev.type == "meta" and cuda.workspaces:
                mode.workspaces = ConvWorkspaces(rec, cuda.arch)
            values = mode.values
            with mode, (values.tolist() if values is not None else contextlib.nullcontext()), \
                    (values.python_data() if values is not None else contextlib.nullcontext()):
                try:
                    _begin_step(rec)
                    mode.stage = "the builder, or step 1"
                    first = _call(step_fn, args, kwargs)
                    if callable(first) and not isinstance(first, (torch.Tensor, nn.Module)):
                        # A builder: what it made is the setup; the callable it returned is the step.
                        # Garbage the setup left in reference cycles goes first, as a real run's
                        # collector takes it long before its first step: a lazy import during the
                        # build (torch._dynamo, at the first torch._disable_dynamo call) leaves
                        # frame cycles that held the builder's locals (a DDP model's parameters
                        # that FSDP2 replaced) through the steps of a process's first capture.
                        gc.collect()
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
        if compiled.regions:  # never silent about a compiled region's prediction
            info["compiled_regions"] = compiled.describe()
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
                                    "nccl": cuda.nccl, "workspaces": cuda.workspaces, "rms_norm": cuda.rms_norm,
                                    "arch": f"{cuda.arch[0]}.{cuda.arch[1]}", "cudnn": cuda.cudnn}
            if mode.workspaces is not None and mode.workspaces.count:
                info["estimated_bytes"] = mode.workspaces.describe()
        return to_trace(rec, info)
    finally:
        for h in hooks:
            h.remove()
        restore_blocks(rec)
        rec.close()
        if collecting:
            gc.enable()
        _ACTIVE.release()


def _buckets(rec: Recorder, tensors: list[torch.Tensor]) -> None:
    rec.release_held()  # (CudaChoices.nccl: buckets freed earlier go when the next all-reduce starts)
    for t in tensors:
        rec.see(t, "ddp_bucket")
        st = storage_of(t)
        if st is not None:
            rec.hold(st)


def _call(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except CaptureError:
        raise
    except Exception as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise CaptureError(f"the step {name}() raised {type(exc).__name__}: {exc}; nothing was captured"
                           f"{store_wait_hint(exc)}") from exc


def _begin_step(rec: Recorder) -> None:
    if rec.collectives is not None:
        rec.collective_marks.append(len(rec.collectives))
    rec.step += 1
    rec.phase = OTHER
    rec.module_stack.clear()
    rec.events.append((STEP, rec.step, 0))


def _end_step(rec: Recorder) -> None:
    rec.module_stack.clear()
    rec.release_held()  # (CudaChoices.nccl: DDP's old buckets, freed at their rebuild)
    tag_all(rec)
    tag_host(rec)  # (after tag_all: FSDP2's offloaded shards, gradients and states are host memory)


def _refile_as_setup(rec: Recorder) -> None:
    """The first call was a builder: everything it recorded belongs to the setup phase."""
    events = [(PHASE, SETUP, 0)]
    for kind, value, size in rec.events:
        if kind not in (PHASE, STEP):
            events.append((kind, value, size))
    rec.events = events
    rec._last_marked = SETUP
    rec.first_backward.clear()
    for i in range(len(rec.phase_of)):
        if rec.step_of[i] == 0:
            rec.phase_of[i] = SETUP
            rec.step_of[i] = -1
