"""What a capture records (``Recorder``): the storages the step allocates and frees, each with
its size, dtype, module path, op, phase and step, and the phase and step markers between them;
and, once the step has run, how those storages are classified and become a ``Trace``
(``to_trace``). ``capture_step.py`` runs the step and feeds the recorder from its dispatch mode
and hooks; see its docstring for how.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..formats.file_format import ALLOC, CATEGORIES, FREE, PHASE, PHASES, SYNC, USE, Trace
from .module_tags import LABEL

__all__ = ["BACKWARD", "CATEGORY_INDEX", "FORWARD", "OPTIMIZER", "OTHER", "Recorder", "SETUP", "storage_of",
           "to_trace"]

SETUP, FORWARD, BACKWARD, OPTIMIZER, OTHER = range(len(PHASES))
CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}


def _default_stream() -> Any:
    return getattr(torch.cpu, "_default_cpu_stream", None)


def _stream_name(stream: Any) -> str:
    """Where a side stream comes from, for the report: the attribute that holds it (in FSDP2's
    communication context, ``all_gather_copy_in_stream``, ``reduce_scatter_stream``), else its type."""
    import gc

    for holder in gc.get_referrers(stream):
        # An object's attributes (Python 3.11 may hand back the object, not its dict); not a
        # module's globals (torch.cpu's `_current_stream`).
        if type(holder).__name__.endswith("StreamContext"):  # the `with` entering it, not its owner
            continue
        names = holder if isinstance(holder, dict) else getattr(holder, "__dict__", None)
        if isinstance(names, dict) and "__name__" not in names:
            for key, value in names.items():
                if value is stream and isinstance(key, str):
                    return key
    return getattr(stream, "vramkit_name", None) or type(stream).__name__


def storage_of(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.layout != torch.strided:
        return None
    if is_traceable_wrapper_subclass(t):
        return None  # a DTensor's own "storage" has its global size; its local tensor holds the memory
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class Recorder:
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
        self.stream_of: list[int] = []  # the stream current at each allocation (0: the default stream)
        self.streams: dict[Any, tuple[Any, int]] = {}  # the stream's key -> (the object, kept alive; its number)
        self.stream_names: dict[int, str] = {}
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
        # CudaChoices.nccl: ids of DDP buckets, whose frees wait for DDP's next all-reduce (or the
        # step's end), and the frees waiting
        self.hold_buckets = False
        self.held_at_free: set[int] = set()
        self.waiting_frees: list[int] = []
        self.checkpointed_path = ""

    # ---------------------------------------------------------------- phases

    def current_phase(self) -> int:
        if torch._C._current_graph_task_id() != -1:
            return BACKWARD
        if self.in_optimizer:
            return OPTIMIZER
        if self.phase == FORWARD and self.step in self.first_backward:
            return OTHER  # after the backward, before the optimizer: clipping, logging
        return self.phase

    def _mark(self) -> int:
        phase = self.current_phase()
        if phase != self._last_marked:
            self.events.append((PHASE, phase, 0))
            self._last_marked = phase
        if phase == BACKWARD and self.step not in self.first_backward:
            self.first_backward[self.step] = len(self.events)
        return phase

    _last_marked = -1

    # ---------------------------------------------------------------- streams

    def stream_number(self, stream: Any) -> int:
        """A small number for a stream object (0 for the default stream), stable for the capture.
        On meta and CPU a step's streams are ``torch.cpu.Stream`` objects: FSDP2's device handle
        there is ``torch.cpu``, whose ``stream()`` context sets what ``current_stream()`` returns."""
        if stream is None or stream is _default_stream():
            return 0
        # A torch.Stream (what record_stream takes) is a fresh Python object each time it
        # crosses the dispatcher: it is known by what it wraps.
        key: Any = (stream.device_type, stream.device_index, stream.stream_id) \
            if isinstance(stream, torch.Stream) else id(stream)
        entry = self.streams.get(key)
        if entry is None:
            entry = self.streams[key] = (stream, len(self.streams) + 1)
            self.stream_names[entry[1]] = _stream_name(stream)
        return entry[1]

    def current_stream(self) -> int:
        return self.stream_number(torch.cpu.current_stream())

    def used_on(self, st: Any, stream: Any) -> None:
        """``record_stream``: storage `st` is used on `stream`, so the allocator holds its block
        at its free until that stream's work is done (a USE event; its number in the size slot,
        read back by ``to_trace``)."""
        i = self.id_of(st)
        number = self.stream_number(stream)
        if i is None or number == self.stream_of[i]:
            return
        with self.lock:
            self.events.append((USE, i, number))

    def synchronized(self) -> None:
        """The device was synchronized: every use's wait is over (a SYNC event of every stream;
        meta and CPU streams, ``torch.cpu``'s, have no synchronize of their own)."""
        with self.lock:
            self.events.append((SYNC, -1, 0))

    # ---------------------------------------------------------------- storages

    def module_path(self, phase: int) -> str:
        if phase == BACKWARD:
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
            phase = SETUP if initial else self._mark()
            self.size.append(n)
            self.dtype.append(str(dtype).replace("torch.", ""))
            self.module.append("" if initial else self.module_path(phase))
            self.op.append(op)
            self.phase_of.append(phase)
            self.step_of.append(self.step)
            # A CPU tensor in a meta capture (a host-side scalar such as foreach Adam's
            # torch.tensor(1.0, device="cpu")) is host memory on a GPU run too.
            host = self.device.type == "meta" and st.device.type == "cpu"
            self.category.append(CATEGORY_INDEX["host"] if host else CATEGORY_INDEX["unknown"])
            self.stream_of.append(0 if initial else self.current_stream())
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
            if i in self.held_at_free:
                self.waiting_frees.append(i)  # freed for the allocator at the step's end
                return
            self._mark()
            self.events.append((FREE, i, self.size[i]))

    def hold(self, st: Any) -> None:
        """`st` (a bucket DDP all-reduces) is held, at its free, until the next all-reduce
        starts or the step ends (``CudaChoices.nccl``)."""
        i = self.id_of(st)
        if i is not None and self.hold_buckets:
            self.held_at_free.add(i)

    def release_held(self) -> None:
        """The frees that waited happen now."""
        with self.lock:
            if self.waiting_frees:
                self._mark()
            for i in self.waiting_frees:
                self.events.append((FREE, i, self.size[i]))
            self.waiting_frees.clear()

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
                self.category[i] = CATEGORY_INDEX["unsharded_parameter"]

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
        st = storage_of(t)
        if st is None or int(st.nbytes()) == 0:
            return
        i = self.id_of(st)
        if i is None:
            i = self.new_storage(st, t.dtype, op or "(pre-existing)", initial=True)
        if category is not None:
            self.category[i] = CATEGORY_INDEX[category]
        if module is not None and not self.module[i]:
            self.module[i] = module

    def close(self) -> None:
        with self.lock:
            self.open = False
            for _, fin in self.live.values():
                fin.detach()
            self.live.clear()


# -------------------------------------------------------------------------------- classify


def _classify(rec: Recorder) -> np.ndarray:
    cat = np.array(rec.category, dtype=np.uint8)
    phase = np.array(rec.phase_of, dtype=np.int64)
    step = np.array(rec.step_of, dtype=np.int64)
    unknown = cat == CATEGORY_INDEX["unknown"]
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
    fwd = unknown & (phase == FORWARD)
    activation = fwd & (free_at >= first_bwd) & (first_bwd < np.iinfo(np.int64).max)
    cat[activation] = CATEGORY_INDEX["activation"]
    cat[unknown & ~activation & (phase != SETUP)] = CATEGORY_INDEX["temporary"]
    cat[unknown & (phase == SETUP)] = CATEGORY_INDEX["input"]
    if rec.offload_everything:  # FSDP2's CPUOffloadPolicy: the optimizer step runs on the CPU
        cat[unknown & (phase == OPTIMIZER)] = CATEGORY_INDEX["host"]
    return cat


def to_trace(rec: Recorder, meta: dict[str, Any]) -> Trace:
    category = _classify(rec)
    # Storages that existed before the capture come first, as allocations at the very start.
    events = [(ALLOC, i, rec.size[i]) for i in rec.initial] + rec.events
    strings: dict[str, dict[str, int]] = {"dtypes": {}, "modules": {}, "ops": {}}

    def index(table: str, values: list[str]) -> np.ndarray:
        t = strings[table]
        return np.array([t.setdefault(v, len(t)) if v else -1 for v in values], dtype=np.int64)

    arr = np.array(events, dtype=np.int64).reshape(-1, 3)
    kind, ids, third = arr[:, 0], arr[:, 1], arr[:, 2]
    # The stream column: an allocation's own stream on its ALLOC and FREE (the allocator returns a
    # block to the pool of the stream it was allocated on); USE and SYNC carried theirs in the
    # size slot, and have no size.
    mem = kind <= FREE
    marks = (kind == USE) | (kind == SYNC)
    stream = np.zeros(len(kind), np.uint64)
    stream_of = np.array(rec.stream_of, np.uint64)
    stream[mem] = stream_of[ids[mem]] if stream_of.size else 0
    stream[marks] = third[marks]
    size = np.where(marks, 0, third).astype(np.uint64)
    if rec.stream_names:
        meta = {**meta, "streams": {str(k): v for k, v in rec.stream_names.items()}}
    return Trace.from_columns(
        kind=kind, id=ids, size=size, stream=stream, alloc_dtype=index("dtypes", rec.dtype),
        alloc_category=category, alloc_module=index("modules", rec.module), alloc_op=index("ops", rec.op),
        dtypes=list(strings["dtypes"]), modules=list(strings["modules"]), ops=list(strings["ops"]), meta=meta)
