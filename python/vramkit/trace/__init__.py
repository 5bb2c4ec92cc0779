"""Predict: will a training step fit on a 24/40/80 GiB GPU?

* ``capture(step_fn, *args, device="meta")`` records a PyTorch step's storage allocations and
  frees (size, dtype, module path, op, phase) without a GPU; on ``meta`` nothing is allocated.
* On meta the step makes CUDA's dispatch choices for the target GPU (``CudaChoices``: dropout's
  bool masks, foreach/fused optimizers, the attention backend), and small tensors keep values
  so data-dependent Python (Hugging Face's mask checks) runs as on a GPU.
* ``replay(trace, "H100-80GB")`` (or ``"24GiB"``, a ``GpuProfile``, a ``Target``) replays it
  on a simulated device with PyTorch's allocator policy (the loop is C) and returns a
  ``Prediction``: peaks, the OOM and where, fragmentation, and what was live at the peak by
  category and module.
* ``fit(build, "H100-80GB", batch_size=...)`` finds the largest batch size that fits and what
  makes a given one fit.
* ``capture(..., world_size=8, rank=3)`` captures one rank of a sharded job (DDP, FSDP2,
  ZeroRedundancyOptimizer) in this process; ``predict_ranks`` replays each rank whose shards
  differ, ``fit(..., world_size=8)`` searches per-rank batch sizes and
  ``smallest_world_size`` the fewest GPUs a batch needs.
* ``Trace.save`` / ``load`` read and write ``.vktrace`` files; ``load`` (and
  ``from_torch_snapshot``) also read PyTorch's memory snapshot pickles, so a run recorded on a
  real GPU replays here. Reading a file never runs code from it (plain data only).

The GPU argument of ``replay``, ``fit``, ``predict_ranks`` and ``smallest_world_size`` is
resolved once into a ``Target`` (``resolve_target``); there is no default GPU.

The package is cut by stage (docs/architecture.md has the layer table): ``formats`` (the
``Trace`` and its files), ``target`` (the GPU), ``sharding`` (one rank of a sharded job,
emulated in this process), ``capturing`` (a step run on meta and recorded), ``replaying`` (a
trace replayed on the target) and ``fitting`` (the searches built from captures and replays).
Their names are not the functions' (``capturing``, not ``capture``): a subpackage named like
a name of this namespace would replace that name once imported.

Every name here is its implementation, re-exported: the ones that need torch (``capture``,
``fit``, ``predict_ranks``, ``smallest_world_size`` and their reports and errors) are loaded on
first use, so ``import vramkit.trace`` needs only NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.sizes import format_size, parse_size
from .formats.file_format import ALLOC, CATEGORIES, FREE, PHASE, PHASES, STEP, SYNC, USE, Trace, TraceFormatError
from .formats.reading import load
from .formats.snapshot_import import from_torch_snapshot
from .replaying.replay_sim import Prediction, peak_live_bytes, replay
from .target.dispatch import CudaChoices
from .target.gpu_profiles import (
    NO_OVERHEADS,
    PROFILES,
    GpuOverheads,
    GpuProfile,
    Target,
    TargetError,
    gpu_profile,
    resolve_target,
)

if TYPE_CHECKING:  # loaded lazily at run time (they import torch), see __getattr__; "as" re-exports them
    from .capturing.capture_step import CaptureError as CaptureError, capture as capture
    from .capturing.meta_values import DataDependentError as DataDependentError
    from .fitting.fit_search import FitReport as FitReport, fit as fit
    from .fitting.probes import Probe as Probe
    from .fitting.sharded_fit import RankReport as RankReport, WorldSizeAnswer as WorldSizeAnswer
    from .fitting.sharded_fit import predict_ranks as predict_ranks, smallest_world_size as smallest_world_size
    from .fitting.suggestions import Suggestion as Suggestion
    from .sharding.fake_dist import ShardedCaptureError as ShardedCaptureError
    from .sharding.sharding_changes import ShardingChange as ShardingChange

# The names that need torch, and the module of this package that defines each.
_TORCH_NAMES = {
    "capture": "capturing.capture_step", "CaptureError": "capturing.capture_step",
    "DataDependentError": "capturing.meta_values",
    "fit": "fitting.fit_search", "FitReport": "fitting.fit_search", "Probe": "fitting.probes",
    "Suggestion": "fitting.suggestions",
    "predict_ranks": "fitting.sharded_fit", "RankReport": "fitting.sharded_fit",
    "smallest_world_size": "fitting.sharded_fit", "WorldSizeAnswer": "fitting.sharded_fit",
    "ShardedCaptureError": "sharding.fake_dist", "ShardingChange": "sharding.sharding_changes",
}

__all__ = [
    "ALLOC", "CATEGORIES", "FREE", "NO_OVERHEADS", "PHASE", "PHASES", "PROFILES", "STEP", "SYNC", "USE",
    "CudaChoices", "GpuOverheads", "GpuProfile", "Prediction", "Target", "TargetError", "Trace", "TraceFormatError",
    "format_size", "from_torch_snapshot", "gpu_profile", "load", "parse_size", "peak_live_bytes", "replay",
    "resolve_target", *sorted(_TORCH_NAMES),
]


def __getattr__(name: str) -> Any:
    """The names that need torch load it on first use (see ``_TORCH_NAMES``)."""
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
