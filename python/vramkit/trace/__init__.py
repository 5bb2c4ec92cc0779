"""Predict: will a training step fit on a 24/40/80 GiB GPU?

* ``capture(step_fn, *args, device="meta")`` records a PyTorch step's storage allocations and
  frees (size, dtype, module path, op, phase) without a GPU; on ``meta`` nothing is allocated.
* On meta the step makes CUDA's dispatch choices for the target GPU (``CudaChoices``: dropout's
  bool masks, foreach/fused optimizers, the attention backend), and small tensors keep values
  so data-dependent Python (Hugging Face's mask checks) runs as on a GPU.
* ``replay(trace, "24GiB")`` (or ``gpu="H100-80GB"``, a ``GpuProfile``) replays it on a simulated device with PyTorch's allocator policy
  (the loop is C) and returns a ``Prediction``: peaks, the OOM and where, fragmentation, and
  what was live at the peak by category and module.
* ``fit(build, "24GiB", batch_size=...)`` finds the largest batch size that fits and what makes
  a given one fit.
* ``capture(..., world_size=8, rank=3)`` captures one rank of a sharded job (DDP, FSDP2,
  ZeroRedundancyOptimizer) in this process; ``predict_ranks`` replays each rank whose shards
  differ, and ``fit(..., world_size=8)`` searches per-rank batch sizes.
* ``Trace.save`` / ``load`` read and write ``.vktrace`` files; ``load`` (and
  ``from_torch_snapshot``) also read PyTorch's memory snapshot pickles, so a run recorded on a
  real GPU replays here. Reading a file never runs code from it (plain data only).

``capture`` and ``fit`` need torch; the rest needs only NumPy.
"""

from __future__ import annotations

import os
from typing import Any

from .file_format import ALLOC, CATEGORIES, FREE, MAGIC, PHASE, PHASES, STEP, Trace, TraceFormatError
from .gpu_profiles import PROFILES, GpuProfile, gpu_profile
from .replay_sim import NO_OVERHEADS, GpuOverheads, Prediction, format_size, parse_size, peak_live_bytes, replay

__all__ = [
    "ALLOC", "CATEGORIES", "FREE", "GpuOverheads", "GpuProfile", "NO_OVERHEADS", "PHASE", "PHASES", "PROFILES",
    "Prediction", "STEP", "Trace", "TraceFormatError", "capture", "fit", "format_size", "from_torch_snapshot",
    "gpu_profile", "load", "parse_size", "peak_live_bytes", "predict_ranks", "replay",
]


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a ``.vktrace`` file or a PyTorch memory snapshot pickle (``_dump_snapshot``), told
    apart by their first bytes, never by their name.

    Nothing in the file runs: a snapshot pickle is read as plain data, and one that names any
    class or function (the way a pickle runs code) is refused; a file named ``*.vktrace`` is
    read only as a ``.vktrace``, so a pickle renamed to look like one is refused too. Every
    malformed file is a ``TraceFormatError`` saying what is wrong and where; a path that cannot
    be read raises the OSError Python gives (FileNotFoundError, IsADirectoryError, ...)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head == MAGIC:
        return Trace.load(path)
    if path.lower().endswith(".vktrace"):
        kind = "a pickle" if head[:1] == b"\x80" else f"no .vktrace (it starts with {head!r})"
        raise TraceFormatError(f"{path}: named .vktrace but holds {kind}; vramkit reads a .vktrace only as one "
                               "(a snapshot pickle must not be named .vktrace)")
    if head[:1] == b"\x80":  # a pickle, protocol 2 or later, as torch and vramkit write snapshots
        return from_torch_snapshot(path)
    raise TraceFormatError(f"{path}: neither a .vktrace file nor a snapshot pickle (it starts with {head!r})")


def from_torch_snapshot(snapshot: Any, device: int | None = None) -> Trace:
    """See ``vramkit.trace.snapshot_import.from_torch_snapshot``."""
    from .snapshot_import import from_torch_snapshot as _import

    return _import(snapshot, device)


def capture(step_fn: Any, *args: Any, **kwargs: Any) -> Trace:
    """See ``vramkit.trace.capture_step.capture`` (imports torch)."""
    from .capture_step import capture as _capture

    return _capture(step_fn, *args, **kwargs)


def fit(build: Any, capacity: Any = "24GiB", **kwargs: Any) -> Any:
    """See ``vramkit.trace.fit_search.fit`` (imports torch)."""
    from .fit_search import fit as _fit

    return _fit(build, capacity, **kwargs)


def predict_ranks(build: Any, batch_size: int, **kwargs: Any) -> Any:
    """See ``vramkit.trace.sharded_fit.predict_ranks`` (imports torch)."""
    from .sharded_fit import predict_ranks as _predict_ranks

    return _predict_ranks(build, batch_size, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("RankReport",):
        from . import sharded_fit

        return getattr(sharded_fit, name)
    if name in ("ShardingChange",):
        from . import sharding_changes

        return getattr(sharding_changes, name)
    if name in ("ShardedCaptureError",):
        from . import fake_dist

        return getattr(fake_dist, name)
    if name in ("CaptureError",):
        from . import capture_step

        return getattr(capture_step, name)
    if name in ("CudaChoices",):
        from . import cuda_choices

        return getattr(cuda_choices, name)
    if name in ("DataDependentError",):
        from . import meta_values

        return getattr(meta_values, name)
    if name in ("FitReport", "Probe", "Suggestion"):
        from . import fit_search

        return getattr(fit_search, name)
    raise AttributeError(f"module 'vramkit.trace' has no attribute {name!r}")
