"""Activation-checkpoint planning: the schedule with the least compute that fits a memory budget.

A chain of stages (``Stage``: forward and backward time, input activation bytes, the bytes its
backward needs, transient memory) and a budget go to the C planner; ``plan`` returns a
``Schedule``: the operations to run and the time and peak memory a simulator predicts for
them. The execution model is in docs/checkpoint_model.md.

Algorithms: ``"optimal"`` (the persistent dynamic program of rotor, exact under the memory
discretisation), ``"revolve"`` (binomial checkpointing, for homogeneous chains), ``"sqrt"``
(Chen et al.: round(sqrt(L)) equal segments), ``"segments"`` (what
``torch.utils.checkpoint.checkpoint_sequential`` does with ``segments=k``), ``"none"`` (store
everything).

The torch side loads torch on first use: ``checkpoint`` (``function``: a drop-in for
``torch.utils.checkpoint.checkpoint``), ``profile`` and ``profile_loss`` (``profiling``:
measure a chain), ``checkpoint_sequential`` and ``Sequential`` (``sequential``: run a planned
schedule), ``apply``, ``find_blocks`` and ``CheckpointHandle`` (``blocks``: budget-planned
checkpointing of a model's repeated blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .planner import (
    ALGORITHMS,
    OP_NAMES,
    BudgetTooSmallError,
    Op,
    Schedule,
    Stage,
    min_budget,
    plan,
    simulate,
)

if TYPE_CHECKING:  # loaded lazily at run time (they import torch), see __getattr__
    from .blocks import CheckpointHandle, apply, find_blocks  # noqa: F401
    from .function import checkpoint  # noqa: F401
    from .profiling import profile, profile_loss  # noqa: F401
    from .sequential import Sequential, checkpoint_sequential  # noqa: F401

__all__ = ["ALGORITHMS", "OP_NAMES", "BudgetTooSmallError", "Op", "Schedule", "Stage", "min_budget", "plan", "simulate"]

# The names that need torch, and the module of this package that defines each.
_TORCH_NAMES = {"profile": "profiling", "profile_loss": "profiling", "checkpoint_sequential": "sequential",
                "Sequential": "sequential", "checkpoint": "function", "apply": "blocks",
                "CheckpointHandle": "blocks", "find_blocks": "blocks"}


def __getattr__(name: str) -> Any:
    """``profile``, ``profile_loss``, ``checkpoint_sequential``, ``Sequential``, ``checkpoint``,
    ``apply``, ``CheckpointHandle`` and ``find_blocks`` load torch on first use."""
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
