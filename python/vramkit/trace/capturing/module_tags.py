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
from .batch_sizes import batch_sizes_varying
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


# The recorder of the capture running now (captures never nest: capture_step's lock), read by
# the hooks below, which are module-level functions. Dynamo guards a compiled module's call on
# torch's global hook tables (their keys and functions). A capture's hooks get fresh keys, as
# torch's registration gives them, so every capture compiles its compiled regions afresh, as a
# training run's first step does: compiling holds tensors a step reusing its graphs frees
# sooner (a compiled Hugging Face GPT-2 at batch 8: 343 MB at its first step, really and as
# captured; 276 MB captured with graphs reused). Under batch_sizes_vary (fit's search) they
# go in under one fixed key instead, so that later captures reuse the graphs.
_RECORDER: Any = None
_KEY_SIZES_VARY = -0x766B  # RemovableHandle ids count up from 0: a negative one is never torch's


def _recorder() -> Any:
    """The capture's recorder, or None: outside a capture, inside a graph dynamo traces (a hook
    would be compiled into it, or break it: the compiled region's allocations are the compiled
    module's; issue 33), or on another thread (the hooks are process-wide)."""
    if torch.compiler.is_compiling():
        return None
    rec = _RECORDER
    return rec if rec is not None and threading.get_ident() == rec.thread else None


def _pre(module: nn.Module, args: Any) -> None:
    rec = _recorder()
    if rec is None:
        return
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


def _post(module: nn.Module, args: Any, output: Any) -> None:
    rec = _recorder()
    if rec is None:
        return
    if rec.module_stack:
        path = rec.module_stack.pop()
        if torch.is_grad_enabled():
            _label_graph(output, path or type(module).__name__)
    if not rec.module_stack and rec.region is not None:
        region, rec.region = rec.region, None
        region.__exit__(None, None, None)


def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = _recorder()
    if rec is not None:
        _before_step(rec, optimizer)


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = _recorder()
    if rec is not None:
        _after_step(rec, optimizer)


def _before_step(rec: Any, optimizer: Any) -> None:
    if not any(r() is optimizer for r in rec.optimizers):
        rec.optimizers.append(weakref.ref(optimizer))
    _tag_grads(rec, optimizer)
    rec.in_optimizer += 1


def _after_step(rec: Any, optimizer: Any) -> None:
    rec.in_optimizer = max(0, rec.in_optimizer - 1)
    _tag_optimizer_state(rec, optimizer)
    tag_host(rec)  # FSDP2's offloaded gradients and states, while the gradients still exist
    rec.phase = _OTHER


def compiled_optimizer_step(rec: Any) -> Any:
    """What the step hooks do, for an optimizer step ``torch.compile``d by inductor, whose hooks
    its graph compiled away: called by ``compiled_regions`` around each run of the step's graphs
    (`before` True, then False). Before the first run, the state dynamo made while it traced the
    step (``_init_group``, run with the capture's mode off) is recorded as allocated there: a
    real run makes it at that moment too, in its first step."""
    def around(optimizer: Any, before: bool) -> None:
        if threading.get_ident() != rec.thread:
            return
        if not before:
            _after_step(rec, optimizer)
            return
        for state in optimizer.state.values():
            items = state.items() if isinstance(state, dict) else [(None, v) for v in tree_flatten(state)[0]]
            for key, value in items:
                for t in tree_flatten(value)[0]:
                    st = t.untyped_storage() if isinstance(t, torch.Tensor) and not t.is_sparse else None
                    if st is not None and int(st.nbytes()) and rec.counts(st) and rec.id_of(st) is None:
                        rec.new_storage(st, t.dtype, "optimizer state (made by dynamo's trace)")
        _before_step(rec, optimizer)

    return around


def _insert_hook(table: dict[Any, Any], hook: Any, always_called: dict[Any, Any] | None = None
                ) -> torch.utils.hooks.RemovableHandle:
    """`hook` in torch's global hook `table`, under a fresh key or batch_sizes_vary's fixed one
    (see ``_RECORDER``), removed by the handle returned as ``register_module_forward_hook``'s is."""
    handle = torch.utils.hooks.RemovableHandle(table, extra_dict=always_called)  # (a fresh id)
    if batch_sizes_varying():
        handle.id = _KEY_SIZES_VARY
    table[handle.id] = hook
    if always_called is not None:
        always_called[handle.id] = True
    return handle


def install_hooks(rec: Any) -> list[Any]:
    """The capture's module and optimizer hooks for `rec`, until the handles (each with
    ``remove()``) are removed."""
    global _RECORDER
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    found = [getattr(where, name, None) for where, name in (
        (module_hooks, "_global_forward_pre_hooks"), (module_hooks, "_global_forward_hooks"),
        (optimizer_hooks, "_global_optimizer_pre_hooks"), (optimizer_hooks, "_global_optimizer_post_hooks"),
        (module_hooks, "_global_forward_hooks_always_called"))]
    tables: list[dict[Any, Any]] = [t for t in found if isinstance(t, dict)]
    handles: list[Any]
    if len(tables) < len(found):  # (a torch whose tables moved: its own registration, fresh keys)
        handles = [register_module_forward_pre_hook(_pre), register_module_forward_hook(_post, always_call=True),
                   register_optimizer_step_pre_hook(_opt_pre), register_optimizer_step_post_hook(_opt_post)]
    else:
        handles = [_insert_hook(tables[0], _pre), _insert_hook(tables[1], _post, tables[4]),
                   _insert_hook(tables[2], _opt_pre), _insert_hook(tables[3], _opt_post)]
    _RECORDER = rec
    handles.append(_Forget())
    return handles


class _Forget:
    """The last handle: the recorder forgotten with the hooks."""

    def remove(self) -> None:
        global _RECORDER
        _RECORDER = None


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
