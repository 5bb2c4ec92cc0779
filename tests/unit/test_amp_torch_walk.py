"""The C walk over plain torch tensors (csrc/python/amp_torch.c, ``arrays.torch_spans``): what
it takes, what it leaves to the general walk, and that results through it are torch's, bit for
bit (issue 35: the loss-scaling host path at torch's cost)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import vramkit.amp as va  # noqa: E402
from vramkit.amp import arrays as _arrays  # noqa: E402

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def mixed_layouts(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 100).to(dtype)

    return [r(64), r(8, 16)[:, ::2], r(16, 8).t(), r(3, 5, 7)[:, 1:4, ::3], r(2, 3, 4, 5).permute(0, 2, 3, 1),
            r(4, 4)[1], r(())]


def test_plain_dense_tensors_are_walked_in_c():
    grads = [torch.randn(5), torch.randn(3, 2, dtype=torch.float16), torch.randn(4, dtype=torch.bfloat16)]
    spans, device, dtype_bits = _arrays.torch_spans(grads)
    assert device == "cpu"
    assert dtype_bits == (1 << _arrays.FLOAT32) | (1 << _arrays.FLOAT16) | (1 << _arrays.BFLOAT16)
    assert _arrays.torch_spans(tuple(grads)) is not None


@pytest.mark.parametrize("why, grads", [
    ("a Parameter (a subclass)", lambda: [torch.nn.Parameter(torch.randn(3))]),
    ("an integer tensor", lambda: [torch.randn(3), torch.arange(3)]),
    ("a sparse tensor", lambda: [torch.randn(3, 3).to_sparse()]),
    ("not a tensor", lambda: [torch.randn(3), np.zeros(3, np.float32)]),
    ("an expanded tensor (stride 0)", lambda: [torch.randn(3, 1).expand(3, 4)]),
    ("an empty list", lambda: []),
    ("a meta tensor (its data pointer is NULL)", lambda: [torch.empty(3, device="meta")]),
    ("a CPU and a meta tensor", lambda: [torch.ones(3), torch.empty(3, device="meta")]),
    ("a generator", lambda: (t for t in [torch.randn(3)])),
])
def test_what_the_c_walk_leaves_to_the_general_walk(why, grads):
    assert _arrays.torch_spans(grads()) is None, why


def test_overlapping_tensors_are_refused_by_the_general_walk_and_nothing_changes():
    base = torch.randn(10)
    a, b = base[:6], base[4:]
    assert _arrays.torch_spans([a, b]) is None
    before = base.clone()
    with pytest.raises(ValueError, match="overlaps"):
        va.non_finite_check_and_unscale_([a, b], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(base, before)
    # interleaved strided views of one buffer count as their whole ranges, as the general walk counts them
    even, odd = base[0::2], base[1::2]
    assert _arrays.torch_spans([even, odd]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_dense_and_strided_results_are_torchs_bit_for_bit(dtype, poison):
    mine, theirs = mixed_layouts(dtype), mixed_layouts(dtype)
    if poison is not None:
        mine[1][2, 1] = poison
        theirs[1][2, 1] = poison
    spans = _arrays.torch_spans(mine)
    assert spans is not None  # every layout here is taken in C: dense, strided, transposed, permuted
    f_mine, f_theirs = torch.zeros(1), torch.zeros(1)
    inv = torch.full((1,), 1 / 3)
    va.non_finite_check_and_unscale_(mine, f_mine, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
    assert f_mine.item() == f_theirs.item() == (0.0 if poison is None else 1.0)
    for x, y in zip(mine, theirs):
        assert torch.equal(x.contiguous().view(BITS[dtype]), y.contiguous().view(BITS[dtype]))


def layout_zoo(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every layout the C walk and the strided kernel tell apart, shuffled, so that the walk's
    guess (after a strided tensor, read the shape and strides first) meets each kind after each
    kind: dense, strided of a few elements, strided across several tiles and several work items
    (more than VRAM_AMP_CHUNK = 65,536 elements, so a piece starts mid-tensor), rows of whole
    tiles run in place, channels-last, size-1 dimensions, 0-d and empty tensors."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 100).to(dtype)

    zoo = [r(64), r(8, 16)[:, ::2], r(16, 8).t(), r(300, 512)[:, ::2], r(70, 2048)[:, :1024],
           r(3, 1000)[:, 1:999], r(2, 3, 5, 5).contiguous(memory_format=torch.channels_last),
           r(1, 6, 1)[:, ::2], r(()), r(0, 4), r(4, 0)[:, ::2], r(3, 5, 7)[:, 1:4, ::3], r(5)]
    order = torch.randperm(len(zoo), generator=g).tolist()
    return [zoo[i] for i in order] + [zoo[i] for i in order[::-1]][:4]  # four again, cloned by the callers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_every_layout_in_every_order_is_torchs_bit_for_bit(dtype, seed):
    mine, theirs = layout_zoo(dtype, seed), layout_zoo(dtype, seed)
    # (the tail repeats four tensors: make them copies, or they would be unscaled twice)
    for grads in (mine, theirs):
        grads[-4:] = [x.clone() for x in grads[-4:]]
    assert _arrays.torch_spans(mine) is not None  # all taken in C
    if seed % 2:  # a poisoned element in the largest strided tensor, past its first work item
        big = [i for i, x in enumerate(mine) if x.shape == (300, 256)][0]
        mine[big][299, 255] = float("inf")
        theirs[big][299, 255] = float("inf")
    f_mine, f_theirs = torch.zeros(1), torch.zeros(1)
    inv = torch.full((1,), 1 / 3)
    va.non_finite_check_and_unscale_(mine, f_mine, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
    assert f_mine.item() == f_theirs.item() == float(seed % 2)
    for x, y in zip(mine, theirs):
        assert torch.equal(x.contiguous().view(BITS[dtype]), y.contiguous().view(BITS[dtype]))


def test_the_sum_of_squares_over_every_layout_matches_float64():
    grads = layout_zoo(torch.float32, seed=11)
    grads[-4:] = [x.clone() for x in grads[-4:]]
    reference = [g.double() * 0.5 for g in grads]
    found, sumsq, _ = _arrays.torch_unscale_cpu(grads, 0.5, True)
    assert found is False
    assert sumsq == pytest.approx(sum(float((r ** 2).sum()) for r in reference), rel=1e-5)
    for g, r in zip(grads, reference):
        assert torch.equal(g, r.float())  # x * 0.5 is exact


def test_grad_scaler_through_the_c_walk_matches_torchs_and_its_norm():
    """unscale_and_clip_ sums squares over dense and strided gradients through the walk; the
    norm equals a float64 NumPy reference, and the gradients torch's unscale."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(8, 8)) for _ in range(3)]
    grads = [torch.randn(8, 8) * 64, torch.randn(8, 16)[:, ::2] * 64, torch.randn(8, 8).t() * 64]
    expected = [g.double() / 64 for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    assert _arrays.torch_spans([p.grad for p in params]) is not None
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = va.GradScaler("cpu", init_scale=64.0)
    scaler.scale(torch.ones(()))
    norm = scaler.unscale_and_clip_(opt, max_norm=1e9)
    reference = math.sqrt(sum(float((e ** 2).sum()) for e in expected))
    assert float(norm) == pytest.approx(reference, rel=1e-6)
    for p, e in zip(params, expected):
        assert torch.equal(p.grad, e.float())  # x / 64 is exact in float32


def test_bf16_gradients_through_the_c_walk_still_warn():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    scaler = va.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # (a float32 loss: no warning of its own)
    with pytest.warns(UserWarning, match="bfloat16"):
        scaler.unscale_(torch.optim.SGD([p], lr=0.0))


def test_one_call_cpu_unscale_sums_squares_over_dense_and_strided():
    grads = mixed_layouts(torch.float32, seed=3)
    reference = [g.double() * 0.25 for g in grads]
    found, sumsq, dtype_bits = _arrays.torch_unscale_cpu(grads, 0.25, True)
    assert found is False and dtype_bits == 1 << _arrays.FLOAT32
    assert sumsq == pytest.approx(sum(float((r ** 2).sum()) for r in reference), rel=1e-6)
    for g, r in zip(grads, reference):
        assert torch.equal(g, r.float())  # x * 0.25 is exact


def test_one_call_cpu_unscale_leaves_other_lists_untouched():
    p = torch.nn.Parameter(torch.full((3,), 4.0))
    assert _arrays.torch_unscale_cpu([torch.full((3,), 4.0), p], 0.5, False) is None
    assert torch.equal(p.detach(), torch.full((3,), 4.0))


def test_a_meta_tensor_gets_the_general_walks_error_not_a_crash():
    for grads in ([torch.empty(8, device="meta")], [torch.ones(2), torch.empty(8, device="meta")]):
        with pytest.raises(ValueError, match="meta"):
            va.non_finite_check_and_unscale_(grads, torch.zeros(1), torch.ones(1))
        assert _arrays.torch_unscale_cpu(grads, 1.0, False) is None


def test_bad_scalars_get_the_general_paths_errors_and_nothing_is_written():
    grads = [torch.full((4,), 8.0)]
    for found, inv, error in ((torch.zeros(1, dtype=torch.float64), torch.ones(1), TypeError),
                              (torch.zeros(2), torch.ones(1), TypeError),
                              (torch.zeros(1), torch.full((1,), 0.5, dtype=torch.float16), TypeError)):
        with pytest.raises(error, match="1-element float32"):
            va.non_finite_check_and_unscale_(grads, found, inv)
        assert torch.equal(grads[0], torch.full((4,), 8.0))
    # and a good call through the same one-call path sets found_inf, and only sets it
    found = torch.zeros(1)
    va.non_finite_check_and_unscale_([torch.tensor([1.0, float("inf")])], found, torch.ones(1))
    va.non_finite_check_and_unscale_([torch.ones(3)], found, torch.ones(1))
    assert found.item() == 1.0
