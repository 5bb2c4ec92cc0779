"""The fused loss-scaling kernels on the CPU, against independent references.

Reference arithmetic is NumPy's: widen to float32 (float64 stays float64), multiply by a
float32 inv_scale, round back with NumPy's (or ml_dtypes') round-to-nearest-even casts. Every
SIMD path this CPU supports is checked, bit for bit, with NaN positions compared as NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import vramkit
from vramkit import _C
from vramkit import amp

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - the test extra installs it
    BF16 = None

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)] + ([BF16] if BF16 is not None else [])
PATHS = [p for p in ("portable", "avx2", "avx512") if _C.simd_supported(p)]
SIZES = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1024, 1025, 65535, 65536, 65537, 300_001]


@pytest.fixture(params=PATHS)
def path(request):
    before = _C.simd_path()
    _C.set_simd_path(request.param)
    yield request.param
    _C.set_simd_path(before)


@pytest.fixture
def threads():
    before = amp.get_num_threads()
    yield amp.set_num_threads
    amp.set_num_threads(before)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def reference(a: np.ndarray, inv: float) -> tuple[np.ndarray, bool]:
    """(expected array, expected found_inf) computed with NumPy casts, independent of vramkit."""
    x = a.astype(np.float64 if a.dtype == np.float64 else np.float32)
    if inv == 1.0:
        out = a.copy()
    elif a.dtype == np.float64:
        out = x * np.float64(np.float32(inv))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            out = (x * np.float32(inv)).astype(a.dtype)
    found = bool((~np.isfinite(a.astype(np.float64))).any() or (~np.isfinite(out.astype(np.float64))).any())
    return out, found


def assert_same(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    g, w = got.astype(np.float64), want.astype(np.float64)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert (nan_g == nan_w).all(), f"{what}: NaN positions differ at {np.flatnonzero(nan_g != nan_w)[:5]}"
    diff = np.flatnonzero(bits(got)[~nan_g] != bits(want)[~nan_w])
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first {got[~nan_g][diff[:3]]} vs {want[~nan_w][diff[:3]]}"


def random_grads(rng, n: int, dtype: np.dtype, spread: float = 8.0) -> np.ndarray:
    """Values across many binades (including fp16 subnormals and near-overflow)."""
    mag = np.exp2(rng.uniform(-spread * 3, spread * 1.9, n))
    vals = (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    return vals.astype(dtype)


def inject(rng, a: np.ndarray, count: int) -> None:
    if a.size == 0:
        return
    where = rng.integers(0, a.size, count)
    a[where] = rng.choice(np.array([np.inf, -np.inf, np.nan], dtype=np.float32), count).astype(a.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("inv", [0.5, 2.0 ** -16, 1.0, 3.0, 1e-30])
def test_unscale_matches_numpy_reference_for_every_size(path, dtype, inv):
    rng = np.random.default_rng(hash((path, dtype.name, inv)) % 2**32)
    for n in SIZES:
        for poison in (0, 3):
            a = random_grads(rng, n, dtype)
            inject(rng, a, poison if n else 0)
            want, want_found = reference(a, inv)
            found = amp.unscale_([a], inv)
            assert_same(a, want, f"{path} {dtype} n={n} inv={inv}")
            assert found == want_found, (n, poison)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_non_finite_at_first_last_and_tail_positions(path, dtype):
    rng = np.random.default_rng(7)
    for n in (1, 8, 17, 1025, 65537):
        for pos in {0, n - 1, n // 2, max(0, n - 3)}:
            for bad in (np.inf, -np.inf, np.nan):
                a = random_grads(rng, n, dtype, spread=2.0)
                a[pos] = bad
                assert amp.unscale_([a], 0.25) is True, (n, pos, bad)
                assert np.isnan(a[pos]) if np.isnan(bad) else a[pos] == bad
                clean = random_grads(rng, n, dtype, spread=2.0)
                assert amp.unscale_([clean], 0.25) is False


def test_mixed_lists_of_1_to_500_tensors_with_misaligned_starts(path):
    rng = np.random.default_rng(11)
    for count in (1, 2, 37, 500):
        arrays, views, wants, want_found = [], [], [], False
        for i in range(count):
            dtype = DTYPES[rng.integers(len(DTYPES))]
            n = int(rng.integers(0, 5000)) if i % 50 else int(rng.integers(0, 200_000))
            base = random_grads(rng, n + 1, dtype)
            if rng.random() < 0.05:
                inject(rng, base, 1)
            view = base[1:]  # starts one element past an aligned address
            w, f = reference(view, 1 / 1024)
            arrays.append(base)
            views.append(view)
            wants.append(w)
            want_found |= f
        found = amp.unscale_(views, 1 / 1024)
        assert found == want_found
        for i, (v, w) in enumerate(zip(views, wants)):
            assert_same(v, w, f"list of {count}, tensor {i}")


def test_inv_scale_one_writes_nothing():
    # A signalling-NaN payload would be quieted by any write; with inv_scale == 1 it must survive.
    a = np.full(1000, 1.5, dtype=np.float16)
    a.view(np.uint16)[[3, 999]] = 0x7D01
    before = a.view(np.uint16).copy()
    assert amp.unscale_([a], 1.0) is True
    assert (a.view(np.uint16) == before).all()
    b = np.full(4097, -2.0, dtype=np.float32)
    b.view(np.uint32)[4096] = 0x7F800001
    assert amp.unscale_([b], 1.0) is True
    assert b.view(np.uint32)[4096] == 0x7F800001


def test_finite_values_that_overflow_when_unscaled_count_as_inf():
    a = np.array([1.0, 60000.0, -3.0], dtype=np.float16)
    assert amp.unscale_([a], 2.0) is True  # 120000 does not fit in float16
    assert np.isinf(a[1]) and a[0] == 2.0 and a[2] == -6.0
    b = np.array([3e38, 1.0], dtype=np.float32)
    assert amp.unscale_([b], 4.0) is True


@pytest.mark.slow
def test_tens_of_millions_of_elements_multithreaded(threads):
    rng = np.random.default_rng(5)
    a = random_grads(rng, 24_000_003, np.dtype(np.float16), spread=3.0)
    want, _ = reference(a, 1 / 512)
    threads(max(2, amp.get_num_threads()))
    assert amp.unscale_([a], 1 / 512) is False
    assert_same(a, want, "24M float16")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_sum_of_squares_matches_float64_and_does_not_depend_on_threads(path, dtype, threads):
    rng = np.random.default_rng(3)
    grads = [random_grads(rng, n, dtype, spread=1.5) for n in (300_000, 5, 70_001, 1024, 0, 150_000)]
    copies = [g.copy() for g in grads]
    results = []
    for t in (1, 2, 3, 8):
        threads(t)
        work = [g.copy() for g in copies]
        found, norm = amp.unscale_and_norm_(work, 0.125)
        results.append(norm)
        assert found is False
    expect = [reference(g, 0.125)[0].astype(np.float64) for g in grads]
    exact = np.sqrt(sum(float(np.dot(e, e)) for e in expect))
    assert results[0] == pytest.approx(exact, rel=1e-5)
    assert len(set(results)) == 1, f"norm changed with the thread count: {results}"


def test_parallel_pass_is_bit_identical_to_single_thread(threads):
    rng = np.random.default_rng(9)
    grads = [random_grads(rng, n, DTYPES[i % len(DTYPES)]) for i, n in enumerate([400_000, 333_333, 70_000, 9])]
    single = [g.copy() for g in grads]
    threads(1)
    f1 = amp.unscale_(single, 1 / 3)
    threads(4)
    f4 = amp.unscale_(grads, 1 / 3)
    assert f1 == f4
    for a, b in zip(grads, single):
        assert (bits(a) == bits(b)).all()


def test_scale_inplace_matches_reference():
    rng = np.random.default_rng(2)
    grads = [random_grads(rng, n, d, spread=2.0) for n, d in zip((1000, 77, 65537), DTYPES)]
    wants = [reference(g, 0.7)[0] for g in grads]
    amp.scale_(grads, 0.7)
    for g, w in zip(grads, wants):
        assert_same(g, w)


# ---- array intake ----------------------------------------------------------------------------------

def test_bad_inputs_raise_naming_the_index_and_change_nothing():
    good = np.ones(100, dtype=np.float32)
    cases = [
        (np.ones(10, dtype=np.int32), TypeError, "tensor 1: dtype int32"),
        # strided views are unscaled in place, but not ones whose elements overlap
        (np.lib.stride_tricks.as_strided(np.ones(4, dtype=np.float32), (3, 3), (4, 4)), ValueError,
         "tensor 1: elements overlap in memory"),
        (np.lib.stride_tricks.as_strided(np.ones(8, dtype=np.float32), (3,), (6,)), ValueError,
         "tensor 1: strides \\(6,\\) bytes are not multiples"),
        ([1.0, 2.0], TypeError, "tensor 1: builtins.list is not an array"),
        (np.complex64(1), TypeError, "tensor 1"),
    ]
    ro = np.ones(5, dtype=np.float16)
    ro.flags.writeable = False
    cases.append((ro, ValueError, "tensor 1: the array is read-only"))
    for bad, exc, text in cases:
        with pytest.raises(exc, match=text):
            amp.unscale_([good, bad, good.copy()], 0.5)
        assert (good == 1.0).all()
    with pytest.raises(ValueError, match="tensor 1 overlaps tensor 0"):
        amp.unscale_([good, good[10:20]], 0.5)
    assert (good == 1.0).all()
    with pytest.raises(TypeError, match="grads must be a list"):
        amp.unscale_(good.tobytes(), 0.5)


def test_fortran_order_and_multidimensional_arrays_are_dense():
    a = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    amp.unscale_([a], 0.5)
    assert (a == np.arange(12, dtype=np.float32).reshape(3, 4) / 2).all()


def test_vramkit_buffers_are_accepted():
    buf = vramkit.empty((1000,), "float16", "cpu")
    view = np.asarray(buf)
    view[:] = np.linspace(-4, 4, 1000, dtype=np.float16)
    want, _ = reference(view.copy(), 0.5)
    assert amp.unscale_([buf], 0.5) is False
    assert_same(view, want)
    raw = vramkit.empty(64, device="cpu")  # bytes: no float dtype
    with pytest.raises(TypeError, match="tensor 0: a vramkit.Buffer of typestr"):
        amp.unscale_([raw], 0.5)


def test_kernel_argument_checks_from_c():
    with pytest.raises(TypeError, match="tensor 0: expected a"):
        _C.amp_unscale_check([(1, 2)], 0.5, False)
    with pytest.raises(ValueError, match="tensor 0: unknown dtype 9"):
        _C.amp_unscale_check([(64, 2, 9)], 0.5, False)
    with pytest.raises(ValueError, match="tensor 0: data .* is not aligned"):
        _C.amp_unscale_check([(65, 2, 0)], 0.5, False)
    with pytest.raises(ValueError, match="tensor 0: negative numel"):
        _C.amp_unscale_check([(64, -1, 0)], 0.5, False)
    with pytest.raises(ValueError, match="num_threads must be between 1 and 1024"):
        amp.set_num_threads(0)
    with pytest.raises(ValueError, match="unknown SIMD path 'sse9'"):
        _C.set_simd_path("sse9")


def test_cuda_entry_points_report_unavailable_without_a_gpu():
    if vramkit.is_available("cuda"):
        pytest.skip("a GPU is present: tests/unit/test_amp_cuda.py covers these")
    with pytest.raises(vramkit.VramkitError):
        _C.amp_update_scale_cuda(8, 8, 0, 8, (2.0, 0.5, 2000, 1, 0.0, float("inf")), 0, 0)


# ---- torch ---------------------------------------------------------------------------------------

torch_dtypes = ["float32", "float16", "bfloat16", "float64"]


@pytest.mark.parametrize("name", torch_dtypes)
@pytest.mark.parametrize("inv", [0.5, 2.0 ** -20, 7.0])
def test_bit_exact_against_torch_cpu_kernel(name, inv):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(17)
    tensors = []
    for n in (1, 9, 1000, 65537, 200_001):
        t = (torch.randn(n, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(-20, 14, (n,), generator=gen))
        t = t.to(dtype)
        if n > 100:
            t[torch.randint(0, n, (2,), generator=gen)] = float("inf")
        tensors.append(t)
    theirs = [t.clone() for t in tensors]
    found_t = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_t, torch.full((), inv))
    found = amp.unscale_(tensors, inv)
    assert found == bool(found_t.item())
    for a, b in zip(tensors, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_torch_tensors_through_dlpack_and_functional_contract():
    torch = pytest.importorskip("torch")

    class OnlyDLPack:  # an array library vramkit has never heard of
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    g = torch.linspace(-3, 3, 1001, dtype=torch.float16)
    want = g.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([want], torch.zeros(()), torch.full((), 0.25))
    found_inf = torch.zeros(())
    amp.non_finite_check_and_unscale_([OnlyDLPack(g)], found_inf, torch.full((), 0.25))
    assert torch.equal(g, want) and found_inf.item() == 0.0
    g[5] = float("nan")
    amp.non_finite_check_and_unscale_([g], found_inf, torch.full((), 0.25))
    assert found_inf.item() == 1.0
    amp.non_finite_check_and_unscale_([torch.ones(3)], found_inf, torch.full((), 0.25))
    assert found_inf.item() == 1.0, "found_inf is never reset by the kernel"
    with pytest.raises(TypeError, match="found_inf must be a 1-element float32"):
        amp.non_finite_check_and_unscale_([g], torch.zeros(2), torch.full((), 0.25))
    with pytest.raises(ValueError, match="tensor 0: elements overlap"):
        amp.unscale_([torch.ones(4).expand(3, 4)], 0.5)
    with pytest.raises(TypeError, match="tensor 0: torch.sparse_coo tensors are not supported here"):
        amp.unscale_([torch.ones(3).to_sparse()], 0.5)
    with pytest.raises(TypeError, match="tensor 0: dtype torch.int64"):
        amp.unscale_([torch.ones(3, dtype=torch.int64)], 0.5)
