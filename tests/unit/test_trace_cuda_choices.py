"""CUDA's dispatch choices on meta (vramkit.trace.capturing.cuda_choices, sdpa_rules): each choice is
checked against a CPU run that makes the same choice itself, event for event, and the
attention rules against cases read from sdp_utils.cpp."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import vramkit.trace as vt  # noqa: E402
from vramkit.trace.capturing.cuda_choices import CudaChoices  # noqa: E402
from vramkit.trace.capturing.sdpa_rules import cuda_backend  # noqa: E402

SAME = ("kind", "id", "size", "alloc_dtype", "alloc_op", "alloc_module")


def assert_same_events(a: vt.Trace, b: vt.Trace) -> None:
    for col in SAME:
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert (a.dtypes, a.modules, a.ops) == (b.dtypes, b.modules, b.ops)


class NativeDropout(nn.Module):
    """What CUDA runs for nn.Dropout, written out: the fused kernel with its bool mask."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0]


def mlp_builder(dropout: type[nn.Module] | None = None, optimizer=None, inplace: bool = False):
    def build():
        torch.manual_seed(0)
        kind = dropout or nn.Dropout
        drop = kind(0.25) if not inplace else nn.Dropout(0.25, inplace=True)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), drop, nn.Linear(256, 64), kind(0.1))
        opt = (optimizer or (lambda params: torch.optim.AdamW(params, foreach=False)))(model.parameters())
        x = torch.randn(32, 64)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


ONLY_DROPOUT = CudaChoices(dropout=True, optimizer=False, attention=False)
ONLY_OPTIMIZER = CudaChoices(dropout=False, optimizer=True, attention=False)


def saved(t: vt.Trace) -> list[tuple[str, int]]:
    """What the forward saved for the backward: (dtype, bytes) of every activation."""
    act = vt.CATEGORIES.index("activation")
    return sorted((t.name_of("dtypes", int(t.alloc_dtype[i])), int(t.alloc_size[i])) for i in range(t.num_allocations)
                  if t.alloc_category[i] == act)


def test_dropout_is_the_fused_kernel_with_a_bool_mask():
    meta = vt.capture(mlp_builder(), device="meta", steps=2, cuda=ONLY_DROPOUT)
    cpu = vt.capture(mlp_builder(NativeDropout), device="cpu", steps=2)
    # The CPU's native_dropout is composite (a bool mask by empty_like + bernoulli_, the output
    # by mul; its backward two muls), CUDA's one fused kernel each way: the events differ in
    # ops and order, not in what the forward saves.
    assert saved(meta) == saved(cpu)
    assert sorted(meta.alloc_size.tolist()) != [] and meta.num_allocations <= cpu.num_allocations
    masks = [i for i in range(meta.num_allocations) if meta.name_of("ops", int(meta.alloc_op[i])) == "aten::native_dropout"
             and meta.name_of("dtypes", int(meta.alloc_dtype[i])) == "bool"]
    assert masks and {int(meta.alloc_size[i]) for i in masks} == {32 * 256, 32 * 64}  # 1 byte an element
    # Off, meta keeps the noise path the CPU takes: a float32 noise tensor per dropout.
    off = vt.capture(mlp_builder(), device="meta", steps=2, cuda=False)
    assert_same_events(off, vt.capture(mlp_builder(), device="cpu", steps=2))
    # float32 noise (4 bytes an element) saved where CUDA saves a bool mask (1 byte).
    assert sum(n for _, n in saved(off)) - sum(n for _, n in saved(meta)) == 2 * 3 * (32 * 256 + 32 * 64)  # 2 steps


def test_in_place_dropout_keeps_the_noise_path_as_on_cuda():
    meta = vt.capture(mlp_builder(inplace=True), device="meta", steps=1, cuda=ONLY_DROPOUT)
    ops = {meta.name_of("ops", int(i)) for i in meta.alloc_op}
    assert "aten::bernoulli" in ops or "aten::empty_like" in ops  # dropout_: noise, on CUDA too
    # ... while the out-of-place one at the end of the model is fused.
    assert "aten::native_dropout" in ops


@pytest.mark.parametrize("make, forced", [
    (lambda p: torch.optim.AdamW(p), lambda p: torch.optim.AdamW(p, foreach=True)),
    (lambda p: torch.optim.Adam(p, weight_decay=0.01), lambda p: torch.optim.Adam(p, weight_decay=0.01, foreach=True)),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True)),
    (lambda p: torch.optim.AdamW(p, fused=True), lambda p: torch.optim.AdamW(p, fused=True)),
], ids=["adamw", "adam-l2", "sgd-momentum", "adamw-fused"])
def test_optimizer_runs_the_implementation_cuda_defaults_to(make, forced):
    meta = vt.capture(mlp_builder(NativeDropout, make), device="meta", steps=3, cuda=ONLY_OPTIMIZER)
    cpu = vt.capture(mlp_builder(NativeDropout, forced), device="cpu", steps=3)
    assert_same_events(meta, cpu)


def test_foreach_adam_holds_a_sqrt_of_every_exp_avg_sq_at_once():
    meta = vt.capture(mlp_builder(NativeDropout, lambda p: torch.optim.AdamW(p)), device="meta", steps=2,
                      cuda=ONLY_OPTIMIZER)
    loop = vt.capture(mlp_builder(NativeDropout, lambda p: torch.optim.AdamW(p)), device="meta", steps=2, cuda=False)
    sqrt = [int(meta.alloc_size[i]) for i in range(meta.num_allocations)
            if meta.name_of("ops", int(meta.alloc_op[i])) == "aten::_foreach_sqrt"]
    params = [64 * 256 * 4, 256 * 4, 256 * 64 * 4, 64 * 4]
    assert sorted(sqrt) == sorted(params * 2)  # one list per step (two steps), every parameter's size
    assert "aten::_foreach_sqrt" not in {loop.name_of("ops", int(i)) for i in loop.alloc_op}


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3), fused=True),  # the tensor_lr overload
    lambda p: torch.optim.Adagrad(p, fused=True),
], ids=["sgd", "adam-tensor-lr", "adagrad"])
def test_fused_optimizers_without_a_meta_kernel_get_one_for_the_capture(make):
    """fused=True is the step's own choice: it runs on meta with CUDA's choices on or off."""
    build = mlp_builder(NativeDropout, make)
    cpu = vt.capture(build, device="cpu", steps=2)
    for cuda in (ONLY_OPTIMIZER, False):
        meta = vt.capture(build, device="meta", steps=2, cuda=cuda)
        # The steps, event for event (a tensor lr made from Python data in the setup is seen
        # at its first use on meta and on cpu at different points).
        fm, fc = (int(np.flatnonzero(t.kind == vt.STEP)[0]) for t in (meta, cpu))
        for col in ("kind", "size"):
            np.testing.assert_array_equal(getattr(meta, col)[fm:], getattr(cpu, col)[fc:], err_msg=col)
    for name in ("aten::_fused_sgd_", "aten::_fused_adagrad_", "aten::_fused_adam_.tensor_lr"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")  # removed after


CLIPPERS = {
    "norm": lambda params, foreach: torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach),
    "value": lambda params, foreach: torch.nn.utils.clip_grad_value_(params, 0.01, foreach=foreach),
    "total-norm-then-clip": lambda params, foreach: torch.nn.utils.clip_grads_with_norm_(
        params, 0.5, torch.nn.utils.get_total_norm([p.grad for p in params], foreach=foreach), foreach=foreach),
}


def clipping_builder(clip: str, foreach: bool | None):
    """A step that clips its gradients between the backward and the optimizer, as LLM recipes do."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, foreach=False)
        x = torch.randn(32, 64)

        def step():
            model(x).square().mean().backward()
            CLIPPERS[clip](params, foreach)
            opt.step()
            opt.zero_grad()

        return step

    return build


def clipping_allocations(t: vt.Trace) -> list[tuple[str, int]]:
    return sorted((op, int(t.alloc_size[i])) for i in range(t.num_allocations)
                  if "foreach_norm" in (op := t.name_of("ops", int(t.alloc_op[i]))) or op == "aten::stack")


@pytest.mark.parametrize("foreach", [True, None], ids=["foreach", "default"])
@pytest.mark.parametrize("clip", list(CLIPPERS))
def test_gradient_clipping_runs_on_meta_as_on_cpu_and_cuda(clip, foreach):
    """CUDA and CPU both clip with the foreach kernels (foreach=None picks them on both);
    on meta the capture takes the same path, so the meta capture equals a real CPU run's,
    event for event, whatever the CUDA choices, and foreach=True no longer raises."""
    cpu = vt.capture(clipping_builder(clip, foreach), device="cpu", steps=2)
    ops = {cpu.name_of("ops", int(i)) for i in cpu.alloc_op}
    if clip != "value":  # (clip_grad_value_'s foreach path allocates nothing: _foreach_clamp_ in place)
        assert "aten::_foreach_norm" in ops  # the reference itself took the foreach path
    for cuda in (False, True):
        meta = vt.capture(clipping_builder(clip, foreach), device="meta", steps=2, cuda=cuda)
        if not cuda:
            assert_same_events(meta, cpu)
        else:  # the clipping's allocations, whatever the other choices changed
            assert clipping_allocations(meta) == clipping_allocations(cpu)
    from torch.utils import _foreach_utils
    assert "meta" not in _foreach_utils._get_foreach_kernels_supported_devices()  # removed after the capture
    with pytest.raises(RuntimeError, match="foreach API on meta"):  # and torch's own check is back
        p = nn.Parameter(torch.ones(2, device="meta"))
        p.grad = torch.ones(2, device="meta")
        torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)


# ---------------------------------------------------------------------------------- attention


def qkv(b=2, h=8, kv=None, L=128, S=None, d=64, dtype=torch.bfloat16):
    S = S or L
    q = torch.empty(b, h, L, d, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(b, kv or h, S, d, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty(b, kv or h, S, d, dtype=dtype, device="meta", requires_grad=True)
    return q, k, v


H100, A100, L4, T4, V100 = (9, 0), (8, 0), (8, 9), (7, 5), (7, 0)
MASK = torch.empty(128, 128, device="meta")


@pytest.mark.parametrize("case, arch, kwargs, expected", [
    ("bf16 causal", H100, {}, "flash"),
    ("fp16 on an A100", A100, {"dtype": torch.float16}, "flash"),
    ("fp32: flash takes fp16/bf16 only", H100, {"dtype": torch.float32}, "efficient"),
    ("bf16 with a mask: flash takes none", H100, {"mask": MASK}, "efficient"),
    ("GQA with enable_gqa", H100, {"kv": 2, "gqa": True}, "flash"),
    ("GQA without enable_gqa: head counts differ", H100, {"kv": 2}, "math"),
    # efficient's dense constraints take no grouped-query heads (seen on an H200: fp32 GQA Llama ran math)
    ("fp32 GQA with enable_gqa: efficient takes no GQA", H100, {"kv": 2, "gqa": True, "dtype": torch.float32}, "math"),
    ("bf16 GQA with a mask: flash takes no mask, efficient no GQA", H100, {"kv": 2, "gqa": True, "mask": MASK},
     "math"),
    ("head size 512: flash stops at 256", H100, {"d": 512}, "efficient"),
    ("head size 200 with grad on sm89", L4, {"d": 200}, "efficient"),
    ("head size 200 with grad on sm90", H100, {"d": 200}, "flash"),
    ("head size 60: not a multiple of 8 for efficient", H100, {"d": 60, "mask": MASK}, "math"),
    ("causal with more queries than keys", H100, {"L": 128, "S": 64, "causal": True}, "efficient"),
    ("causal with fewer queries than keys", H100, {"L": 64, "S": 128, "causal": True}, "efficient"),
    ("bf16 on a T4: neither fused kernel", T4, {}, "math"),
    ("fp16 on a T4", T4, {"dtype": torch.float16}, "efficient"),
    ("fp32 on a V100", V100, {"dtype": torch.float32}, "efficient"),
])
def test_cuda_backend_rules(case, arch, kwargs, expected):
    kw = dict(kwargs)
    mask, gqa, causal = kw.pop("mask", None), kw.pop("gqa", False), kw.pop("causal", True)
    if mask is not None:
        causal = False
        mask = torch.empty(kw.get("L", 128), kw.get("S") or kw.get("L", 128), device="meta", dtype=kw.get("dtype", torch.bfloat16))
    q, k, v = qkv(**kw)
    assert cuda_backend(q, k, v, mask, 0.0, causal, gqa, arch, grad=True) == expected, case


def test_cuda_backend_honours_the_users_sdpa_kernel_choice():
    q, k, v = qkv()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert cuda_backend(q, k, v, None, 0.0, True, False, H100, grad=True) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_backend(q, k, v, None, 0.0, True, False, H100, grad=True) == "math"


class Attention(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def attention_builder(dtype=torch.float32, batch=2, seq=64):
    def build():
        torch.manual_seed(0)
        model = Attention().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        x = torch.randn(batch, seq, 128, dtype=dtype)

        def step():
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def saved_by(t: vt.Trace, op: str) -> list[tuple[str, int]]:
    return sorted((t.name_of("dtypes", int(t.alloc_dtype[i])), int(t.alloc_size[i])) for i in range(t.num_allocations)
                  if t.name_of("ops", int(t.alloc_op[i])) == op)


def test_flash_on_an_h100_allocates_the_output_and_a_float32_row_per_query():
    # cuDNN 9.10 (torch's CUDA 12 wheels): flash first (above 9.15.0 cuDNN's attention is)
    t = vt.capture(attention_builder(torch.bfloat16), device="meta", steps=1, cuda=CudaChoices(arch=H100, cudnn=91000))
    b, h, L, d = 2, 4, 64, 32
    assert saved_by(t, "aten::_scaled_dot_product_flash_attention") == sorted(
        [("bfloat16", b * h * L * d * 2), ("float32", b * h * L * 4), ("uint64", 2 * 8), ("uint64", 8)])
    ops = {t.name_of("ops", int(i)) for i in t.alloc_op}
    assert "aten::_safe_softmax" not in ops and "aten::bmm" not in ops  # no L x L matrix


def test_fp32_attention_takes_the_efficient_kernel_with_rows_padded_to_32():
    t = vt.capture(attention_builder(torch.float32, seq=40), device="meta", steps=1, cuda=CudaChoices(arch=A100))
    b, h, L, d = 2, 4, 40, 32
    lse = [s for dtype, s in saved_by(t, "aten::_scaled_dot_product_efficient_attention") if s == b * h * 64 * 4]
    assert lse  # log-sum-exp rows (B, H, ceil(40 / 32) * 32) float32
    assert ("float32", b * h * L * d * 4) in saved_by(t, "aten::_scaled_dot_product_efficient_attention")


def test_math_on_cuda_upcasts_half_precision_to_float32():
    t = vt.capture(attention_builder(torch.bfloat16), device="meta", steps=1, cuda=CudaChoices(arch=T4))
    b, h, L = 2, 4, 64
    softmax = saved_by(t, "aten::_safe_softmax")
    assert softmax == [("float32", b * h * L * L * 4)]  # the L x L matrix, in float32 on a GPU


def test_math_chosen_by_the_user_equals_the_cpu_math_path():
    with sdpa_kernel([SDPBackend.MATH]):
        meta = vt.capture(attention_builder(torch.float32), device="meta", steps=2, cuda=CudaChoices(arch=H100))
        cpu = vt.capture(attention_builder(torch.float32), device="cpu", steps=2)
    assert_same_events(meta, cpu)


def test_cuda_choices_bad_input():
    with pytest.raises(ValueError, match="compute capability"):
        CudaChoices(arch=(9,))
    with pytest.raises(TypeError, match="True or False"):
        CudaChoices(dropout=1)
    with pytest.raises(TypeError, match="CudaChoices"):
        vt.capture(mlp_builder(), device="meta", cuda="yes")


def wide_mlp_builder(foreach=None):
    """Weights dominate (16 layers of 1 MiB), activations are small: foreach Adam's copy of every
    exp_avg_sq (16 MiB) decides whether the step fits, where the loop holds two layers' worth."""
    def build(batch_size):
        model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(16)))
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        x = torch.randn(batch_size, 512)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def test_fit_suggests_the_optimizers_loop_when_foreach_is_what_does_not_fit():
    loop = vt.replay(vt.capture(wide_mlp_builder(foreach=False), 2, device="meta", steps=2), "1GiB",
                     overheads=vt.NO_OVERHEADS)
    default = vt.replay(vt.capture(wide_mlp_builder(), 2, device="meta", steps=2), "1GiB", overheads=vt.NO_OVERHEADS)
    # foreach holds a temporary for all 16 layers at once; the loop one or two layers at a time.
    assert default.peak_allocated - loop.peak_allocated >= 12 * 512 * 512 * 4
    capacity = (loop.peak_reserved + default.peak_reserved) // 2
    report = vt.fit(wide_mlp_builder(), capacity, batch_size=2, search=False, overheads=vt.NO_OVERHEADS)
    assert not report.target.fits
    first = report.suggestions[0]
    assert first.settings == {"foreach": False} and "foreach=False" in first.change
    assert first.prediction.fits and first.prediction.peak_allocated == loop.peak_allocated  # as if written so
