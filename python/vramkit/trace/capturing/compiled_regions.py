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
one entry per region with ``how`` ("compiled", or "eager upper bound": its figure is what
eager would hold, more than compiled holds) and ``why``.

Running them as compiled: the capture's mode says
``ignore_compile_internals() is True`` there, so dynamo compiles with the mode off and runs the
compiled artifact with the mode back on. Per backend:

* ``inductor``: ``torch._inductor.compile_fx.compile_fx`` runs as it does (AOTAutograd's joint
  graph with inductor's decompositions and joint passes, inductor's min-cut partitioner, so what
  is saved for the backward and what is recomputed are inductor's; then inductor's lowering,
  scheduler and fusion of each forward and backward graph), with three changes. (1) The whole
  compile sees the graph's fake tensors labelled ``cpu``, not ``meta``: on meta, inductor lowers
  every op to an unfused fallback, its joint-graph passes replace meta outputs by empty tensors
  and register no patterns, and AOTAutograd under the Python dispatcher skips the autograd of
  ``nll_loss`` (a compiled cross-entropy then had no gradient). (2) Every C++ kernel is a no-op,
  never compiled. (3) The generated Python wrapper runs on the real meta tensors, its
  ``empty_strided_cpu`` allocating on meta through the dispatcher. Run under the capture's
  mode, it records inductor's own memory plan: its buffers (fused pointwise intermediates never
  exist), their reuse and their ``del``s. If a graph cannot be lowered, it runs op by op
  ("compiled" still, ``fused`` False: an upper bound for the fused temporaries); if the compile
  fails, dynamo's graph runs eagerly ("eager upper bound").
* ``aot_eager``, ``eager``: their graphs run ATen op by op on meta, captured as they run.
* any other backend, and a compiled ``optimizer.step`` (dynamo makes its state while tracing,
  with the mode off): not modelled; run eagerly ("eager upper bound").

The CPU lowering stands for the GPU's: on CUDA inductor fuses with Triton rather than C++ and
may choose other kernels (attention, matmul templates), and the capture's CUDA dispatch choices
(``cuda_choices``) do not reach inside a compiled graph, which takes the CPU's.

On a cpu capture the compile is inductor's real one (kernels compiled and run); only the
wrapper's ``empty_strided_cpu``, a C++ fast path the capture's mode would not see, allocates
through the dispatcher instead. Meta and cpu captures of a compiled step are then identical,
event for event, as they are for eager steps (with CUDA's dispatch choices off).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["CompiledRegions", "EAGER_BOUND", "COMPILED", "NO_CUDA_GRAPHS", "compiled_regions"]

# How a region was predicted. NO_CUDA_GRAPHS: compiled, but its CUDA graphs (mode=
# "reduce-overhead") left out: their private memory pool, whose blocks no other allocation can
# use, and their static inputs and outputs are not modelled, so the figure is a lower bound.
COMPILED, EAGER_BOUND, NO_CUDA_GRAPHS = "compiled", "eager upper bound", "compiled without CUDA graphs (lower bound)"
_META, _CPU = torch.device("meta"), torch.device("cpu")
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

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "how": self.how, "why": self.why, "backend": self.backend,
               "graphs": self.graphs, "runs": self.runs}
        if self.fused is not None:
            out["fused"] = self.fused
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


def _dynamo_control() -> tuple[type[BaseException], ...]:
    """Exceptions dynamo raises through a backend to restart or skip its analysis (dynamic
    shapes: a float input tensorified): not failures of the compile, never caught here.
    (Imported when needed: ``import vramkit.trace`` does not load dynamo.)"""
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    return RestartAnalysis, SkipFrame


def _relabel(values: Sequence[Any], src: torch.device, dst: torch.device) -> list[Any]:
    """Fake tensors among `values` on `src` relabelled `dst` in place; returns them, so the
    caller can relabel them back."""
    from torch._subclasses.fake_tensor import FakeTensor

    changed = []
    for v in values:
        if isinstance(v, FakeTensor) and v.fake_device == src:
            v.fake_device = dst
            changed.append(v)
    return changed


def _graph_fakes(gm: Any) -> list[Any]:
    """The fake tensors of a graph's nodes: dynamo's (``example_value``; AOTAutograd finds its
    inputs' fakes there, memoized by the real tensor) and AOTAutograd's (``val``)."""
    out: list[Any] = []
    for node in gm.graph.nodes:
        out += torch.utils._pytree.tree_leaves([node.meta.get("val"), node.meta.get("example_value")])
    return out


def _meta_empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # (dispatched, unlike inductor's C++ fast path: the capture's mode records it)
    return torch.empty_strided(size, stride, dtype=dtype, device=_META)


def _meta_empty_any(size: Sequence[int], stride: Sequence[int], **kwargs: Any) -> torch.Tensor:
    # the generated wrapper's generic `empty_strided(..., device=..., dtype=...)`
    return torch.empty_strided(size, stride, dtype=kwargs.get("dtype"), device=_META)


def _counted(fn: Callable[..., Any], region: Region) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        if _ACTIVE is not None and _ACTIVE.regions.get(region.name) is not None:
            _ACTIVE.regions[region.name].runs += 1
        return fn(*args)
    return run


def _move_devices(gm: Any, src: torch.device, dst: torch.device) -> None:
    """Device constants in a graph's node arguments (``arange(..., device=meta)``) from `src`
    to `dst`."""
    def move(a: Any) -> Any:
        return dst if isinstance(a, torch.device) and a == src else a

    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.args = torch.fx.node.map_aggregate(node.args, move)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, move)
    gm.recompile()


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """The capture's function modes off while inductor compiles: its ``torch.device("meta")``
    would put the factories of decompositions (``masked_fill``'s scalar) on meta, among the CPU
    fakes, and its meta values have nothing to do with fake tensors."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _fakes_on_cpu(changed: list[Any]) -> Iterator[None]:
    """Every fake tensor made from a real meta tensor while inside is labelled CPU (and added
    to `changed`, to be labelled back)."""
    from torch._subclasses.fake_tensor import FakeTensorConverter

    original = FakeTensorConverter.from_real_tensor

    def from_real_tensor(self: Any, fake_mode: Any, t: Any, *args: Any, **kwargs: Any) -> Any:
        fake = original(self, fake_mode, t, *args, **kwargs)
        changed.extend(_relabel([fake], _META, _CPU))
        return fake

    FakeTensorConverter.from_real_tensor = from_real_tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensorConverter.from_real_tensor = original  # type: ignore[method-assign]


def _meta_device(type: Any = None, index: Any = None) -> torch.device:
    # the generated wrapper's `device(type='cpu')`, in fallback ops' arguments
    return _META


def _cpu_empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # (a cpu capture: the same buffer as inductor's C++ fast path makes, through the dispatcher)
    return torch.empty_strided(size, stride, dtype=dtype, device=_CPU)


def _inner_cpu(region: Region, real_inner: Callable[..., Any]) -> Callable[..., Any]:
    """inductor's inner compile on a cpu capture: the real one, kernels and all; only its
    wrapper's buffers are allocated through the dispatcher, so the capture's mode sees them."""

    def inner(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        region.graphs += 1
        with _no_function_modes():
            out = real_inner(gm, example_inputs, **kwargs)
        call = getattr(out, "current_callable", None)
        wrapper_globals = getattr(getattr(call, "__func__", call), "__globals__", None)
        if call is None or wrapper_globals is None:
            raise RuntimeError("inductor's output had no Python wrapper whose allocations a capture can see")
        wrapper_globals["empty_strided_cpu"] = wrapper_globals["empty_strided_cpu_pinned"] = _cpu_empty
        region.fused = True
        out.current_callable = _counted(call, region)
        return out

    inner.vramkit_meta = True  # type: ignore[attr-defined]
    return inner


def _inner(region: Region, real_inner: Callable[..., Any]) -> Callable[..., Any]:
    """inductor's inner compile of one forward or backward graph (on fake tensors labelled
    CPU): inductor's own CPU lowering, its kernels no-ops, its wrapper run on meta; if that
    fails, the graph run op by op on meta."""

    def inner(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        region.graphs += 1
        try:
            with _no_function_modes():  # (a backward graph is lowered lazily, in the first backward)
                out = real_inner(gm, example_inputs, **kwargs)
        except _dynamo_control():
            raise
        except Exception as exc:  # inductor could not lower it: run the partitioned graph op by op
            return _op_by_op(gm, region, f"a graph could not be lowered ({type(exc).__name__}: {str(exc)[:200]})")
        call = getattr(out, "current_callable", None)
        wrapper_globals = getattr(getattr(call, "__func__", call), "__globals__", None)
        if call is None or wrapper_globals is None:
            return _op_by_op(gm, region, "inductor's output had no Python wrapper to run on meta")
        # Its buffers on meta, through the dispatcher (inductor's C++ fast path bypasses it,
        # and the capture's mode records what the dispatcher sees).
        wrapper_globals["empty_strided_cpu"] = wrapper_globals["empty_strided_cpu_pinned"] = _meta_empty
        wrapper_globals["empty_strided"] = _meta_empty_any
        wrapper_globals["device"] = _meta_device
        # A fallback op's meta kernel may pick other strides than its CPU kernel (a convolution
        # on channels-last input): the sizes, which are the memory, are the same. Strides are
        # not checked on meta.
        for check in ("assert_size_stride", "assert_alignment"):
            if check in wrapper_globals:
                wrapper_globals[check] = _no_kernel
        if region.fused is None:
            region.fused = True
        out.current_callable = _counted(call, region)
        return out

    inner.vramkit_meta = True  # type: ignore[attr-defined]
    return inner


def _op_by_op(gm: Any, region: Region, why: str) -> Any:
    from torch._functorch._aot_autograd.utils import make_boxed_func

    region.fused = False
    region.why += f"; {why}, so it ran op by op, unfused (an upper bound for its temporaries)"
    _move_devices(gm, _CPU, _META)
    return make_boxed_func(_counted(gm.forward, region))


# -------------------------------------------------------------------------------- the patches


def _composite_meta_kernels(stack: contextlib.ExitStack) -> None:
    """Take out, for the capture, the Python Meta kernels torch registers for operators that
    have a CompositeImplicitAutograd kernel (``nll_loss``, ``dropout``, ...: every decomposition
    of its tables becomes a ``py_impl(Meta)``). AOTAutograd traces under the Python dispatcher,
    which on meta tensors runs such a kernel in place of the decomposition, past autograd: the
    loss of a compiled cross-entropy on meta had no gradient, and everything behind it was
    computed in the forward graph. Without them, meta decomposes as CPU and CUDA do. Eager
    ops never consult these kernels (they run only under the Python dispatcher)."""
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    taken: dict[Any, Any] = {}
    for table in ("meta", "post_autograd", "pre_autograd"):
        for op in global_decomposition_table[table]:
            if (isinstance(op, torch._ops.OpOverload) and op not in taken and DispatchKey.Meta in op.py_kernels
                    and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")):
                taken[op] = op.py_kernels.pop(DispatchKey.Meta)
                op._dispatch_cache.clear()

    def restore() -> None:
        for op, kernel in taken.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()

    stack.callback(restore)


def _no_kernel(*args: Any) -> None:
    return None


@contextlib.contextmanager
def compiled_regions(device_type: str, names: dict[int, str] | None = None) -> Iterator[CompiledRegions]:
    """For one capture: record the compiled regions entered and compile them as the module
    docstring says. Everything patched is restored on exit. Dynamo and inductor (2 s to import)
    are loaded only when the process uses them: if ``torch.compile`` has not been called yet,
    the patches go in at its first call during the capture."""
    global _ACTIVE
    state = CompiledRegions(device_type, names)
    with contextlib.ExitStack() as stack:
        previous, _ACTIVE = _ACTIVE, state
        stack.callback(_restore_active, previous)
        if "torch._dynamo" in sys.modules:
            _install(stack, state)
        else:
            original_compile = torch.compile
            installed: list[bool] = []

            @functools.wraps(original_compile)
            def compile(*args: Any, **kwargs: Any) -> Any:
                if not installed:
                    installed.append(True)
                    _install(stack, state)
                return original_compile(*args, **kwargs)

            torch.compile = compile
            stack.callback(setattr, torch, "compile", original_compile)
        yield state


def _install(stack: contextlib.ExitStack, state: CompiledRegions) -> None:
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
        elif isinstance(getattr(fn, "__self__", None), torch.optim.Optimizer):
            # Dynamo creates an optimizer's state while it traces the step, with the capture's
            # mode off (it would be missed), and the step's hooks, which file the gradients
            # and the state, are compiled away: the step runs eagerly instead.
            state.eager(region, "a compiled optimizer step runs eagerly in a capture (dynamo makes its "
                                "state unseen, while tracing): its temporaries are the eager step's")
            return None
        return chosen

    eval_frame._callback_from_stance = callback_from_stance
    stack.callback(setattr, eval_frame, "_callback_from_stance", original_lookup)
    _install_compile(stack, state)


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


def _private_wrapper_modules(stack: contextlib.ExitStack) -> None:
    """Every Python module inductor loads during the capture is a fresh one, neither taken from
    nor left in its cache of modules by source file (``PyCodeCache.modules_no_attr``) or in
    ``sys.modules``. The capture rebinds a wrapper's globals (buffers on meta, kernels no-ops),
    and a capture's compile can generate the very source a real compile of the same graph did:
    sharing the module would make the user's real compiled model allocate on meta and run no
    kernels, silently, from then on (or a later real compile load the capture's module)."""
    from torch._inductor.codecache import PyCodeCache

    original = PyCodeCache.load_by_key_path.__func__  # type: ignore[attr-defined]

    def load_by_key_path(cls: Any, key: str, path: str, linemap: Any = None, attrs: Any = None, *,
                         set_sys_modules: bool | None = None) -> Any:
        # (torch caches only when attrs is None: an empty dict loads afresh and caches nothing)
        return original(cls, key, path, linemap, {} if attrs is None else attrs, set_sys_modules=False)

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)  # type: ignore[method-assign,assignment]
    stack.callback(setattr, PyCodeCache, "load_by_key_path", classmethod(original))


def _install_compile(stack: contextlib.ExitStack, state: CompiledRegions) -> None:
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    original_compile = compile_fx_module.compile_fx
    real_inner = compile_fx_module.compile_fx_inner

    def compile_fx(model: Any, example_inputs: Sequence[Any], inner_compile: Any = None, **kwargs: Any) -> Any:
        if getattr(inner_compile, "vramkit_meta", False):
            # compile_fx calls itself (after applying config patches, for subgraphs): ours already
            return original_compile(model, example_inputs, inner_compile=inner_compile, **kwargs)
        region = state.current
        if region is None:  # (a compile outside any region entry we saw: name it by its graph)
            region = state.enter(model, "inductor")
        # Autotuning would time kernels, which here do nothing; CUDA graphs do not exist on meta.
        asked = kwargs.pop("config_patches", None) or {}
        if asked.get("triton.cudagraphs", inductor_config.triton.cudagraphs):
            state.without_cuda_graphs(region)
        patches = {**asked, "max_autotune": False,
                   "max_autotune_gemm": False, "coordinate_descent_tuning": False, "freezing": False,
                   "triton.cudagraphs": False}
        if state.device_type == "cpu":  # a real compile; its failure is the step's, as without a capture
            with _no_function_modes():
                return original_compile(model, example_inputs, inner_compile=_inner_cpu(region, real_inner),
                                        config_patches=patches, **kwargs)
        # The whole compile sees CPU tensors (see the module docstring); the graph as dynamo
        # made it is kept for the eager fallback.
        try:
            graph = copy.deepcopy(model)
        except Exception:  # noqa: BLE001 -- (then the fallback runs the graph as the compile left it)
            graph = model
        changed = _relabel([*example_inputs, *_graph_fakes(model)], _META, _CPU)
        _move_devices(model, _META, _CPU)
        try:
            with _no_function_modes(), _fakes_on_cpu(changed):
                return original_compile(model, example_inputs, inner_compile=_inner(region, real_inner),
                                        config_patches=patches, **kwargs)
        except _dynamo_control():
            raise
        except Exception as exc:
            state.eager(region, f"inductor could not compile it ({type(exc).__name__}: {str(exc)[:200]}): "
                                "it ran as dynamo's graph, op by op")
            _move_devices(graph, _CPU, _META)
            return _counted(graph.forward, region)
        finally:
            _relabel(changed, _CPU, _META)

    compile_fx_module.compile_fx = compile_fx  # type: ignore[assignment]  # (its signature, widened)
    stack.callback(setattr, compile_fx_module, "compile_fx", original_compile)
    _private_wrapper_modules(stack)
    if state.device_type == "meta":
        _composite_meta_kernels(stack)
        # Kernels are never compiled (no C++ compiler run) nor run: on meta they have nothing to do.
        for name in ("cpp", "cpp_pybinding"):
            stack.callback(setattr, AsyncCompile, name, getattr(AsyncCompile, name))
        AsyncCompile.cpp = lambda self, source_code: _no_kernel  # type: ignore[method-assign]
        AsyncCompile.cpp_pybinding = lambda self, argtypes, source_code: _no_kernel  # type: ignore[method-assign]
    # No cache in or out: a cached artifact would skip the wrapper patch above, and one made
    # here must never serve a real run. Static shapes, as a training run at one batch size
    # compiles them; recompiles for other batch sizes stay within a raised limit.
    stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                              compile_threads=1))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False))
    stack.enter_context(dynamo_config.patch(automatic_dynamic_shapes=False,
                                            recompile_limit=max(64, dynamo_config.recompile_limit)))
