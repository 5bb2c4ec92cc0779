"""PyTorch's own memory estimators run on one rank of the sharded steps in ``sharded_models``:
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` for FSDP2 models and
``torch.distributed._tools.mem_tracker.MemTracker`` for the others (DDP), used as PyTorch's
own tests use them (test/distributed/_tools/test_fsdp2_mem_tracker.py, test_mem_tracker.py):
the model, wrapper, optimizer and batch are built first; the tracker is given the model and
optimizer (FSDPMemTracker) or ``track_external(model, optimizer, batch)`` (MemTracker), the
batch with ``track_inputs`` (FSDPMemTracker), and is entered around two steps, with
``reset_mod_stats()`` after the first (the trackers refuse a second iteration otherwise). Its
figure is ``get_tracker_snapshot("peak")[device]["Total"]``.

One rank of an N-rank job in this process: torch's fake process group
(``dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``), which moves no
data but gives FSDP2 and DDP rank r's shapes. Two ways:

* ``fake_tensors=False``: real (small) CPU tensors. Nothing in the trackers is CUDA-only
  (``_WeakRefInfo`` rounds sizes to 512 bytes on "cuda" devices only; on "cpu" it counts
  ``nbytes``), and FSDP2 runs on the CPU mesh, so FSDPMemTracker needs no change. DDP
  needs one: torch's fake group completes every work with ``None``, and DDP's reducer
  asserts on that ("expected the hook result is either a Tensor or a TensorList found
  None"); the DDP model gets PyTorch's own ``debugging_hooks.noop_hook`` as comm hook (it
  returns the bucket unchanged, which is what an in-place all-reduce leaves in it).
* ``fake_tensors=True``: everything (build and steps) under ``FakeTensorMode``. FSDP2's
  ``fully_shard`` makes its default device mesh inside the mode and fails
  (``DeviceMesh.__init__`` calls ``.tolist()`` on a fake tensor: DataDependentOutputException
  on ``aten._local_scalar_dense``); the mesh is made with the mode suspended
  (``unset_fake_temporarily``) by wrapping ``_fully_shard._init_default_mesh`` for the run.
  DDP cannot run under FakeTensorMode (its constructor's parameter check reads the tensors'
  data in C++); that case raises.

The builders return only the step; the model, optimizer and batch are read from its closure.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import sharded_models as sm


def step_parts(step) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]]:
    """The model, optimizer and batch a ``sharded_models`` step closes over."""
    outer = inspect.getclosurevars(step).nonlocals
    inner = inspect.getclosurevars(outer["loss_of"]).nonlocals
    return inner["model"], outer["opt"], tuple(inner[k] for k in ("x", "y") if k in inner)


@contextlib.contextmanager
def fake_group(world_size: int, rank: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _mesh_outside_fake_mode() -> Iterator[None]:
    import torch.distributed.fsdp._fully_shard._fully_shard as fs
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = fs._init_default_mesh

    def init_default_mesh(*args: Any, **kwargs: Any):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    fs._init_default_mesh = init_default_mesh
    try:
        yield
    finally:
        fs._init_default_mesh = original


def _by_name(snapshot: dict) -> dict[str, int]:
    """One device's snapshot with the categories by name ("Sharded Param", "Total", ...)."""
    if not snapshot:
        return {}
    if len(snapshot) != 1:
        raise AssertionError(f"memory on several devices: {list(snapshot)}")
    (dev_snap,) = snapshot.values()
    return {getattr(k, "value", k): int(v) for k, v in dev_snap.items()}


def tracker_run(model: str, strategy: str, world_size: int, rank: int, fake_tensors: bool = False,
                steps: int = 2) -> dict[str, Any]:
    """Run rank `rank` of `world_size` of the ``sharded_models`` step under PyTorch's tracker.

    Returns {"tool", "peak" (bytes), "peak_snapshot", "at_entry", "after_step" (a snapshot
    after each step), "seconds" (fake group, build, steps)}. Exceptions from the tracker or
    the model propagate."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.distributed.fsdp import FSDPModule

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_group(world_size, rank))
        if fake_tensors:
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(_mesh_outside_fake_mode())
            stack.enter_context(FakeTensorMode())
        step = sm.builder(model, strategy)()
        module, opt, batch = step_parts(step)
        if isinstance(module, FSDPModule):
            tracker: MemTracker = FSDPMemTracker(module, opt)
            tracker.track_inputs(batch)
        else:
            if isinstance(module, torch.nn.parallel.DistributedDataParallel):
                module.register_comm_hook(None, noop_hook)
            tracker = MemTracker()
            tracker.track_external(module, opt, *batch)
        after = []
        with tracker:
            at_entry = _by_name(tracker.get_tracker_snapshot())  # FSDPMemTracker registers the shards on entry
            for i in range(steps):
                step()
                after.append(_by_name(tracker.get_tracker_snapshot()))
                if i < steps - 1:
                    tracker.reset_mod_stats()
        peak = _by_name(tracker.get_tracker_snapshot("peak"))
        del step, module, opt, batch
    return {"tool": type(tracker).__name__, "peak": peak["Total"], "peak_snapshot": peak, "at_entry": at_entry,
            "after_step": after, "seconds": time.perf_counter() - t0}
