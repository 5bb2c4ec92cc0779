"""alloc — the cost of one cached allocation + free pair, at the C level and from Python.

What it measures
  * C level: `vramkit._C.bench_pool_pairs("cpu", sizes, 1)` loops `vram_malloc` + `vram_free`
    in C (GIL released) over a fixed size sequence; the peer, `vramkit._C.bench_malloc_pairs`,
    loops glibc `malloc` + `free` in C over the *same* sequence. Neither side touches the memory
    it gets, so this is allocator bookkeeping only. vramkit's pool is warm (the warm-up pass drew
    its segments), which is the state a training loop runs in; glibc is equally warm.
  * Python level: `vramkit.raw_free(vramkit.raw_alloc(n))` in a Python `for` loop against its
    NumPy peer `a = np.empty(n, np.uint8); del a` (NumPy's default allocator, i.e. glibc, plus
    NumPy's own bookkeeping) over the same size list.
  * Informational rows: the C-level comparison on a plain log-uniform 512 B..64 MiB sequence,
    on each band of the mix alone (where glibc wins and where it loses), and the Python floor — the same loop calling two trivial builtins (`abs(abs(n))`) — which
    is what any pair of C calls costs from Python on this machine.

The "realistic mix" (512 B - 64 MiB), a mixture of log-uniform bands that mimics the tensors
of a training step; sizes are rounded up to a multiple of 4 bytes (element sizes):
    50 %  512 B  - 1 MiB    small pool: biases, norm weights, scalars, masks, index tensors
    35 %  1 MiB  - 10 MiB   large pool, carved from 20 MiB segments: weight matrices, activations
    15 %  10 MiB - 64 MiB   large pool, own 2 MiB-rounded segments: big activations, logits
Seed 1234; 100 000 sizes (10 000 with --quick). Each figure is the median over interleaved
passes (vramkit, peer, peer, vramkit, ...) after warm-up passes; ns per pair.

Targets (from the issue): C-level median <= 60 ns per pair and faster than glibc on the mix;
Python level <= 250 ns per pair.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads competing for 2 cores
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_ns, interleaved, main_for, median, spread, use_source_tree

use_source_tree()

import numpy as np
import vramkit
from vramkit import _C

SEED = 1234
MIN_SIZE, MAX_SIZE = 512, 64 << 20
MIX = (  # (weight, low, high): log-uniform within each band
    (0.50, 512, 1 << 20),
    (0.35, 1 << 20, 10 << 20),
    (0.15, 10 << 20, 64 << 20),
)
C_TARGET_NS = 60.0
PY_TARGET_NS = 250.0


def realistic_mix(n: int, seed: int = SEED) -> np.ndarray:
    """The documented mixture above, as a uint64 array of n sizes in [512 B, 64 MiB]."""
    rng = np.random.default_rng(seed)
    weights = np.array([w for w, _, _ in MIX])
    band = rng.choice(len(MIX), size=n, p=weights / weights.sum())
    lo = np.log(np.array([b[1] for b in MIX], dtype=np.float64))[band]
    hi = np.log(np.array([b[2] for b in MIX], dtype=np.float64))[band]
    sizes = np.exp(rng.uniform(lo, hi))
    sizes = (np.ceil(sizes / 4) * 4).astype(np.uint64)
    return np.clip(sizes, MIN_SIZE, MAX_SIZE).astype(np.uint64)


def log_uniform(n: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(MIN_SIZE), np.log(MAX_SIZE), size=n))
    return np.clip(np.ceil(sizes / 4) * 4, MIN_SIZE, MAX_SIZE).astype(np.uint64)


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} B"


def c_level(sizes: np.ndarray, passes: int, warmup: int, device: str = "cpu") -> dict[str, list[float]]:
    """ns per pair per pass: vramkit's pool and glibc, both looped in C over `sizes`."""
    return interleaved(
        {
            "vramkit": lambda: _C.bench_pool_pairs(device, sizes, 1)[0],
            "glibc": lambda: _C.bench_malloc_pairs(sizes, 1)[0],
        },
        passes=passes,
        warmup=warmup,
    )


def python_level(sizes: list[int], passes: int, warmup: int) -> dict[str, list[float]]:
    """ns per pair per pass, all three loops written the same way in Python."""
    import time

    raw_alloc, raw_free, empty, uint8 = vramkit.raw_alloc, vramkit.raw_free, np.empty, np.uint8
    n = len(sizes)

    def vramkit_pass() -> float:
        start = time.perf_counter_ns()
        for size in sizes:
            raw_free(raw_alloc(size))
        return (time.perf_counter_ns() - start) / n

    def numpy_pass() -> float:
        start = time.perf_counter_ns()
        for size in sizes:
            a = empty(size, uint8)
            del a
        return (time.perf_counter_ns() - start) / n

    def floor_pass() -> float:
        start = time.perf_counter_ns()
        for size in sizes:
            abs(abs(size))
        return (time.perf_counter_ns() - start) / n

    return interleaved({"vramkit": vramkit_pass, "numpy": numpy_pass, "floor": floor_pass},
                       passes=passes, warmup=warmup)


def run(quick: bool = False) -> list[Row]:
    n = 10_000 if quick else 100_000
    c_passes, py_passes = (3, 3) if quick else (21, 9)
    warmup = 1 if quick else 2
    mix = realistic_mix(n)
    detail_mix = {"n_sizes": n, "seed": SEED, "mean_size": float(mix.mean()), "median_size": float(np.median(mix))}

    # NumPy's default allocator must be the peer, whatever the caller had installed.
    import vramkit.numpy as vnp

    was_installed = vnp.is_installed()
    vnp.uninstall()
    try:
        c_mix = c_level(mix, c_passes, warmup)
        c_lu = c_level(log_uniform(n), c_passes, warmup)
        c_bands = []
        for _, lo, hi in MIX:  # the mix's sizes band by band (in their original order)
            band = mix[(mix >= lo) & (mix < hi) if hi < MAX_SIZE else (mix >= lo)].copy()
            c_bands.append((lo, hi, c_level(band, c_passes, warmup)))
        py = python_level([int(s) for s in mix], py_passes, warmup)
    finally:
        if was_installed:
            vnp.install()

    rows = []
    vk, peer = median(c_mix["vramkit"]), median(c_mix["glibc"])
    rows.append(Row(
        benchmark="alloc: C pair, realistic mix", vramkit=vk, vramkit_text=fmt_ns(vk),
        peer_name="glibc malloc+free", peer=peer, peer_text=fmt_ns(peer),
        ratio=peer / vk, ratio_text=f"{peer / vk:.2f}x faster" if vk < peer else f"{vk / peer:.2f}x slower",
        target="<= 60 ns and < glibc", met=vk <= C_TARGET_NS and vk < peer,
        detail={**detail_mix, "passes_vramkit": c_mix["vramkit"], "passes_glibc": c_mix["glibc"],
                "spread_vramkit": spread(c_mix["vramkit"]), "spread_glibc": spread(c_mix["glibc"])},
    ))
    vk, peer = median(c_lu["vramkit"]), median(c_lu["glibc"])
    rows.append(Row(
        benchmark="alloc: C pair, log-uniform (info)", vramkit=vk, vramkit_text=fmt_ns(vk),
        peer_name="glibc malloc+free", peer=peer, peer_text=fmt_ns(peer),
        ratio=peer / vk, ratio_text=f"{peer / vk:.2f}x faster" if vk < peer else f"{vk / peer:.2f}x slower",
        target="(info)", met=None,
        detail={"passes_vramkit": c_lu["vramkit"], "passes_glibc": c_lu["glibc"]},
    ))
    for lo, hi, c_band in c_bands:
        vk, peer = median(c_band["vramkit"]), median(c_band["glibc"])
        rows.append(Row(
            benchmark=f"alloc: C pair, mix band {_size_text(lo)}-{_size_text(hi)} (info)", vramkit=vk,
            vramkit_text=fmt_ns(vk), peer_name="glibc malloc+free", peer=peer, peer_text=fmt_ns(peer),
            ratio=peer / vk, ratio_text=f"{peer / vk:.2f}x faster" if vk < peer else f"{vk / peer:.2f}x slower",
            target="(info)", met=None,
            detail={"passes_vramkit": c_band["vramkit"], "passes_glibc": c_band["glibc"]},
        ))
    vk, peer, floor = median(py["vramkit"]), median(py["numpy"]), median(py["floor"])
    rows.append(Row(
        benchmark="alloc: Python pair, realistic mix", vramkit=vk, vramkit_text=fmt_ns(vk),
        peer_name="np.empty+del", peer=peer, peer_text=fmt_ns(peer),
        ratio=peer / vk, ratio_text=f"{peer / vk:.2f}x faster" if vk < peer else f"{vk / peer:.2f}x slower",
        target="<= 250 ns", met=vk <= PY_TARGET_NS,
        detail={"passes_vramkit": py["vramkit"], "passes_numpy": py["numpy"],
                "spread_vramkit": spread(py["vramkit"]), "spread_numpy": spread(py["numpy"])},
    ))
    rows.append(Row(
        benchmark="alloc: Python floor, 2 builtin calls (info)", vramkit=floor, vramkit_text=fmt_ns(floor),
        peer_name="", peer=floor, peer_text="abs(abs(n)) loop",
        ratio=vk / floor, ratio_text=f"pair = {vk / floor:.2f}x floor", target="(info)", met=None,
        detail={"passes_floor": py["floor"]},
    ))
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
