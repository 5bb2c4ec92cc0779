"""What-if changes to a script's sharding, applied during a sharded capture: ``ShardingChange``.

``fit --world-size`` asks "what if this job sharded differently?" without editing the user's
script: the capture runs the script's own DDP or ``fully_shard`` calls with one change.

- ``fsdp``: each ``DistributedDataParallel(model, ...)`` shards the model with FSDP2 instead:
  ``fully_shard`` on each of the model's repeated blocks (``repeated_blocks``: a transformer's
  layers), then on the model, which is FSDP2's documented recipe. The object the script gets
  back is still its DDP instance (``ddp.module`` is the model, ``ddp(x)`` its forward,
  ``no_sync()`` turns gradient reduction off), so the rest of the script runs unchanged.
- ``reshard_after_forward``: every ``fully_shard`` call's value (True frees each group's
  gathered parameters after its forward and gathers them again in the backward; the root module
  keeps FSDP2's own default, which leaves it unsharded).
- ``param_dtype``: every ``fully_shard`` call's ``MixedPrecisionPolicy`` becomes
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: gathered
  parameters and the forward/backward in bf16, fp32 master weights, gradients reduced in fp32.
- ``cpu_offload``: every ``fully_shard`` call gets ``offload_policy=CPUOffloadPolicy()``
  (captured as ``cpu_offload`` describes: the shards stand on meta for host memory).

FSDP2's own code does everything else. The patched internals are looked up by name and checked
to exist (``fake_dist._patched``), so a torch that renames them fails with a clear error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["SHARDING_TECHNIQUES", "ShardingChange", "apply_sharding_change", "change_for", "communication_sent",
           "host_bytes", "sharding_changed", "sharding_cost", "sharding_techniques", "strategy_of"]


@dataclass(frozen=True)
class ShardingChange:
    """One what-if change to the script's sharding (see the module docstring)."""

    fsdp: bool = False
    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("fsdp", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardingChange.{name} must be True or False, got {getattr(self, name)!r}")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise TypeError("ShardingChange.reshard_after_forward must be True, False or None, got "
                            f"{self.reshard_after_forward!r}")
        if self.param_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"ShardingChange.param_dtype must be torch.bfloat16, torch.float16 or None, got "
                             f"{self.param_dtype!r}")

    def __bool__(self) -> bool:
        return self.fsdp or self.reshard_after_forward is not None or self.param_dtype is not None or self.cpu_offload

    def describe(self) -> str:
        parts = []
        if self.fsdp:
            parts.append("FSDP2 instead of DDP")
        if self.reshard_after_forward is not None:
            parts.append(f"reshard_after_forward={self.reshard_after_forward}")
        if self.param_dtype is not None:
            parts.append(f"{str(self.param_dtype).replace('torch.', '')} MixedPrecisionPolicy")
        if self.cpu_offload:
            parts.append("CPUOffloadPolicy")
        return " + ".join(parts)


def _mp_policy(change: ShardingChange, given: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if change.param_dtype is None:
        return given
    return MixedPrecisionPolicy(param_dtype=change.param_dtype, reduce_dtype=torch.float32,
                                output_dtype=getattr(given, "output_dtype", None),
                                cast_forward_inputs=getattr(given, "cast_forward_inputs", True))


@contextlib.contextmanager
def sharding_changed(change: ShardingChange | None) -> Iterator[None]:
    """FSDP2 and DDP patched for `change` (nothing for None) inside the block."""
    used: dict[str, int] = {"ddp": 0, "fully_shard": 0}
    with contextlib.ExitStack() as stack:
        if change:
            apply_sharding_change(change, stack, used)
        yield
    if change and change.fsdp and not used["ddp"]:
        raise _unused("ShardingChange(fsdp=True) shards DistributedDataParallel's model with FSDP2, but the step never "
                      "makes a DistributedDataParallel")
    if change and not change.fsdp and not used["fully_shard"]:
        raise _unused(f"ShardingChange({change.describe()}) changes the step's fully_shard calls, but the step makes "
                      "none (it does not use FSDP2)")


def _unused(message: str) -> Exception:
    from .fake_dist import ShardedCaptureError

    return ShardedCaptureError(message + "; nothing was captured")


def apply_sharding_change(change: ShardingChange, stack: contextlib.ExitStack,
                          used: dict[str, int] | None = None) -> None:
    """Patch FSDP2 and DDP for `change` until `stack` closes; `used` counts the step's
    ``fully_shard`` ("fully_shard") and ``DistributedDataParallel`` ("ddp") calls changed."""
    used = used if used is not None else {}
    from torch.distributed.fsdp._fully_shard import _fsdp_state, _fully_shard

    from .fake_dist import _patched

    original_init_group = getattr(_fully_shard, "_init_param_group")
    post_forward_mesh_info_of = getattr(_fully_shard, "_get_post_forward_mesh_info")
    original_state_init = _fsdp_state.FSDPState.init

    def init_param_group(state: Any, params: Any, modules: Any, mesh_info: Any, post_forward_mesh_info: Any,
                         device: Any, shard_placement_fn: Any, mp_policy: Any, offload_policy: Any,
                         reshard_after_forward: Any = True) -> None:
        used["fully_shard"] = used.get("fully_shard", 0) + 1
        if change.reshard_after_forward is not None:
            reshard_after_forward = change.reshard_after_forward
            post_forward_mesh_info = post_forward_mesh_info_of(reshard_after_forward, mesh_info)
        if change.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            offload_policy = CPUOffloadPolicy()
        original_init_group(state, params, modules, mesh_info, post_forward_mesh_info, device, shard_placement_fn,
                            _mp_policy(change, mp_policy), offload_policy,
                            reshard_after_forward=reshard_after_forward)

    def state_init(self: Any, modules: Any, device: Any, mp_policy: Any, *args: Any, **kwargs: Any) -> Any:
        return original_state_init(self, modules, device, _mp_policy(change, mp_policy), *args, **kwargs)

    stack.enter_context(_patched(_fully_shard, "_init_param_group", init_param_group))
    stack.enter_context(_patched(_fsdp_state.FSDPState, "init", state_init))
    if change.fsdp:
        _ddp_as_fsdp(stack, used)


def _ddp_as_fsdp(stack: contextlib.ExitStack, used: dict[str, int]) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from .fake_dist import _patched
    from .block_stack import repeated_blocks

    def init(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        used["ddp"] = used.get("ddp", 0) + 1
        nn.Module.__init__(self)
        found = repeated_blocks(module)
        for block in found[1] if found is not None else ():
            fully_shard(block)
        fully_shard(module)
        self.module = module

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self: Any) -> Any:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    for name, value in (("__init__", init), ("forward", forward), ("no_sync", no_sync)):
        stack.enter_context(_patched(DistributedDataParallel, name, value))


def strategy_of(modules: Any, optimizers: Any) -> dict[str, Any]:
    """How a captured step shards: which of DDP, FSDP2 and ZeroRedundancyOptimizer it uses, and
    for FSDP2 whether every group below the root reshards after its forward and the parameters'
    compute dtype (``trace.meta["strategy"]``; ``fit`` offers the changes that differ)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {"ddp": False, "fsdp2": False, "zero": any(isinstance(o, ZeroRedundancyOptimizer)
                                                                     for o in optimizers)}
    reshards, dtypes, offloads = [], set(), []
    uneven = 0  # sharded parameters whose sharded dimension does not divide by its mesh dimension
    for module in modules:
        uneven += sum(_uneven(p) for p in module.parameters(recurse=False))
        if isinstance(module, DistributedDataParallel) and not isinstance(getattr(module, "module", None), FSDPModule):
            out["ddp"] = True
        if isinstance(module, FSDPModule):
            out["fsdp2"] = True
            state = module._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", ()):
                dtypes.add(str(group.mp_policy.param_dtype).replace("torch.", ""))
                offloads.append(type(group.offload_policy).__name__ == "CPUOffloadPolicy")
                if not getattr(state, "_is_root", False):  # FSDP2 leaves the root unsharded by default
                    reshards.append(group.post_forward_mesh_info is not None)
    out["uneven_shards"] = uneven
    if out["fsdp2"]:
        out["reshard_after_forward"] = all(reshards) if reshards else True
        out["param_dtype"] = ",".join(sorted(dtypes))
        out["cpu_offload"] = bool(offloads) and all(offloads)
    return out


def _uneven(param: Any) -> bool:
    """Whether a DTensor parameter's shards differ in shape between ranks (a Shard(d) placement
    over a mesh dimension that does not divide its size d: the last ranks' chunks are shorter)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return False
    return any(placement.is_shard() and param.shape[placement.dim] % n  # type: ignore[attr-defined]
               for n, placement in zip(param.device_mesh.shape, param.placements))


# The sharding changes fit can suggest, by name: "fsdp" (a DDP script sharded with FSDP2),
# "reshard" (FSDP2 groups that keep their gathered parameters between forward and backward
# free them instead), "mp" (FSDP2's bf16 MixedPrecisionPolicy).
SHARDING_TECHNIQUES = ("fsdp", "reshard", "mp", "offload")


def sharding_techniques(strategy: dict[str, Any] | None) -> list[str]:
    """The changes worth trying for a step captured with ``trace.meta["strategy"]``."""
    if not strategy:
        return []
    if strategy.get("ddp") and not strategy.get("fsdp2"):
        return ["fsdp", "mp"]  # (mp only together with fsdp: MixedPrecisionPolicy is FSDP2's)
    out = []
    if strategy.get("fsdp2"):
        if not strategy.get("reshard_after_forward", True):
            out.append("reshard")
        if strategy.get("param_dtype") in ("None", "float32"):
            out.append("mp")
        if not strategy.get("cpu_offload"):
            out.append("offload")  # (last: the slowest step of all the changes)
    return out


def change_for(techniques: Any) -> ShardingChange | None:
    """The ShardingChange of a combination of technique names (None if it has none of them)."""
    chosen = set(techniques) & set(SHARDING_TECHNIQUES)
    if not chosen:
        return None
    return ShardingChange(fsdp="fsdp" in chosen, reshard_after_forward=True if "reshard" in chosen else None,
                          param_dtype=torch.bfloat16 if "mp" in chosen else None, cpu_offload="offload" in chosen)


def communication_sent(trace: Any) -> int | None:
    """Bytes the trace's rank sends in its last step's collectives (None: not a sharded trace)."""
    info = trace.meta.get("distributed")
    if not info:
        return None
    steps = info.get("steps") or [{}]
    return sum(int(row.get("sent", 0)) for row in steps[-1].values())


def sharding_cost(technique: str, blocks: str) -> str:
    """What one sharding change asks of the script, in words (the communication is added by the caller)."""
    if technique == "fsdp":
        return (f"fully_shard(block) on each of {blocks or 'the repeated blocks'} and then fully_shard(model) in "
                "place of DistributedDataParallel(model) (torch.distributed.fsdp); parameters are all-gathered in "
                "the forward and again in the backward and gradients reduce-scattered, instead of one all-reduce; "
                "build the model on meta and call to_empty() after fully_shard, or every GPU holds the whole model "
                "at the start")
    if technique == "offload":
        return ("fully_shard(..., offload_policy=CPUOffloadPolicy()): this rank's parameter shards, gradients and "
                "optimizer state live in pinned host memory (build the model on meta and call "
                "to_empty(device=\"cpu\") after fully_shard), the optimizer step runs on the CPU (much slower), and "
                "each layer's shards are copied to the GPU before its all-gather and its gradients back after its "
                "reduce-scatter")
    if technique == "reshard":
        return ("fully_shard(..., reshard_after_forward=True): each group frees its gathered parameters after its "
                "forward and all-gathers them again in the backward")
    return ("fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)): "
            "parameters gathered and used in bf16, fp32 master weights, optimizer state and gradient reduction")


def host_bytes(trace: Any) -> int:
    """Bytes of host memory ("host" storages) the trace holds at its end: with FSDP2's CPU
    offload, the rank's parameter shards, gradients and optimizer state."""
    from ..formats.file_format import CATEGORIES

    return int(trace.alloc_size[trace.live_at_end() & (trace.alloc_category == CATEGORIES.index("host"))].sum())
