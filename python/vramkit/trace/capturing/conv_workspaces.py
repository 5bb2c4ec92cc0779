"""cuDNN's workspaces in a meta capture (``CudaChoices.workspaces``): convolutions' here, and
attention backward's (``cudnn_attention``) through the same handler.

On a GPU each convolution runs through cuDNN, which asks for a workspace; PyTorch takes it from
the caching allocator (``Conv_v8.cpp``'s ``run_conv_plan``: ``at::empty({workspace_size},
kByte)``) and frees it when the kernel has been queued. So the allocator's history has, right
after a convolution's output, one more block of bytes, freed at once; in the backward, one after
``grad_input`` (backward-data) and one after ``grad_weight`` (backward-weight), in that order.
A meta capture runs no cuDNN and sees none of them: they cost nothing allocated at the peak
(each lives only inside its op), but the segments they open count in the peak *reserved*.

From PyTorch's source (facts, not calibration):

* the workspace goes through the caching allocator and lives for the one op;
* with ``torch.backends.cudnn.benchmark`` off (the default) the plan is cuDNN's heuristics'
  first choice (``CUDNN_HEUR_MODE_INSTANT``); PyTorch tries the next plan only when one fails
  (an out-of-memory workspace among them); the plan is cached per shape, so every later call of
  a shape takes the same workspace (the H100 history's two steps are identical);
* fp32 convolutions may use TF32 tensor cores (``cudnn.allow_tf32`` defaults to True) on
  Ampere and later;
* depthwise convolutions in fp32/fp64 run PyTorch's own kernels, not cuDNN's
  (``ConvUtils``: ``use_cudnn_depthwise`` wants fp16/bf16): no workspace;
* ``CUDNN_CONV_WSCAP_DBG`` (MiB) caps every workspace; it is honoured here.

What cuDNN's heuristics choose is not in any source; the sizes below are read off a real H100
history (``shared/gpu-histories/h100-2026-11-27/resnet50_fp32_b64_sgd.pickle``: torchvision's
ResNet-50, batch 64, 224x224, fp32, torch 2.11 + cuDNN 9, sm_90), in which they follow the
tensors' bytes closely:

* **layout copies.** Most workspaces are, to within 147 bytes, ``input + output (+ weight)``:
  the NCHW tensors copied into NHWC for the tensor-core engines (the weight too when the kernel
  is larger than 1x1). Forward, backward-data and backward-weight alike. Inference from the
  sizes: a ``channels_last`` input needs no copy, and is given none here (not measured).
* **plain GEMMs.** A 1x1, stride-1, unpadded convolution over at least ``GEMM_MIN_POSITIONS``
  output positions per image is a GEMM on NCHW: forward and backward-data take no workspace
  (0 or 400 bytes seen), backward-weight ``SPLIT_K`` fp32 partial copies of the weight
  gradient, when that is at most ``SPLIT_K_MAX``; else it takes the layout copies.
* **backward-weight scratch.** Backward-weight with the layout copies takes more: 15 fp32
  copies of the weight gradient for the small weights (64x64 and 128x128 3x3, exactly to within
  700 bytes), and 8.0 to 9.0 MiB for most larger ones (``WGRAD_SCRATCH_MAX``; 0 to 19 MiB seen).

Per architecture: the history is sm_90's. The layout copies are what the tensor-core (TF32,
fp16, bf16) engines of Ampere and later need; on older GPUs fp32 convolutions have no tensor
cores and the classic NCHW algorithms run: there only ``WGRAD_SCRATCH``-like scratch is
assumed (an estimate without a measurement). ResNet-50's history: 158 workspaces a step, each
modelled to within 10 MiB but one (layer2.0's strided 1x1 forward: 206 MB real, 308 MB
modelled); the step's reserved peak comes within 0.4 % (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import cudnn_attention
from .recorder import CATEGORY_INDEX, Recorder, storage_of

__all__ = ["ESTIMATE", "ConvWorkspaces", "OP_NAME", "workspace_bytes"]

MiB = 1 << 20
# Calibrated on the H100 ResNet-50 history (module docstring):
GEMM_MIN_POSITIONS = 128  # 1x1 convolutions over 14x14 ran as GEMMs, over 7x7 with layout copies
SPLIT_K = 64  # backward-weight of a GEMM convolution: 64 x the weight gradient, exactly, in fp32
SPLIT_K_MAX = 64 * MiB  # the largest such workspace seen (a 1024x256 weight); 128 MiB took copies
WGRAD_PARTIALS = 15  # backward-weight beside the layout copies: 15 fp32 weight gradients ...
WGRAD_SCRATCH_MAX = 9 * MiB  # ... at most 9 MiB (seen: 0 to 19 MiB, mostly 8.0-9.0 MiB)

OP_NAME = "cudnn workspace (estimated)"  # the op the trace names a workspace after
ESTIMATE = (f"allocations named {OP_NAME!r} are modelled from the convolutions' shapes "
            "(vramkit.trace.capturing.conv_workspaces), calibrated on one H100 history: estimates, "
            "not cuDNN's own sizes")
_FORWARD = torch.ops.aten.convolution.default
_BACKWARD = torch.ops.aten.convolution_backward.default


def workspace_bytes(kind: str, input_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                    output_shape: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                    groups: int, transposed: bool, dtype: torch.dtype, arch: tuple[int, int],
                    channels_last: bool = False) -> int:
    """The modelled cuDNN workspace of one convolution: `kind` "forward", "backward_data" or
    "backward_weight"; shapes of the forward convolution's input, weight and output (for a
    transposed convolution, as it is called); the GPU's compute capability."""
    if kind not in ("forward", "backward_data", "backward_weight"):
        raise ValueError(f"kind must be forward, backward_data or backward_weight, got {kind!r}")
    size = torch.empty((), dtype=dtype).element_size()
    n_in, n_w, n_out = math.prod(input_shape), math.prod(weight_shape), math.prod(output_shape)
    if not (n_in and n_w and n_out):
        return 0  # PyTorch runs no kernel on an empty tensor
    cin = input_shape[1] if len(input_shape) > 1 else 1
    if groups > 1 and groups == cin and dtype in (torch.float32, torch.float64):
        return 0  # depthwise: PyTorch's own kernels
    in_bytes, w_bytes, out_bytes = n_in * size, n_w * size, n_out * size
    kernel = math.prod(weight_shape[2:])
    # a transposed convolution is a backward-data over its input's positions
    positions = math.prod((input_shape if transposed else output_shape)[2:])
    pointwise = kernel == 1 and all(s == 1 for s in stride) and not any(padding)
    wgrad_gemm = SPLIT_K * n_w * 4
    tensor_cores = arch >= (8, 0) or dtype in (torch.float16, torch.bfloat16)
    if pointwise and groups == 1 and positions >= GEMM_MIN_POSITIONS:
        if kind != "backward_weight":
            return 0
        if wgrad_gemm <= SPLIT_K_MAX:
            return _capped(wgrad_gemm)
    copies = 0
    if tensor_cores and not channels_last:
        copies = in_bytes + out_bytes + (w_bytes if kernel > 1 else 0)
    if kind == "backward_weight":
        copies += min(WGRAD_PARTIALS * n_w * 4, WGRAD_SCRATCH_MAX)
    return _capped(copies)


def _capped(n: int) -> int:
    cap = os.environ.get("CUDNN_CONV_WSCAP_DBG", "")
    try:
        return min(n, int(cap) * MiB) if cap else n
    except ValueError:
        return n


class ConvWorkspaces:
    """The capture mode's handler of the convolution ops (``capture_step``): runs each op through
    `run_op` (the mode's own recording) and records the workspaces around it, a backward split
    into its backward-data, backward-weight and bias parts in the order cuDNN's path runs them."""

    ops = (_FORWARD, _BACKWARD, cudnn_attention.BACKWARD)

    def __init__(self, rec: Recorder, arch: tuple[int, int]) -> None:
        self.rec = rec
        self.arch = arch
        self.count = 0  # workspaces recorded
        self.attention_count = 0  # of them, cuDNN attention backward's

    def run(self, run_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any], func: Any,
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = func._schema  # (argument names, to read positional or keyword arguments alike)
        params = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                  for i, a in enumerate(bound.arguments)}
        if func is cudnn_attention.BACKWARD:
            grads = run_op(func, args, kwargs)
            if not any(isinstance(t, FakeTensor) for t in args[1:4]):  # (compiled regions choose their own)
                self.allocate_and_free(cudnn_attention.backward_workspace_bytes(*args[1:4]), cudnn_attention.OP_NAME)
                self.attention_count += 1
            return grads
        if func is _FORWARD:
            out = run_op(func, args, kwargs)
            self._conv_workspace("forward", params["input"], params["weight"], out, params)
            return out
        mask = list(params["output_mask"])
        if not (mask[0] or mask[1]):
            return run_op(func, args, kwargs)
        names = [a.name for a in bound.arguments]
        results: list[Any] = [None, None, None]
        # grad_output has the forward output's shape, grad_input the input's
        inp, weight, grad_out = params["input"], params["weight"], params["grad_output"]
        for k, kind in ((0, "backward_data"), (1, "backward_weight"), (2, "")):
            if not mask[k]:
                continue
            part = dict(params, output_mask=[j == k for j in range(3)])
            results[k] = run_op(func, tuple(part[n] for n in names), {})[k]
            if kind:
                self._conv_workspace(kind, inp, weight, grad_out, params)
        return tuple(results)

    def _conv_workspace(self, kind: str, inp: Any, weight: Any, out: Any, params: dict[str, Any]) -> None:
        if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (inp, weight, out)):
            return
        channels_last = inp.dim() in (4, 5) and not inp.is_contiguous() and inp.is_contiguous(
            memory_format=torch.channels_last if inp.dim() == 4 else torch.channels_last_3d)
        n = workspace_bytes(kind, tuple(inp.shape), tuple(weight.shape), tuple(out.shape), tuple(params["stride"]),
                            tuple(params["padding"]), int(params["groups"]), bool(params["transposed"]),
                            inp.dtype, self.arch, channels_last)
        if n:
            self.allocate_and_free(n)

    def allocate_and_free(self, n: int, op_name: str = OP_NAME) -> None:
        """One workspace of `n` bytes, allocated and freed at once (the mode is off here, so the
        recorder is told directly; the storage's finalizer records the free)."""
        t = torch.empty(n, dtype=torch.uint8, device="meta")
        st = storage_of(t)
        assert st is not None
        i = self.rec.new_storage(st, torch.uint8, op_name)
        self.rec.category[i] = CATEGORY_INDEX["workspace"]
        self.count += 1
        del t, st

    def describe(self) -> dict[str, Any]:
        """What ``trace.meta["estimated_bytes"]`` says of them."""
        # (the same at every batch size: derived traces need meta equal but for the batch size)
        described = {"cudnn_workspaces": ESTIMATE} if self.count > self.attention_count else {}
        if self.attention_count:
            described["cudnn_attention_workspaces"] = cudnn_attention.ESTIMATE
        return described
