"""FSDP2's ``CPUOffloadPolicy`` in a meta capture: the GPU's share of an offloaded step.

With ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` FSDP2 keeps each rank's parameter
shards, their gradients and (so) the optimizer's state in host memory, runs the optimizer step
on the CPU, copies a group's shards to the GPU before its all-gather and its reduced gradients
back after its reduce-scatter. A meta capture cannot run that as written: the shards would be
real CPU tensors (17.5 GiB of them for one rank of Llama 3 70B on 64 GPUs, and a real CPU
optimizer step over them), and FSDP2 refuses parameters on meta.

So during a meta capture (``offload_on_meta``) each offloading ``FSDPParam`` runs as a
non-offloading one, on meta, and the capture files what a real run holds on the host as "host"
at the end of every step (``tag_host``): the offloaded parameters' shards, their gradients
(with the reduce-scatter output they are views of, which a real run frees once the gradients
are copied out) and their optimizer state; the optimizer step's temporaries are host memory too
when every parameter the optimizers hold is offloaded. The replay leaves "host" out of the GPU.

Before a group's all-gather a real run copies each offloaded shard to the GPU and casts the
copy to the compute dtype, one parameter after another (FSDP2's per-parameter path: its fused
foreach copy is for parameters on the GPU only). On meta the shards are already "on the
device", so ``offload_on_meta`` makes those copies where the real run does: the GPU copy
(a clone of the shard) and its cast, as the group's all-gather inputs.

Not seen: the reduce-scatter output's short life on the GPU before the copy to the host (it is
filed as host for its whole life).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["offload_on_meta", "tag_host"]


@contextlib.contextmanager
def offload_on_meta(rec: Any) -> Iterator[None]:
    """FSDP2's offloading parameters run as non-offloading ones on meta; each is remembered in
    ``rec.offloaded`` (weakly) so that ``tag_host`` can file its memory as host."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # a torch without FSDP2
        yield
        return
    from .fake_dist import _patched

    original_init = FSDPParam.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.offload_to_cpu:
            self.offload_to_cpu = self.pin_memory = False  # on meta: no host copies, no pinning
            rec.offloaded.add(self)

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original_inputs = _fsdp_collectives._get_param_all_gather_inputs

    def all_gather_inputs(fsdp_params: list[Any]) -> list[list[Any]]:
        mine = [i for i, p in enumerate(fsdp_params) if p in rec.offloaded and _copied_to_gpu(p)]
        if not mine:
            return original_inputs(fsdp_params)
        others = [i for i in range(len(fsdp_params)) if i not in set(mine)]
        out: list[list[Any]] = [[] for _ in fsdp_params]
        for i, inputs in zip(others, original_inputs([fsdp_params[i] for i in others]) if others else ()):
            out[i] = inputs
        for i in mine:  # as FSDPParam.all_gather_inputs with offload_to_cpu: .to(device), then the cast
            p = fsdp_params[i]
            on_gpu = p._sharded_param_data.clone()
            out[i] = [on_gpu if p.param_dtype in (None, on_gpu.dtype) else on_gpu.to(p.param_dtype)]
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(_fsdp_collectives, "_get_param_all_gather_inputs", all_gather_inputs))
        stack.enter_context(_patched(FSDPParam, "__init__", init))
        # FSDP2 checks that offloaded parameters live on the CPU; here they stand for it on meta.
        stack.enter_context(_patched(FSDPParamGroup, "_validate_cpu_offload_params", lambda self: None))
        yield


def _copied_to_gpu(fsdp_param: Any) -> bool:
    """Whether a real run copies this offloaded parameter's shard to the GPU for its all-gather:
    in the sharded state (a post-forward shard is on the GPU already), without a tensor
    subclass's own pre-all-gather (which this leaves to FSDP2)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return (fsdp_param.sharded_state == ShardedState.SHARDED
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"))


def tag_host(rec: Any) -> None:
    """File the offloaded parameters' shards, gradients and optimizer state as host memory (at
    the end of a step, after the usual categories); note whether every parameter the
    optimizers hold is offloaded (then the optimizer step runs on the CPU)."""
    if not rec.offloaded:
        return
    offloaded = {}
    for fsdp_param in list(rec.offloaded):
        p = fsdp_param.sharded_param
        offloaded[id(p)] = p
        rec.see(p, "host")
        if p.grad is not None:
            rec.see(p.grad, "host")
    held = []  # every parameter the optimizers step
    for ref in rec.optimizers:
        opt = ref()
        if opt is None:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                held.append(p)
                if id(p) in offloaded:
                    for value in opt.state.get(p, {}).values():
                        rec.see(value, "host")
    rec.offload_everything = bool(held) and all(id(p) in offloaded for p in held)
