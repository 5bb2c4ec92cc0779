"""The C walk over NumPy arrays (csrc/python/amp_numpy.c, ``arrays.cpu_unscale_fast`` and
``arrays.cpu_spans``): what it takes, what it leaves to the general walk, and that results
through it equal the general walk's and an independent NumPy reference, bit for bit (issue 35:
the NumPy-array intake cost as long as a 2 Mi-element unscale)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vramkit import _C, amp
from vramkit.amp import arrays as _arrays
from vramkit.amp.grads import _cpu_unscale

BITS = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}


def zoo(dtype, seed: int) -> list[np.ndarray]:
    """Dense (C and Fortran order, 0-d, empty), strided across several tiles and work items
    (a piece starting mid-array), rows of whole tiles, and size-1 dimensions, shuffled."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (rng.standard_normal(shape) * 100).astype(dtype)

    arrays = [r(64), r(8, 16)[:, ::2], np.asfortranarray(r(16, 9)), r(300, 512)[:, ::2], r(70, 2048)[:, :1024],
              r(3, 1000)[:, 1:999], r(1, 6, 1)[:, ::2], np.array(dtype(3.5)), r(0, 4), r(3, 5, 7)[:, 1:4, ::3], r(5)]
    return [arrays[i] for i in rng.permutation(len(arrays))]


def reference(a: np.ndarray, inv: float) -> np.ndarray:
    """The kernels' arithmetic in NumPy: float32 math for float16/float32, float64 for float64."""
    if a.dtype == np.float64:
        return a * np.float64(np.float32(inv))
    return (a.astype(np.float32) * np.float32(inv)).astype(a.dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("seed", range(4))
def test_every_layout_is_walked_in_c_and_matches_the_general_walk_bit_for_bit(dtype, seed):
    mine, general = zoo(dtype, seed), zoo(dtype, seed)
    want = [reference(a, 1 / 3) for a in mine]
    if seed % 2:
        big = [i for i, a in enumerate(mine) if a.shape == (300, 256)][0]
        for arrays in (mine, general):
            arrays[big][299, 255] = np.inf
    assert _C.amp_numpy_spans(mine) is not None  # all taken in C
    found = amp.unscale_(mine, 1 / 3)
    refs, _ = _arrays.describe_all(general)
    found_general, _ = _cpu_unscale(refs, 1 / 3, False)
    assert found is found_general is bool(seed % 2)
    for a, b, w in zip(mine, general, want):
        assert np.array_equal(a.view(BITS[dtype]), b.view(BITS[dtype]))
        if not seed % 2:
            assert np.array_equal(a.view(BITS[dtype]), w.view(BITS[dtype]))


def test_norm_and_scale_through_the_c_walk_match_float64():
    arrays = zoo(np.float32, 7)
    expect = math.sqrt(sum(float(((a.astype(np.float64) * 0.5) ** 2).sum()) for a in arrays))
    found, norm = amp.unscale_and_norm_(arrays, 0.5)
    assert found is False and norm == pytest.approx(expect, rel=1e-5)
    before = [a.copy() for a in arrays]
    amp.scale_(arrays, 2.0)
    for a, b in zip(arrays, before):
        assert np.array_equal(a, b * np.float32(2.0))  # x * 2 is exact


@pytest.mark.parametrize("why, arrays", [
    ("negative strides", [np.arange(8, dtype=np.float32)[::-1]]),
    ("bfloat16-like user dtype or other dtypes", [np.arange(4, dtype=np.int32)]),
    ("non-native byte order", [np.arange(4, dtype=">f4")]),
    ("a generator", (a for a in [np.ones(3, np.float32)])),
    ("an empty list", []),
    ("a torch-free mix with a float", [np.ones(3, np.float32), 1.0]),
])
def test_what_the_c_walk_leaves_to_the_general_walk(why, arrays):
    assert _C.amp_numpy_spans(arrays) is None if isinstance(arrays, list) else _arrays.cpu_spans(arrays) is None


def test_a_read_only_array_gets_the_general_walks_error_and_nothing_changes():
    a, ro = np.ones(4, np.float32), np.ones(4, np.float32)
    ro.flags.writeable = False
    assert _C.amp_numpy_spans([a, ro]) is None
    with pytest.raises(ValueError, match="tensor 1: the array is read-only"):
        amp.unscale_([a, ro], 0.5)
    assert np.array_equal(a, np.ones(4, np.float32))


def test_overlapping_views_are_refused_and_nothing_changes():
    base = np.arange(16, dtype=np.float32)
    before = base.copy()
    assert _C.amp_numpy_spans([base[:10], base[5:]]) is None
    with pytest.raises(ValueError):
        amp.unscale_([base[:10], base[5:]], 0.5)
    assert np.array_equal(base, before)
    # interleaved strided views count as their whole ranges, as the general walk counts them
    assert _C.amp_numpy_spans([base[0::2], base[1::2]]) is None


def test_misaligned_data_is_left_to_the_general_walk():
    raw = np.zeros(4 * 9 + 1, np.uint8)
    misaligned = np.frombuffer(raw.data, dtype=np.float32, count=9, offset=1)
    assert _C.amp_numpy_spans([misaligned]) is None
