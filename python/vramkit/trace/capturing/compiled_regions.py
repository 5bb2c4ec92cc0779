"""``torch.compile``'d regions in a capture: seen, named, and run as compiled.

Why this exists: dynamo skips every frame while a ``TorchDispatchMode`` whose
``ignore_compile_internals()`` is False is on the stack, so under the capture's mode a compiled
model used to run eagerly and be predicted as eager, silently (a compiled 0.5B causal LM holds
23.8 GB at its peak on an H100, eager 35.1 GB).

Seeing the regions: every entry into a compiled function, module or optimizer step goes
through ``torch._dynamo.eval_frame._callback_from_stance``, called from the wrapper
``torch.compile`` returned, with the wrapped function ``fn`` in that wrapper's frame. For the
capture that lookup is replaced by one that also records the region (its name, its backend) in
``CompiledRegions``; ``describe()`` is what ``capture`` puts in ``trace.meta["compiled_regions"]``:
one entry per region with ``how`` ("compiled", "eager upper bound": its figure is what eager
would hold, more than compiled holds, or compiled without CUDA graphs: a lower bound) and ``why``.

Running them as compiled: the capture's mode says ``ignore_compile_internals() is True``
there, so dynamo compiles with the mode off and runs the compiled artifact with the mode back
on. Per backend:

* ``inductor``: inductor's own pipeline decides (``inductor_on_meta``); for a compiled
  ``optimizer.step``, whose state dynamo makes while tracing (with the mode off) and whose
  hooks its graph compiles away, ``optimizer_step`` (the capture's) records both around each
  run of its graphs;
* ``aot_eager``, ``eager``: their graphs run ATen op by op on meta, captured as they run (an
  optimizer step compiled by them runs eagerly: "eager upper bound");
* any other backend: not modelled; run eagerly ("eager upper bound").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch

__all__ = ["CompiledRegions", "EAGER_BOUND", "COMPILED", "NO_CUDA_GRAPHS", "compiled_regions"]

# How a region was predicted. NO_CUDA_GRAPHS: compiled, but its CUDA graphs (mode=
# "reduce-overhead") left out: their private memory pool, whose blocks no other allocation can
# use, and their static inputs and outputs are not modelled, so the figure is a lower bound.
COMPILED, EAGER_BOUND, NO_CUDA_GRAPHS = "compiled", "eager upper bound", "compiled without CUDA graphs (lower bound)"
_MODELLED = ("inductor", "aot_eager", "eager")

# The regions of the capture running now: the runtime wrappers of artifacts compiled during an
# earlier capture (dynamo caches them) report their runs here.
_ACTIVE: "CompiledRegions | None" = None


@dataclasses.dataclass
class Region:
    name: str
    backend: str
    how: str
    why: str
    graphs: int = 0  # graphs compiled for it during this capture
    runs: int = 0  # runs of its compiled graphs during this capture
    fused: bool | None = None  # inductor: its graphs lowered with fusion (None: not inductor)
    symbolic: bool = False  # some graph it ran had symbolic sizes (dynamic shapes: batch_sizes_vary)
    optimizer: Any = None  # a compiled optimizer step's optimizer (a weak reference)

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "how": self.how, "why": self.why, "backend": self.backend,
               "graphs": self.graphs, "runs": self.runs}
        if self.fused is not None:
            out["fused"] = self.fused
        if self.symbolic:
            out["symbolic_sizes"] = True
        return out


class CompiledRegions:
    """The compiled regions one capture met, by name (see the module's docstring)."""

    def __init__(self, device_type: str, names: dict[int, str] | None = None) -> None:
        if device_type not in ("meta", "cpu"):
            raise ValueError(f"device_type must be 'meta' or 'cpu', got {device_type!r}")
        self.device_type = device_type
        self.names = names if names is not None else {}  # id(module) -> its path in the capture
        self.regions: dict[str, Region] = {}
        self.current: Region | None = None  # the region entered last: its compiles are its graphs
        # Called around each run of a compiled optimizer step's graphs: (optimizer, before)
        self.optimizer_step: Callable[[Any, bool], None] | None = None

    def enter(self, fn: Any, backend: str) -> Region:
        name = self._name_of(fn)
        region = self.regions.get(name)
        if region is None:
            region = Region(name, backend, *self._verdict(backend))
            self.regions[name] = region
        self.current = region
        return region

    def _verdict(self, backend: str) -> tuple[str, str]:
        if backend == "inductor" and self.device_type == "cpu":
            return COMPILED, ("inductor's real CPU compile and run, its wrapper's buffers allocated through "
                              "the dispatcher, which the capture sees")
        if backend == "inductor":
            return COMPILED, ("inductor: its AOT partition (saved vs recomputed) and its memory plan (fused "
                              "buffers, reuse, frees) from a lowering of each graph for the CPU")
        if backend in ("aot_eager", "eager"):
            return COMPILED, f"backend {backend!r} runs its graphs op by op, as captured"
        return EAGER_BOUND, f"backend {backend!r} is not modelled on meta: the region ran eagerly"

    def _name_of(self, fn: Any) -> str:
        owner = getattr(fn, "__self__", None)
        if owner is not None:  # a bound method: a module's forward/__call__, an optimizer's step
            # (torch.compile(model) is the root the hooks see; the model is its "_orig_mod")
            path = self.names.get(id(owner), "").replace("_orig_mod.", "").replace("_orig_mod", "")
            what = type(owner).__name__
            method = getattr(fn, "__name__", "")
            if isinstance(owner, torch.nn.Module):
                return f"{path} ({what})" if path else what
            return f"{what}.{method}" if method else what
        return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)

    def without_cuda_graphs(self, region: Region) -> None:
        """`region` asked for CUDA graphs, which the capture leaves out: a lower bound."""
        if region.how == COMPILED:
            region.how = NO_CUDA_GRAPHS
            region.why += ("; its CUDA graphs (mode='reduce-overhead') are left out: their private memory pool "
                           "and static buffers are not modelled, so its figure is a lower bound")

    def eager(self, region: Region | None, why: str) -> None:
        """`region` ran (at least partly) eagerly: its figure is an eager upper bound."""
        if region is not None and region.how != EAGER_BOUND:
            region.how, region.why = EAGER_BOUND, why

    def describe(self) -> list[dict[str, Any]]:
        for region in self.regions.values():
            if region.how == COMPILED and region.backend == "inductor" and region.runs == 0:
                # Entered, yet no graph of ours ran: dynamo fell back to eager (its recompile
                # limit, a frame it skips) or ran a graph compiled outside any meta capture.
                self.eager(region, "no graph compiled for the capture ran: dynamo ran it eagerly "
                                   "(recompile limit reached, or a frame it does not compile)")
        return [r.describe() for r in self.regions.values()]


# -------------------------------------------------------------------------------- backends


def backend_name(callback: Any) -> str:
    """The name of the backend behind a dynamo callback ("inductor", "aot_eager", a function's
    name), following the wrappers' ``_torchdynamo_orig_backend`` links."""
    obj = callback
    for _ in range(6):
        if obj is None:
            break
        for attr in ("_compiler_name", "compiler_name"):
            name = getattr(obj, attr, None)
            if isinstance(name, str) and name:
                return name
        if isinstance(getattr(obj, "__wrapped__", None), torch._TorchCompileInductorWrapper):
            return "inductor"
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return type(callback).__name__


def counted(fn: Callable[..., Any], region: Region, symbolic: bool = False) -> Callable[..., Any]:
    """`fn` (a compiled graph's runner), each run counted for `region` in the capture running
    now (a graph compiled during an earlier capture is reused by dynamo's cache); `symbolic`:
    the graph has symbolic sizes."""
    def run(*args: Any) -> Any:
        now = _ACTIVE.regions.get(region.name) if _ACTIVE is not None else None
        if now is not None:
            now.runs += 1
            if now.fused is None or region.fused is False:  # how the graph was lowered, said by every
                now.fused = region.fused                     # capture that runs it (False: some were not)
            now.symbolic = now.symbolic or symbolic
            optimizer = now.optimizer() if now.optimizer is not None else None
            around = _ACTIVE.optimizer_step if _ACTIVE is not None else None
            if optimizer is not None and around is not None:
                around(optimizer, True)
                try:
                    return fn(*args)
                finally:
                    around(optimizer, False)
        return fn(*args)
    return run


# -------------------------------------------------------------------------------- the capture


@contextlib.contextmanager
def compiled_regions(device_type: str, names: dict[int, str] | None = None,
                     install_compile: Callable[[contextlib.ExitStack, CompiledRegions], None] | None = None,
                     optimizer_step: Callable[[Any, bool], None] | None = None) -> Iterator[CompiledRegions]:
    """For one capture: record the compiled regions entered and compile them as the module
    docstring says, inductor's compile patched by `install_compile` (``inductor_on_meta``'s,
    given by the capture). Everything patched is restored on exit. Dynamo and inductor (2 s to
    import) are loaded only when the process uses them: if ``torch.compile`` has not been called
    yet, the patches go in at its first call during the capture."""
    global _ACTIVE
    state = CompiledRegions(device_type, names)
    state.optimizer_step = optimizer_step
    with contextlib.ExitStack() as stack:
        previous, _ACTIVE = _ACTIVE, state
        stack.callback(_restore_active, previous)
        # torch.compile(module) warns that global module hooks fire for the wrapper it returns
        # too: the capture's own hooks, which know (the wrapper is the root they name "").
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks",
                                category=UserWarning)
        if "torch._dynamo" in sys.modules:
            _install(stack, state, install_compile)
        else:
            original_compile = torch.compile
            installed: list[bool] = []

            @functools.wraps(original_compile)
            def compile(*args: Any, **kwargs: Any) -> Any:
                if not installed:
                    installed.append(True)
                    _install(stack, state, install_compile)
                return original_compile(*args, **kwargs)

            torch.compile = compile
            stack.callback(setattr, torch, "compile", original_compile)
        yield state


def _install(stack: contextlib.ExitStack, state: CompiledRegions,
             install_compile: Callable[[contextlib.ExitStack, CompiledRegions], None] | None) -> None:
    """The region lookup and the compile patches, restored by `stack`."""
    import torch._dynamo.eval_frame as eval_frame

    thread = threading.get_ident()
    _never_traced()
    original_lookup = eval_frame._callback_from_stance

    def callback_from_stance(callback: Any) -> Any:
        chosen = original_lookup(callback)
        if threading.get_ident() != thread:
            return chosen  # the patch is process-wide; another thread's regions are not this capture's
        if callback in (None, False) or not callable(callback):
            return chosen  # torch.compiler.disable, run-only contexts: no region starts here
        frame = sys._getframe(1)
        fn = frame.f_locals.get("fn")
        del frame
        backend = backend_name(callback)
        region = state.enter(fn if fn is not None else callback, backend)
        if chosen in (None, False):
            state.eager(region, "torch.compiler's stance runs it eagerly")
        elif backend not in _MODELLED:
            return None  # not modelled: run eagerly, captured op by op
        elif isinstance(optimizer := getattr(fn, "__self__", None), torch.optim.Optimizer):
            if backend != "inductor" or state.optimizer_step is None:
                state.eager(region, f"a compiled optimizer step with backend {backend!r} runs eagerly in a capture: "
                                    "its temporaries are the eager step's")
                return None
            # Inductor's: dynamo makes the state while it traces the step, with the capture's
            # mode off, and the step's hooks (which file the gradients and the state) are
            # compiled away; state.optimizer_step records both around each run of its graphs.
            region.optimizer = weakref.ref(optimizer)
        return chosen

    eval_frame._callback_from_stance = callback_from_stance
    stack.callback(setattr, eval_frame, "_callback_from_stance", original_lookup)
    if install_compile is not None:
        install_compile(stack, state)


def _never_traced() -> None:
    """The recorder's code runs from storage finalizers, at whatever moment the garbage goes,
    dynamo's tracing included: dynamo must never try to compile those frames (it would break
    graphs on them and compile vramkit's bookkeeping)."""
    import weakref

    from torch._dynamo.eval_frame import skip_code

    from .recorder import Recorder

    skip_code(weakref.finalize.__call__.__code__)
    for value in vars(Recorder).values():
        code = getattr(value, "__code__", None)
        if code is not None:
            skip_code(code)


def _restore_active(previous: CompiledRegions | None) -> None:
    global _ACTIVE
    _ACTIVE = previous
