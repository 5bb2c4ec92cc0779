"""Inductor's compile of a capture's compiled regions (``compiled_regions`` installs it):
inductor's own memory decisions, on meta.

``torch._inductor.compile_fx.compile_fx`` runs as it does (AOTAutograd's joint graph with
inductor's decompositions and joint passes, inductor's min-cut partitioner, so what is saved for
the backward and what is recomputed are inductor's; then inductor's lowering, scheduler and
fusion of each forward and backward graph), with three changes. (1) The whole compile sees the
graph's fake tensors labelled ``cpu``, not ``meta``: on meta, inductor lowers every op to an
unfused fallback, its joint-graph passes replace meta outputs by empty tensors and register no
patterns, and AOTAutograd under the Python dispatcher skips the autograd of ``nll_loss`` (a
compiled cross-entropy then had no gradient). (2) Every C++ kernel is a no-op, never compiled.
(3) The generated Python wrapper runs on the real meta tensors, its ``empty_strided_cpu``
allocating on meta through the dispatcher. Run under the capture's mode, it records inductor's
own memory plan: its buffers (fused pointwise intermediates never exist), their reuse and their
``del``s. If a graph cannot be lowered, it runs op by op ("compiled" still, ``fused`` False: an
upper bound for the fused temporaries); if the compile fails, dynamo's graph runs eagerly
("eager upper bound").

The CPU lowering stands for the GPU's: on CUDA inductor fuses with Triton rather than C++ and
may choose other kernels (attention, matmul templates), and the capture's CUDA dispatch choices
(``cuda_choices``) do not reach inside a compiled graph, which takes the CPU's.

On a cpu capture the compile is inductor's real one (kernels compiled and run); only the
wrapper's ``empty_strided_cpu``, a C++ fast path the capture's mode would not see, allocates
through the dispatcher instead. Meta and cpu captures of a compiled step are then identical,
event for event, as they are for eager steps (with CUDA's dispatch choices off).

Dynamo and inductor are imported by ``install_compile`` alone, when a capture meets a compile.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Sequence

import torch

from .batch_sizes import batch_sizes_varying
from .compiled_regions import CompiledRegions, Region, counted

__all__ = ["install_compile"]

_META, _CPU = torch.device("meta"), torch.device("cpu")


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
        out.current_callable = counted(call, region, _symbolic(example_inputs))
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
        if call is None and callable(out) and not any(n.op == "call_function" for n in gm.graph.nodes):
            # A graph that computes nothing (inputs passed through, between a compiled
            # optimizer step's graph breaks): inductor returns it as it is; nothing to lower.
            run = counted(out, region, _symbolic(example_inputs))
            run._boxed_call = getattr(out, "_boxed_call", False)  # type: ignore[attr-defined]
            return run
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
        out.current_callable = counted(call, region, _symbolic(example_inputs))
        return out

    inner.vramkit_meta = True  # type: ignore[attr-defined]
    return inner


def _op_by_op(gm: Any, region: Region, why: str) -> Any:
    from torch._functorch._aot_autograd.utils import make_boxed_func

    region.fused = False
    region.why += f"; {why}, so it ran op by op, unfused (an upper bound for its temporaries)"
    _move_devices(gm, _CPU, _META)
    return make_boxed_func(counted(gm.forward, region))


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


def _symbolic(inputs: Sequence[Any]) -> bool:
    """Whether a graph's example inputs have symbolic sizes (dynamo compiled it with dynamic shapes)."""
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt)
                                                                                  for d in v.shape))
               for v in inputs)


def _no_kernel(*args: Any) -> None:
    return None


def install_compile(stack: contextlib.ExitStack, state: CompiledRegions) -> None:
    """Inductor's compile for the capture's regions, as the module docstring says; restored by
    `stack`."""
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
            return counted(graph.forward, region)
        finally:
            _relabel(changed, _CPU, _META)

    compile_fx_module.compile_fx = compile_fx  # type: ignore[assignment]  # (its signature, widened)
    stack.callback(setattr, compile_fx_module, "compile_fx", original_compile)
    if state.device_type == "meta":
        _composite_meta_kernels(stack)
        # Kernels are never compiled (no C++ compiler run) nor run: on meta they have nothing to do.
        for name in ("cpp", "cpp_pybinding"):
            stack.callback(setattr, AsyncCompile, name, getattr(AsyncCompile, name))
        AsyncCompile.cpp = lambda self, source_code: _no_kernel  # type: ignore[method-assign]
        AsyncCompile.cpp_pybinding = lambda self, argtypes, source_code: _no_kernel  # type: ignore[method-assign]
    # No cache in or out: a cached artifact would skip the wrapper patch above, and one made
    # here must never serve a real run. Static shapes, as a training run at one batch size
    # compiles them, except under ``batch_sizes_vary``; recompiles stay within a raised limit.
    stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                              compile_threads=1))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False))
    stack.enter_context(dynamo_config.patch(automatic_dynamic_shapes=batch_sizes_varying(),
                                            recompile_limit=max(64, dynamo_config.recompile_limit)))
