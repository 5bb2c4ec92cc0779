"""One rank of an N-rank ``torch.distributed`` job, in this process, for a capture.

``capture(..., world_size=N, rank=r)`` runs the user's step inside ``one_rank(N, r, device)``.
There, torch.distributed is initialized with a process group that moves no data. DDP, FSDP2
(``fully_shard``) and ``ZeroRedundancyOptimizer`` then run their own code for rank r of N:
sharded parameters, all-gather outputs, reduce-scatter inputs and DDP's gradient buckets are
real storages of the capture, with the sizes they have on that rank.

**Why not torch's own fake process group.** torch's ``FakeProcessGroup``
(``dist.init_process_group("fake", ...)``) completes every work with a future whose value is
``None``. DDP's reducer reads the bucket back from that future and fails an internal assert
("expected the hook result is either a Tensor or a TensorList found None"). ``CaptureGroup``
has the same semantics otherwise, with three changes:

- it completes each work with the collective's output tensors;
- it records each collective, so that a prediction can state the communication volume per
  step;
- it registers for the ``meta`` device too.

It is a Python ``dist.ProcessGroup``, the extension point torch documents for third-party
backends.

**The script's own ``init_process_group``.** A training script usually calls
``dist.init_process_group("nccl")`` itself, reading ``RANK`` and ``WORLD_SIZE``. During the
capture:

- that call succeeds without creating a group: the capture's group is already the default;
- ``destroy_process_group`` leaves it in place;
- the environment variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) hold the captured rank's values;
- a script that asks for another world size gets a ``CaptureError`` naming its line.

**FSDP2 on meta.** ``fully_shard`` places its buffers on its mesh's device, which is the CPU
on a CPU build of torch, and refuses to run with parameters left on meta. When the capture
device is meta, three FSDP2 internals are patched:

- its device is the capture device;
- its stream and event handle for meta is ``torch.cpu``'s, which makes no-ops;
- ``_validate_no_meta_params`` passes.

Everything else (sharding, padding, all-gather and reduce-scatter buffers, prefetching,
resharding) is FSDP2's own code. Each patched name is checked to exist before it is patched.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, HashStore, ProcessGroup
from torch.futures import Future

__all__ = ["BACKEND", "COLLECTIVE_NAMESPACES", "STORE_TIMEOUT", "CaptureGroup", "ShardedCaptureError", "check_rank",
           "collective_bytes", "collectives_by_step", "note_collective", "one_rank", "store_wait_hint"]

BACKEND = "vramkit_capture"
STORE_TIMEOUT = datetime.timedelta(seconds=30)  # a wait on the store for another rank's key: fails, not hangs
_registered = threading.Lock()
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ShardedCaptureError(RuntimeError):
    """A script's use of torch.distributed that a one-rank capture cannot follow."""


class _Done(dist._Work):  # type: ignore[misc, name-defined]
    """A work already completed, its future holding the collective's outputs (what DDP reads)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: Future[Any] = Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        return self._future


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def collective_bytes(op: str, size: int, world_size: int) -> int:
    """Bytes one rank sends for a collective over `size` bytes (the full buffer: an all-reduce's
    tensor, an all-gather's output, a reduce-scatter's input), as ring algorithms move them:
    all-reduce 2(N-1)/N x size, all-gather and reduce-scatter (N-1)/N x size, broadcast the
    size once, all-to-all (N-1)/N x size. A group of one rank sends nothing."""
    n = world_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * size // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * size // n
    return size


class CaptureGroup(dist.ProcessGroup):
    """A process group of `world_size` ranks seen from `rank`, in one process: each collective
    completes at once, moves no data between ranks and keeps its outputs' shapes. An all-gather
    copies the local input into every chunk of its output, as torch's FakeProcessGroup does,
    so nothing reads uninitialized memory on a CPU capture. Each collective is appended to
    ``log`` as (op, bytes of the full buffer, group size)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # pybind's (rank, size) overload
        self.log: list[tuple[str, int, int]] = []
        # Called with the tensors of each all-reduce made on the group object itself: DDP's
        # reducer does that, with its gradient buckets (dist.all_reduce goes to the backend).
        self.on_allreduce: Any = None

    def getBackendName(self) -> str:  # noqa: N802 (torch's names, called from C++)
        return BACKEND

    # torch's C++ ProcessGroup keeps its name in its backends; a Python group has none.
    _group_name = ""
    _group_desc = ""

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def _note(self, op: str, nbytes: int) -> None:
        self.log.append((op, nbytes, self.size()))

    # all-reduce family: in place
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("all_reduce", _nbytes(tensors))
        if self.on_allreduce is not None:
            self.on_allreduce(tensors)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("all_reduce", _nbytes(tensors))
        return _Done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("reduce", _nbytes(tensors))
        return _Done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("broadcast", _nbytes(tensors))
        return _Done(tensors)

    def barrier(self, opts: Any = None) -> _Done:
        return _Done(None)

    # all-gather family
    @staticmethod
    def _fill(outputs: list[torch.Tensor], source: torch.Tensor) -> None:
        with torch._C._AutoDispatchBelowAutograd(), torch.no_grad():
            for out in outputs:
                out.copy_(source.reshape(out.shape) if source.numel() == out.numel() else source.flatten()[:1])

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("all_gather", _nbytes(outputs))
        for outs, inp in zip(outputs, inputs):
            self._fill(outs, inp)
        return _Done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:  # noqa: A002
        self._note("all_gather", _nbytes(output))
        self._fill(list(output.chunk(self.size())), input)
        return _Done([output])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Done:
        self._note("all_gather", _nbytes(outputs))
        for out, inp in zip(outputs, inputs):
            self._fill(list(out.chunk(self.size())), inp)
        return _Done(outputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> _Done:
        return self.allgather(outputs, inputs, opts)

    # reduce-scatter family: the output keeps whatever it held
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> _Done:
        self._note("reduce_scatter", _nbytes(inputs))
        return _Done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:  # noqa: A002
        self._note("reduce_scatter", _nbytes(input))
        return _Done([output])

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Done:
        self._note("reduce_scatter", _nbytes(inputs))
        return _Done(outputs)

    # the rest
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> _Done:  # noqa: A002
        self._note("all_to_all", _nbytes(input))
        return _Done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("all_to_all", _nbytes(inputs))
        return _Done(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        self._note("gather", _nbytes(inputs))
        return _Done(outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> _Done:
        self._note("scatter", _nbytes(outputs))
        return _Done(outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Done:
        raise ShardedCaptureError("point-to-point send/recv (pipeline parallelism) is not supported by a "
                                  "one-rank capture: the peer's data decides what this rank receives")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Done:
        return self.send(tensors, src, tag)


def store_wait_hint(exc: BaseException) -> str:
    """What to add to a capture's error when the step waited in vain on the process group's
    key-value store (a barrier of its own, a key another rank sets): the reason, and the fix."""
    if not (isinstance(exc, dist.DistStoreError) or "Wait timeout" in str(exc)) or not dist.is_initialized():
        return ""
    seconds = STORE_TIMEOUT.total_seconds()
    return (f". It waited {seconds:.0f} s on torch.distributed's key-value store for something only another rank "
            "would write (a key set by rank 0, a hand-made barrier): a one-rank capture runs no other rank, so "
            "the wait is cut off there. Skip it under a capture (torch.distributed.get_backend() == "
            f"{BACKEND!r}), or use dist.barrier() and the collectives, which a capture completes at once")


def check_rank(world_size: Any, rank: Any) -> None:
    """ValueError/TypeError for a world size or rank a capture cannot take."""
    if world_size is None:
        if rank != 0:
            raise ValueError(f"rank={rank!r} needs world_size: say how many ranks the job has (world_size=N)")
        return
    for name, value in (("world_size", world_size), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (the number of ranks of the job), got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} for world_size {world_size}, got {rank}")


def _summary(entries: list[tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for op, nbytes, size in entries:
        row = out.setdefault(op, {"count": 0, "bytes": 0, "sent": 0})
        row["count"] += 1
        row["bytes"] += nbytes
        row["sent"] += collective_bytes(op, nbytes, size)
    return out


def collectives_by_step(marks: list[int], log: list[tuple[str, int, int]], world_size: int, rank: int,
                        form: str) -> dict[str, Any]:
    """The trace's ``meta["distributed"]``: the job's shape and, for the setup (a builder's
    call) and each step, each collective's count, buffer bytes and bytes this rank sends."""
    bounds = list(marks) + [len(log)]
    parts = [log[a:b] for a, b in zip(bounds, bounds[1:])]
    setup = parts.pop(0) if form == "builder" and parts else []
    return {"world_size": world_size, "rank": rank, "setup": _summary(setup), "steps": [_summary(p) for p in parts]}


COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})

# The collective ops torch dispatches (c10d's in-place ops, what dist.* and FSDP2 call; and
# the functional ops DTensor uses): which kind each is, and which argument holds the full buffer
# (an all-gather's output, a reduce-scatter's input). "x group" marks a functional all-gather,
# whose argument is the local shard, to be multiplied by the group size.
_DISPATCHED: dict[str, tuple[str, int, bool]] = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "reduce_": ("reduce", 0, False), "broadcast_": ("broadcast", 0, False),
    "allgather_": ("all_gather", 0, False), "_allgather_base_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False), "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "reduce_scatter_": ("reduce_scatter", 1, False), "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "alltoall_": ("all_to_all", 1, False), "alltoall_base_": ("all_to_all", 1, False),
    "gather_": ("gather", 1, False), "scatter_": ("scatter", 0, False),
    # _c10d_functional: (input, ..., group_size or group_name)
    "all_reduce": ("all_reduce", 0, False), "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False), "broadcast": ("broadcast", 0, False),
}


def _group_size(args: Any, default: int) -> int:
    """The size of the process group among a c10d op's arguments, else `default`."""
    for a in args:
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, torch.Tensor):
            try:
                return int(size())
            except Exception:  # a script object without size(): keep the default
                continue
    return default


def note_collective(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], log: list[tuple[str, int, int]]) -> None:
    """Append a dispatched collective to `log` as (kind, bytes of the full buffer, group size).
    Ops that are not collectives (waits, c10d's bookkeeping) are skipped."""
    name = func._schema.name.split("::")[-1]
    entry = _DISPATCHED.get(name)
    if entry is None or len(args) <= entry[1]:
        return
    kind, index, times_group = entry
    default = dist.get_world_size() if dist.is_initialized() else 1
    if func.namespace == "_c10d_functional":
        sizes = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
        group = sizes[-1] if times_group and sizes else default
    else:
        group = _group_size(args, default)
    nbytes = _nbytes(args[index])
    log.append((kind, nbytes * group if times_group else nbytes, group))


def _create(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> CaptureGroup:
    return CaptureGroup(rank, world_size)


def _register() -> None:
    with _registered:
        if not hasattr(dist.Backend, BACKEND.upper()):
            dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda", "meta"])


def _caller_line() -> str:
    """The script's line that called into torch.distributed (the first frame outside torch and vramkit)."""
    frame = sys._getframe(2)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(os.path.dirname(torch.__file__)) and not name.startswith(here):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown line)"


def _object_collectives(rank: int) -> dict[str, Any]:
    """torch.distributed's collectives of Python objects, for a one-rank capture: what a rank
    sends it keeps (a source's broadcast, a non-destination's gather); what it would receive from
    another rank it cannot have, so that is a ShardedCaptureError naming the script's line, not
    the unpickling error ("Ran out of input") of an empty buffer."""

    def refuse(what: str) -> ShardedCaptureError:
        return ShardedCaptureError(
            f"{_caller_line()}: {what}; a one-rank capture of rank {rank} runs no other rank to receive Python "
            "objects from. Give each rank the value itself while capturing (from the config, or "
            f"`if dist.get_backend() == {BACKEND!r}`), or capture the rank that sends it")

    def source(src: Any, group_src: Any) -> int:
        return int(group_src if group_src is not None else src if src is not None else 0)

    def broadcast_object_list(object_list: Any, src: Any = None, group: Any = None, device: Any = None,
                              group_src: Any = None) -> None:
        if source(src, group_src) != rank:
            raise refuse(f"broadcast_object_list from rank {source(src, group_src)}")

    def all_gather_object(object_list: Any, obj: Any, group: Any = None) -> None:
        raise refuse("all_gather_object gathers every rank's object")

    def gather_object(obj: Any, object_gather_list: Any = None, dst: Any = None, group: Any = None,
                      group_dst: Any = None) -> None:
        if source(dst, group_dst) == rank:
            raise refuse("gather_object to this rank")

    def scatter_object_list(scatter_object_output_list: Any, scatter_object_input_list: Any = None, src: Any = None,
                            group: Any = None, group_src: Any = None) -> None:
        if source(src, group_src) != rank:
            raise refuse(f"scatter_object_list from rank {source(src, group_src)}")
        scatter_object_output_list[0] = scatter_object_input_list[rank]

    def send_object_list(*args: Any, **kwargs: Any) -> None:
        raise refuse("send_object_list/recv_object_list (point to point)")

    return {"broadcast_object_list": broadcast_object_list, "all_gather_object": all_gather_object,
            "gather_object": gather_object, "scatter_object_list": scatter_object_list,
            "send_object_list": send_object_list, "recv_object_list": send_object_list}


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(obj, name):
        raise ShardedCaptureError(f"this torch ({torch.__version__}) has no {getattr(obj, '__name__', obj)}.{name}, "
                                  "which a sharded capture on meta relies on")
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _fsdp_on(device: torch.device, stack: contextlib.ExitStack) -> None:
    """Point FSDP2 at the capture device (see the module docstring)."""
    try:
        from torch.distributed.fsdp._fully_shard import (
            _fsdp_collectives,
            _fsdp_init,
            _fsdp_param_group,
            _fsdp_state,
            _fully_shard,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # an older torch without FSDP2: nothing to point
        return
    original_handle = getattr(_fsdp_state, "_get_device_handle")

    def device_handle(device_type: str) -> Any:
        return torch.cpu if device_type == "meta" else original_handle(device_type)

    for module in (_fsdp_state, _fsdp_param_group, _fsdp_collectives, _fsdp_init):
        if hasattr(module, "_get_device_handle"):
            stack.enter_context(_patched(module, "_get_device_handle", device_handle))
    stack.enter_context(_patched(_fully_shard, "_get_device_from_mesh", lambda mesh: device))
    stack.enter_context(_patched(FSDPParamGroup, "_validate_no_meta_params", lambda self: None))


@contextlib.contextmanager
def one_rank(world_size: int, rank: int, device: torch.device) -> Iterator[CaptureGroup]:
    """torch.distributed initialized as rank `rank` of `world_size` with a ``CaptureGroup``,
    the script's own init/destroy calls absorbed, torchrun's environment variables set; on exit
    everything as it was. Yields the group, whose ``log`` lists the collectives."""
    if not dist.is_available():
        raise ShardedCaptureError("this torch was built without torch.distributed")
    if dist.is_initialized():
        raise ShardedCaptureError(
            "capture(world_size=...) creates its own process group, but torch.distributed is already initialized "
            "in this process; capture before init_process_group, or in a process of its own")
    _register()
    saved_env = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    store = HashStore()
    # A key only another rank would set is never set here: a wait for it fails after
    # STORE_TIMEOUT (store_wait_hint says why) instead of hanging the capture.
    store.set_timeout(STORE_TIMEOUT)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store, timeout=STORE_TIMEOUT)
    group = cast(CaptureGroup, dist.distributed_c10d._get_default_group())
    # Collectives that torch dispatches as ops (dist.all_gather_into_tensor, FSDP2's, DTensor's)
    # reach a group's backend for the tensors' device, not the Python methods above: torch's
    # FakeProcessGroup is that backend (it copies all-gather inputs; it moves no data).
    fake = FakeProcessGroup._create_internal(rank, world_size)
    for device_type in ("cpu", "cuda", "meta"):
        group._register_backend(torch.device(device_type), ProcessGroup.BackendType.CUSTOM, fake)
    real_destroy = dist.destroy_process_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        asked = kwargs.get("world_size", -1)
        if asked not in (-1, None, world_size):
            raise ShardedCaptureError(f"{_caller_line()}: the script initializes a process group of world size "
                                      f"{asked}, but the capture is for world size {world_size}")

    def destroy_process_group(group_: Any = None) -> None:
        return None

    try:
        with contextlib.ExitStack() as stack:
            for mod in (dist, dist.distributed_c10d):
                stack.enter_context(_patched(mod, "init_process_group", init_process_group))
                stack.enter_context(_patched(mod, "destroy_process_group", destroy_process_group))
                for name, fn in _object_collectives(rank).items():
                    stack.enter_context(_patched(mod, name, fn))
            if device.type == "meta":
                _fsdp_on(device, stack)
            yield group
    finally:
        real_destroy()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
