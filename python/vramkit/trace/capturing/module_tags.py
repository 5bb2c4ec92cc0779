"""What a capture learns from the modules and optimizers it meets (vramkit.trace.capture).

* Module paths: global forward hooks keep the stack of paths (``layers.3.attn``) during the
  forward; after each module's forward, the autograd nodes it created are labelled with its
  path (``node.metadata``), which the backward reads back from the engine's current node.
* Categories: parameters, buffers, gradients (at each optimizer step and step end) and
  optimizer state of the modules and optimizers seen; Adam's non-capturable ``step`` scalars
  are "host" (CPU memory on a GPU run).
* Options of a capture: checkpointing the model's repeated blocks, and an autocast region
  around the model's forward (entered and left by the root module's hooks).

``rec`` is the capture's recorder (``recorder.Recorder``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from ..sharding.block_stack import repeated_blocks
from ..sharding.cpu_offload import tag_host
from ..formats.file_format import PHASES

_FORWARD, _OTHER = PHASES.index("forward"), PHASES.index("other")
LABEL = "vramkit_module"  # the key of a node's module path in node.metadata

def _label_graph(outputs: Any, path: str) -> None:
    """Label the autograd nodes this module's forward created (those not yet labelled by a
    submodule) with its path, so backward operations can be attributed to it."""
    stack = []
    for t in tree_flatten(outputs)[0]:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        # torch declares Node.metadata a method; on the engine's nodes it is a dict property
        meta: dict[str, Any] = node.metadata  # type: ignore[assignment]
        if LABEL in meta:
            continue
        meta[LABEL] = path
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ != "AccumulateGrad":
                stack.append(nxt)


def install_hooks(rec: Any) -> list[torch.utils.hooks.RemovableHandle]:
    def pre(module: nn.Module, args: Any) -> None:
        # (inside a graph dynamo traces, a hook would be compiled into it, or break it: the
        # compiled region's allocations are the compiled module's; issue 33)
        if torch.compiler.is_compiling() or threading.get_ident() != rec.thread:
            return  # the hooks are process-wide; another thread's models are not this capture's
        if not rec.module_stack:
            if id(module) not in rec.names:
                _add_root(rec, module)
            if rec.phase in (_OTHER, -1) and rec.step >= 0:
                rec.phase = _FORWARD
            if rec.autocast is not None and rec.region is None and torch._C._current_graph_task_id() == -1:
                # capture(autocast=...): the model's forward runs in an autocast region.
                rec.region = torch.autocast(rec.autocast_device, dtype=rec.autocast)
                rec.region.__enter__()
        path = rec.names.get(id(module))
        if path is None:
            parent = rec.module_stack[-1] if rec.module_stack else ""
            path = f"{parent}.{type(module).__name__}" if parent else type(module).__name__
        rec.module_stack.append(path)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != rec.thread:
            return
        if rec.module_stack:
            path = rec.module_stack.pop()
            if torch.is_grad_enabled():
                _label_graph(output, path or type(module).__name__)
        if not rec.module_stack and rec.region is not None:
            region, rec.region = rec.region, None
            region.__exit__(None, None, None)

    def opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != rec.thread:
            return
        if not any(r() is optimizer for r in rec.optimizers):
            rec.optimizers.append(weakref.ref(optimizer))
        _tag_grads(rec, optimizer)
        rec.in_optimizer += 1

    def opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != rec.thread:
            return
        rec.in_optimizer = max(0, rec.in_optimizer - 1)
        _tag_optimizer_state(rec, optimizer)
        tag_host(rec)  # FSDP2's offloaded gradients and states, while the gradients still exist
        rec.phase = _OTHER

    return [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True),
            register_optimizer_step_pre_hook(opt_pre), register_optimizer_step_post_hook(opt_post)]


def _named_modules(rec: Any) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) over every root module seen that is still alive."""
    for ref in rec.roots:
        root = ref()
        if root is not None:
            yield from root.named_modules(remove_duplicate=False)


def _param_names(rec: Any) -> dict[int, tuple[str, str]]:
    """id(parameter or buffer) -> (module path, kind) over the root modules seen."""
    out: dict[int, tuple[str, str]] = {}
    for mname, mod in _named_modules(rec):
        for p in mod.parameters(recurse=False):
            out.setdefault(id(p), (mname, "parameter"))
        for b in mod.buffers(recurse=False):
            out.setdefault(id(b), (mname, "buffer"))
    return out


def _tag_modules(rec: Any) -> None:
    for mname, mod in _named_modules(rec):
        for p in mod.parameters(recurse=False):
            rec.see(p, "parameter", mname)
            if p.grad is not None:
                rec.see(p.grad, "gradient", mname)
        for b in mod.buffers(recurse=False):
            rec.see(b, "buffer", mname)


def _add_root(rec: Any, module: nn.Module) -> None:
    """A module whose submodules get paths relative to it ("layers.3.attn")."""
    if not any(r() is module for r in rec.roots):
        rec.roots.append(weakref.ref(module))
        for name, sub in module.named_modules(remove_duplicate=False):
            rec.names.setdefault(id(sub), name)
        if rec.checkpoint_blocks and not rec.checkpointed:
            _checkpoint_repeated_blocks(rec, module)


def _checkpoint_repeated_blocks(rec: Any, root: nn.Module) -> None:
    """Wrap the repeated blocks' forwards in torch.utils.checkpoint (non-reentrant), for this
    capture only: all of them, or the first k. The first ones: their recomputation comes at
    the end of the backward, when most saved activations are already freed, whereas the last
    block is recomputed at the start, when everything is still live."""
    from torch.utils.checkpoint import checkpoint

    found = repeated_blocks(root)
    if found is None:
        return
    name, blocks = found
    count = len(blocks) if rec.checkpoint_blocks is True else min(int(rec.checkpoint_blocks), len(blocks))
    rec.checkpoint_total = len(blocks)
    for block in blocks[:count]:
        original = block.forward
        rec.saved_forwards.append(block.__dict__.get("forward", _NO_FORWARD))  # a forward the user patched

        def wrapped(*args: Any, _f: Any = original, **kwargs: Any) -> Any:
            return checkpoint(_f, *args, use_reentrant=False, **kwargs)

        block.forward = wrapped
        rec.checkpointed.append(block)
    rec.checkpointed_path = f"{name} ({len(blocks)} x {type(blocks[0]).__name__})"
    rec.checkpointed_count = count


_NO_FORWARD = object()


def restore_blocks(rec: Any) -> None:
    for block, saved in zip(rec.checkpointed, rec.saved_forwards):
        if saved is _NO_FORWARD:
            block.__dict__.pop("forward", None)
        else:
            block.forward = saved
    rec.checkpointed.clear()
    rec.saved_forwards.clear()


def _tag_grads(rec: Any, optimizer: Any) -> None:
    names = _param_names(rec)
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec.see(p, "parameter", names.get(id(p), ("", ""))[0] or None)
            if p.grad is not None:
                rec.see(p.grad, "gradient", names.get(id(p), ("", ""))[0] or None)


def _host_side_step(optimizer: Any, key: Any, value: Any) -> bool:
    """Adam-family optimizers keep `step` as a host (CPU) scalar unless capturable or fused:
    on a GPU run it is not device memory, though under a meta capture it was made on meta."""
    if key != "step" or not isinstance(value, torch.Tensor) or value.dim() != 0:
        return False
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    return not (group.get("capturable") or group.get("fused"))


def _tag_optimizer_state(rec: Any, optimizer: Any) -> None:
    names = _param_names(rec)
    for p, state in optimizer.state.items():
        module = names.get(id(p), ("", ""))[0] or None
        items = state.items() if isinstance(state, dict) else [(None, v) for v in tree_flatten(state)[0]]
        for key, value in items:
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    rec.see(t, "host" if _host_side_step(optimizer, key, t) else "optimizer_state", module)


def tag_args(rec: Any, objs: Any) -> None:
    """Register what the step's arguments hold (modules, optimizers, tensors) before it runs."""
    for obj in tree_flatten(objs)[0]:
        if isinstance(obj, nn.Module):
            _add_root(rec, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            if not any(r() is obj for r in rec.optimizers):
                rec.optimizers.append(weakref.ref(obj))
        elif isinstance(obj, torch.Tensor):
            rec.see(obj, "input")
    tag_all(rec)


def tag_all(rec: Any) -> None:
    """Classify what the modules and optimizers seen hold now."""
    _tag_modules(rec)
    for ref in rec.optimizers:
        opt = ref()
        if opt is not None:
            _tag_grads(rec, opt)
            _tag_optimizer_state(rec, opt)
