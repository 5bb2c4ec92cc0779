"""What a capture patches for its duration, beyond the dispatch mode: operations that make or
drop memory outside the dispatcher, or whose memory only their caller can name.

* ``storage_resizes``: ``UntypedStorage.resize_`` reallocates a storage without an op (FSDP
  frees and re-creates its gathered parameters this way).
* ``deferred_init``: on meta, ``Module.to_empty`` marks the script's own meta-built model.
* ``fsdp_buffers``: FSDP2's collective buffers, allocated through its ``allocate`` methods.
* ``stream_synchronizations``: ``torch.cpu.synchronize()`` (the device a meta or CPU capture's
  streams belong to) ends ``record_stream``'s waits: a SYNC event.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch import nn

from ..formats.file_format import CATEGORIES

_CAT = {name: i for i, name in enumerate(CATEGORIES)}


@contextlib.contextmanager
def fsdp_buffers(rec: Any) -> Any:
    """FSDP2 allocates its reduce-scatter buffers (and, in some versions, its all-gather output)
    through its collectives' ``allocate``: those are "communication"."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    except ImportError:
        yield
        return
    mixins = [c for c in (getattr(collectives, "DefaultAllocMixin", None),
                          getattr(collectives, "ProcessGroupAllocMixin", None)) if c is not None and "allocate" in vars(c)]
    originals = {c: vars(c)["allocate"] for c in mixins}

    def wrap(original: Any) -> Any:
        def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = original(self, *args, **kwargs)
            if threading.get_ident() == rec.thread:
                rec.see(t, "communication")
            return t

        return allocate

    for c, original in originals.items():
        setattr(c, "allocate", wrap(original))
    try:
        yield
    finally:
        for c, original in originals.items():
            setattr(c, "allocate", original)


@contextlib.contextmanager
def deferred_init(rec: Any) -> Any:
    """On a meta capture, ``Module.to_empty`` marks the script's own deferred initialization:
    it built the model on meta on purpose (FSDP2's shard-then-allocate recipe) and now gives it
    real storage. What the setup made before that call (the full parameters, FSDP2's padded
    shards of them, freed since or not) is "deferred": no memory in a real run. A tensor the
    script made on the real device before it, a batch say, is taken for deferred too; build
    the model first."""
    original = nn.Module.to_empty

    def to_empty(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == rec.thread and rec.step == 0:  # the first call: a builder's setup
            with rec.lock:
                for i, category in enumerate(rec.category):
                    if category in (_CAT["unknown"], _CAT["parameter"], _CAT["buffer"]):
                        rec.category[i] = _CAT["deferred"]
        if rec.offloaded:
            # FSDP2's CPUOffloadPolicy recipe, to_empty(device="cpu"): its shards stay on meta
            # here, standing for host memory (cpu_offload), instead of being allocated for real.
            args, kwargs = (), {**kwargs, "device": rec.device}
        return original(self, *args, **kwargs)

    nn.Module.to_empty = to_empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to_empty = original  # type: ignore[method-assign]


@contextlib.contextmanager
def storage_resizes(rec: Any) -> Any:
    """Record ``UntypedStorage.resize_`` on the capturing thread: it reallocates a storage
    outside the dispatcher, where the capture mode cannot see it."""
    original = torch.UntypedStorage.resize_

    def resize_(self: Any, size: int) -> Any:
        before = int(self.nbytes())
        out = original(self, size)
        if int(self.nbytes()) != before and threading.get_ident() == rec.thread and self.device == rec.device:
            rec.resized(self, "uint8")
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def stream_synchronizations(rec: Any) -> Any:
    """A step's synchronization of its device, as a SYNC event of every stream: on a GPU
    ``torch.cuda.synchronize()``, on meta and CPU (whose streams are ``torch.cpu``'s, with no
    per-stream synchronize) ``torch.cpu.synchronize()``, a no-op there."""
    device_sync = torch.cpu.synchronize

    def synchronize(device: Any = None) -> None:
        device_sync(device)
        if threading.get_ident() == rec.thread:
            rec.synchronized()

    torch.cpu.synchronize = synchronize
    try:
        yield
    finally:
        torch.cpu.synchronize = device_sync
