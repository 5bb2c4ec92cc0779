"""A step's own CUDA streams in a meta capture (issue 33).

A training script that overlaps work on a side stream (``s = torch.cuda.Stream()``, ``with
torch.cuda.stream(s): ...``, ``t.record_stream(s)``) could not be captured on meta at all on a
machine without CUDA (``torch.cuda.Stream requires CUDA support``), and on a GPU machine its
streams were real CUDA streams the capture never saw: every allocation counted on stream 0,
though c10's allocator keeps a pool per stream and holds a block used on another stream until
that stream's work is done.

For a meta capture, ``torch.cuda``'s stream API is answered by ``torch.cpu``'s, as FSDP2's
device handle already is there: ``torch.cuda.Stream()`` is a ``torch.cpu.Stream`` (a subclass
that takes CUDA's arguments), ``torch.cuda.stream(s)`` sets what ``current_stream()`` returns,
which the recorder reads for each allocation, and ``Tensor.record_stream`` with such a stream is
a USE event (the replay holds the block until a synchronize). ``torch.cuda.synchronize()`` is a
SYNC of every stream. Waits (``wait_stream``, events) order work in time, which a replay does
not have: no-ops. ``Stream.synchronize()`` and ``Event.synchronize()`` record nothing, so a
block used on a stream returns to its pool at the next device synchronize or step end: later
than on a GPU at worst (the safe side).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .recorder import storage_of

__all__ = ["cuda_streams_on_meta"]


class _Stream(torch.cpu.Stream):
    """``torch.cuda.Stream`` in a meta capture: a ``torch.cpu.Stream`` taking CUDA's arguments."""

    vramkit_name = "torch.cuda.Stream"  # the report's name for it, held by no attribute (a local)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        super().__init__()
        self.device = torch.device("cuda", 0)

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _Event(torch.cpu.Event):
    """``torch.cuda.Event`` in a meta capture: recorded and waited on without effect."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        super().__init__()

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _current_stream(device: Any = None) -> Any:
    return torch.cpu.current_stream()


def _default_stream(device: Any = None) -> Any:
    return getattr(torch.cpu, "_default_cpu_stream", None) or torch.cpu.current_stream()


def _stream(stream: Any) -> Any:
    return torch.cpu.stream(stream) if stream is not None else contextlib.nullcontext()


def _synchronize(device: Any = None) -> None:
    torch.cpu.synchronize()  # (the capture's, looked up now: a SYNC event)


@contextlib.contextmanager
def cuda_streams_on_meta(rec: Any) -> Iterator[None]:
    """``torch.cuda``'s streams as ``torch.cpu``'s for the capture recorded by `rec` (see the
    module docstring); everything restored on exit."""
    original_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, torch.cpu.Stream):
            return original_record_stream(self, stream)
        st = storage_of(self)
        if st is not None and rec.counts(st):
            rec.used_on(st, stream)
        return None

    replaced = {"Stream": _Stream, "Event": _Event, "current_stream": _current_stream,
                "default_stream": _default_stream, "stream": _stream, "synchronize": _synchronize}
    saved = {name: getattr(torch.cuda, name) for name in replaced}
    for name, value in replaced.items():
        setattr(torch.cuda, name, value)
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.record_stream = original_record_stream  # type: ignore[method-assign]
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
