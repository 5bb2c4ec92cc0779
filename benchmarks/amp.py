"""amp — the fused loss-scaling kernels on CPU: unscale + inf/NaN check (+ L2 norm) in one pass.

What it measures
  A gradient set of 64 Mi elements (2 Mi with --quick) split into 200 tensors of log-uniform
  sizes (seed 1234; 1 to ~1000 relative spread, odd lengths included), once as float32, once as
  float16 and, when torch is importable, once as bfloat16 (torch CPU tensors). Per dtype, in the
  same run, with passes of all sides interleaved (ABBA) after a warm-up pass, median reported:

  * vramkit: `vramkit.amp.unscale_(grads, inv)` (all threads), and with `set_num_threads(1)`.
  * copy: the bandwidth limit. `np.copyto` of the same bytes into a second buffer set (reads N,
    writes N: the traffic of an in-place unscale), on one thread and split across as many
    threads as vramkit uses; the faster of the two is the limit. Target: vramkit >= 0.70 of it.
    (A copy into another buffer may cost a read-for-ownership of the destination that an
    in-place pass does not, so vramkit can exceed 1.0 of it.)
  * NumPy: `g *= inv; np.isfinite(g).all()` per tensor. Target: vramkit >= 3x faster.
  * torch: `torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)`
    on tensors sharing the arrays' memory (`torch.from_numpy`), one call per dtype group as
    GradScaler does (every set here has one dtype). Target: vramkit faster. torch runs one
    OpenMP parallel region per tensor, each ending in a barrier, so on a machine whose cores are
    shared with other work its time swings widely; an info row compares both on one thread.
  * with the norm: `unscale_and_norm_` against the NumPy expression followed by
    `sqrt(sum(np.dot(g, g)))` (float32 dot per tensor — via a float32 copy for float16, whose
    own dot would overflow — summed in float64), and against the torch kernel followed by
    `torch.nn.utils.get_total_norm` (what clip_grad_norm_ computes: per-tensor norms, then the
    norm of their stack). Target: >= 1.8x faster.

  GB/s is effective: 2 x gradient bytes (one read + one write, the least an in-place unscale
  moves) / time, for every side, so unfused peers show how far they are from one pass.
  To keep the data alive across passes every unscale uses inv = 2.0 and 0.5 alternately (one
  shared toggle for all sides, exact in every dtype: values stay x or 2x); values start with
  |x| >= 2^-8, so halving never reaches float16 subnormals and nothing rounds.

Before timing, on copies of the data, the benchmark asserts that vramkit's result equals the
NumPy expression's and torch's kernel's bit for bit (at the timed inv values and at a
non-power-of-two inv, against the float32-widened NumPy form), that all report no inf, that an
injected inf or NaN is found, and that the norm matches a float64 reference to 1e-5.
OPENBLAS_NUM_THREADS=1 as in every benchmark here: the dot is memory-bound, and on this 2-core
VM a copy is no faster on two threads than on one.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads competing for 2 cores
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, interleaved, main_for, median, spread, use_source_tree

use_source_tree()

import numpy as np
from vramkit import amp

try:
    import torch
except ImportError:  # torch is optional: its rows (and bfloat16) are left out
    torch = None

SEED = 1234
COUNT = 200
INVS = (2.0, 0.5)
COPY_TARGET, NUMPY_TARGET, TORCH_TARGET, NORM_TARGET = 0.70, 3.0, 1.0, 1.8


def tensor_sizes(total: int, count: int = COUNT, seed: int = SEED) -> list[int]:
    """count sizes summing to total, log-uniform over a 1000x range (a model's biases to its matrices)."""
    w = np.exp(np.random.default_rng(seed).uniform(0.0, math.log(1000.0), count))
    sizes = np.maximum(np.floor(w / w.sum() * total).astype(np.int64), 1)
    sizes[int(np.argmax(sizes))] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def make_grads(sizes: list[int], dtype: np.dtype, seed: int = SEED) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = rng.standard_normal(n, dtype=np.float32)
        x = np.copysign(np.maximum(np.abs(x), np.float32(2.0 ** -8)), x)  # see the docstring
        out.append(x.astype(dtype))
    return out


def bits(a) -> np.ndarray:
    """The raw bits of a NumPy array or CPU tensor as unsigned integers, for exact comparison."""
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.numpy()
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def numpy_unscale(grads: list, inv: float) -> bool:
    """The NumPy user's expression; the Python float is cast to the array's dtype (exact for 2, 0.5)."""
    found = False
    for g in grads:
        g *= inv
        found |= not np.isfinite(g).all()
    return found


def numpy_norm(grads: list) -> float:
    total = 0.0
    for g in grads:
        x = g if g.dtype == np.float32 else g.astype(np.float32)
        total += float(np.dot(x, x))
    return math.sqrt(total)


def total_norm(tensors: list) -> float:
    fn = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6; the body of clip_grad_norm_
    if fn is not None:
        return float(fn(tensors))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


def torch_unscale(tensors: list, inv: float) -> bool:
    found = torch.zeros((), dtype=torch.float32)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.full((), inv, dtype=torch.float32))
    return bool(found.item())


def verify(name: str, arrays: list | None, tensors: list | None) -> tuple[dict, float]:
    """Assert equal results on copies of the data before anything is timed; returns the checks
    (all True: a mismatch raises, so nothing wrong is ever timed) and the norm's relative error."""
    ref = arrays if arrays is not None else [t.float().numpy() for t in tensors]
    ref_norm = math.sqrt(sum(float(np.dot(x.astype(np.float64), x.astype(np.float64))) for x in ref))
    odd_inv = float(np.float32(1.0 / 3.0))  # not a power of two: the product rounds
    for inv in INVS + (odd_inv,):
        vk = [t.clone() for t in tensors] if arrays is None else [a.copy() for a in arrays]
        assert not amp.unscale_(vk, inv), f"{name}: vramkit reports inf/NaN in finite data"
        vk_bits = [bits(x) for x in vk]
        if arrays is not None:
            peer = [a.copy() for a in arrays]
            if inv in INVS:  # the timed expression
                assert not numpy_unscale(peer, inv), f"{name}: NumPy reports inf/NaN in finite data"
            else:  # torch's contract: widen to float32, multiply, round back
                peer = [(a.astype(np.float32) * np.float32(inv)).astype(a.dtype) for a in peer]
            for i, (v, p) in enumerate(zip(vk_bits, peer)):
                assert np.array_equal(v, bits(p)), f"{name}: vramkit != NumPy in tensor {i} at inv={inv}"
        if tensors is not None:
            tt = [t.clone() for t in tensors]
            assert not torch_unscale(tt, inv), f"{name}: torch reports inf/NaN in finite data"
            for i, (v, t) in enumerate(zip(vk_bits, tt)):
                assert np.array_equal(v, bits(t)), f"{name}: vramkit != torch in tensor {i} at inv={inv}"
    src = tensors if arrays is None else arrays
    for bad in (math.inf, math.nan):
        vk = [x.clone() if arrays is None else x.copy() for x in src]
        vk[len(vk) // 2][-1] = bad
        assert amp.unscale_(vk, 0.5), f"{name}: vramkit misses an injected {bad}"
    vk = [x.clone() if arrays is None else x.copy() for x in src]
    found, norm = amp.unscale_and_norm_(vk, 2.0)
    rel = abs(norm - 2.0 * ref_norm) / (2.0 * ref_norm)
    assert not found and rel <= 1e-5, f"{name}: unscale_and_norm_ norm {norm} vs float64 {2 * ref_norm}"
    return {"results_equal": True, "inf_nan_found": True, "norm_matches": True}, rel


def measure(arrays: list | None, tensors: list | None, passes: int, warmup: int) -> dict:
    """Per-pass ns of every side on one gradient set (arrays: NumPy views; tensors: torch views)."""
    grads = arrays if arrays is not None else tensors
    raw = arrays if arrays is not None else [t.view(torch.int16).numpy() for t in tensors]  # bf16 as bytes
    dst = [np.empty_like(r) for r in raw]
    nthreads = amp.get_num_threads()
    # Balanced split of the copy across threads (largest first onto the least loaded thread).
    shares: list[list[int]] = [[] for _ in range(nthreads)]
    loads = [0] * nthreads
    for i in sorted(range(len(raw)), key=lambda i: -raw[i].size):
        k = loads.index(min(loads))
        shares[k].append(i)
        loads[k] += raw[i].size
    pool = ThreadPoolExecutor(nthreads)  # np.copyto releases the GIL on large arrays
    toggle = [0]
    inv_tensors = {v: torch.full((), v, dtype=torch.float32) for v in INVS} if torch else {}
    found = torch.zeros((), dtype=torch.float32) if torch else None

    def next_inv() -> float:
        toggle[0] ^= 1
        return INVS[toggle[0]]

    def timed(fn):
        def one_pass() -> float:
            start = time.perf_counter_ns()
            fn()
            return time.perf_counter_ns() - start
        return one_pass

    def one_thread() -> float:
        inv = next_inv()
        amp.set_num_threads(1)
        try:
            start = time.perf_counter_ns()
            amp.unscale_(grads, inv)
            return time.perf_counter_ns() - start
        finally:
            amp.set_num_threads(nthreads)

    def torch_kernel() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_tensors[next_inv()])

    def torch_one_thread() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return timed(torch_kernel)()
        finally:
            torch.set_num_threads(before)

    sides = {
        "vramkit": timed(lambda: amp.unscale_(grads, next_inv())),
        "vramkit_1thread": one_thread,
        "copy": timed(lambda: [np.copyto(d, r) for d, r in zip(dst, raw)]),
        "copy_threads": timed(lambda: list(pool.map(lambda s: [np.copyto(dst[i], raw[i]) for i in s], shares))),
        "vramkit_norm": timed(lambda: amp.unscale_and_norm_(grads, next_inv())),
    }
    if arrays is not None:
        sides["numpy"] = timed(lambda: numpy_unscale(arrays, next_inv()))
        sides["numpy_norm"] = timed(lambda: (numpy_unscale(arrays, next_inv()), numpy_norm(arrays)))
    if tensors is not None:
        sides["torch"] = timed(torch_kernel)
        sides["torch_1thread"] = torch_one_thread
        sides["torch_norm"] = timed(lambda: (torch_kernel(), total_norm(tensors)))
    try:
        return interleaved(sides, passes=passes, warmup=warmup)
    finally:
        pool.shutdown()


def _ms_gbs(ns: float, nbytes: int) -> str:
    return f"{ns / 1e6:.2f} ms, {2 * nbytes / ns:.1f} GB/s"


def _speed(r: float) -> str:
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


def rows_for(label: str, times: dict, nbytes: int, checks: dict, base: dict) -> list[Row]:
    med = {k: median(v) for k, v in times.items()}
    vk, vkn = med["vramkit"], med["vramkit_norm"]
    copy_name = "copy" if med["copy"] <= med["copy_threads"] else "copy_threads"
    detail = {**base, "medians_ns": med, "passes_ns": times, "spread": {k: spread(v) for k, v in times.items()},
              "gbs": {k: 2 * nbytes / v for k, v in med.items()}}

    def row(bench: str, mine: float, peer_name: str, peer: float, target: str, need: float | None,
            ratio_text: str | None = None) -> Row:
        ratio = peer / mine
        return Row(benchmark=f"amp: {bench}", vramkit=mine, vramkit_text=_ms_gbs(mine, nbytes),
                   peer_name=peer_name, peer=peer, peer_text=_ms_gbs(peer, nbytes), ratio=ratio,
                   ratio_text=ratio_text or _speed(ratio), target=target,
                   met=None if need is None else ratio >= need and all(checks.values()),
                   checks=checks, detail=detail)

    threads = base["threads"]
    copy_label = "np.copyto" if copy_name == "copy" else f"np.copyto x{threads} threads"
    rows = [row(f"unscale_ {label} vs copy", vk, copy_label, med[copy_name], ">= 0.70 of copy", COPY_TARGET,
                f"{med[copy_name] / vk:.2f} of copy")]
    if "numpy" in med:
        rows.append(row(f"unscale_ {label} vs NumPy", vk, "g*=inv; isfinite().all()", med["numpy"], ">= 3x",
                        NUMPY_TARGET))
    if "torch" in med:
        rows.append(row(f"unscale_ {label} vs torch", vk, "torch._amp_foreach_...unscale_", med["torch"],
                        "faster", TORCH_TARGET))
    if "numpy_norm" in med:
        rows.append(row(f"unscale_and_norm_ {label} vs NumPy", vkn, "NumPy unscale + dot norm", med["numpy_norm"],
                        ">= 1.8x", NORM_TARGET))
    if "torch_norm" in med:
        rows.append(row(f"unscale_and_norm_ {label} vs torch", vkn, "torch unscale + get_total_norm",
                        med["torch_norm"], ">= 1.8x", NORM_TARGET))
    one = med["vramkit_1thread"]
    rows.append(row(f"unscale_ {label}, 1 thread, {base['simd']} (info)", one, f"vramkit {threads} threads", vk,
                    "(info)", None, f"{threads} threads {one / vk:.2f}x faster"))
    if "torch_1thread" in med:  # kernel against kernel, without torch's per-tensor OpenMP regions
        rows.append(row(f"unscale_ {label}, 1 thread vs torch 1 thread (info)", one, "torch, set_num_threads(1)",
                        med["torch_1thread"], "(info)", None))
    return rows


def run(quick: bool = False) -> list[Row]:
    total = (2 << 20) if quick else (64 << 20)
    passes, warmup = (3, 1) if quick else (7, 1)
    sizes = tensor_sizes(total)
    base = {"elements": total, "tensors": COUNT, "seed": SEED, "threads": amp.get_num_threads(),
            "simd": amp.simd_path(), "min_size": min(sizes), "max_size": max(sizes), "passes": passes,
            "torch": torch.__version__ if torch else None}
    rows: list[Row] = []
    for label, dtype in (("fp32", np.float32), ("fp16", np.float16)):
        arrays = make_grads(sizes, np.dtype(dtype))
        tensors = [torch.from_numpy(a) for a in arrays] if torch else None
        checks, rel = verify(label, arrays, tensors)
        times = measure(arrays, tensors, passes, warmup)
        rows += rows_for(label, times, sum(a.nbytes for a in arrays), checks, {**base, "norm_rel_err": rel})
        del arrays, tensors
    if torch is not None:  # NumPy has no bfloat16: torch tensors, vramkit vs torch and the copy only
        tensors = [torch.from_numpy(a).to(torch.bfloat16) for a in make_grads(sizes, np.dtype(np.float32))]
        checks, rel = verify("bf16", None, tensors)
        times = measure(None, tensors, passes, warmup)
        rows += rows_for("bf16", times, 2 * total, checks, {**base, "norm_rel_err": rel})
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
