"""``repeated_blocks``: a model's stack of repeated blocks (a transformer's layers, a ResNet
stage), the unit the sharding changes give ``fully_shard`` one by one and the capture's
``checkpoint_blocks`` wraps in activation checkpointing."""

from __future__ import annotations

from torch import nn

__all__ = ["repeated_blocks"]


def repeated_blocks(root: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's stack of repeated blocks: the ModuleList or Sequential of two or more
    children of one class holding the most parameters (a transformer's layers, a ResNet
    stage), as (path, blocks); None if there is none."""
    best, best_params = None, 0
    for name, mod in root.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in mod.parameters()
                     if not isinstance(p, nn.parameter.UninitializedParameter))  # lazy modules, before their first call
        if params > best_params:
            best, best_params = (name, children), params
    return best
