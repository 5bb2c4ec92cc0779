"""numpy_temporaries — NumPy code with large temporaries, with and without vramkit's handler.

What it measures
  Wall time per iteration of elementwise NumPy expressions on two float64 inputs of 64 MiB
  each (8 Mi elements), with NumPy's default allocator (the peer) and inside
  `vramkit.numpy.caching()` (vramkit's cpu pool). Two workloads, both reported:

  * `issue`: the issue's example, `((a * 1.5 + b) ** 2).sum()`. NumPy's temporary elision
    makes `+ b` and `** 2` work in place, so this is ONE fresh 64 MiB array per iteration.
  * `pipeline`: four fresh 64 MiB arrays per iteration:
        x = a * 1.5 + b            # a*1.5: new temporary (+ b in place)
        y = np.sqrt(x * x + 1.0)   # x*x: new temporary (+ 1.0 in place); sqrt: new array
        z = (y - a) * b            # y - a: new temporary (* b in place)
        s = z.sum()

  With NumPy's default allocator, arrays this big are fresh mmap()s (glibc's mmap threshold
  stops growing at 32 MiB), so each temporary is page-faulted and zero-filled by the kernel
  and munmap()ed when it dies. NumPy asks for transparent huge pages on such arrays
  (madvise(MADV_HUGEPAGE), on by default on Linux), which makes that much cheaper. With
  vramkit the temporaries come from pool segments that stay mapped and faulted.

  An informational third row runs `pipeline` with NumPy's hugepage hint switched off
  (`numpy._core.multiarray._set_madvise_hugepage(False)`), i.e. 4 KiB pages as on systems
  with THP disabled, to show how much of the gap is page-fault cost.

  The inputs a and b are the same arrays for both sides (made once with NumPy's default
  allocator, seed 1234). Figures are medians over interleaved passes (default, vramkit,
  vramkit, default, ...) after one warm-up pass per side; a pass is 5 iterations (7 passes;
  2 iterations and 1 pass with --quick). The results of both sides are checked to be equal:
  `np.array_equal` on the arrays and equal sums (relative difference <= 1e-12).

Target (from the issue): >= 2x faster with vramkit, equal results.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads competing for 2 cores
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_ns, interleaved, main_for, median, spread, use_source_tree

use_source_tree()

import numpy as np
import vramkit
import vramkit.numpy as vnp

SEED = 1234
ARRAY_BYTES = 64 << 20
TARGET_SPEEDUP = 2.0


def issue_expr(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray | None, float]:
    return None, float(((a * 1.5 + b) ** 2).sum())


def pipeline(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray | None, float]:
    x = a * 1.5 + b
    y = np.sqrt(x * x + 1.0)
    z = (y - a) * b
    return z, float(z.sum())


def _hugepage_switch():
    """NumPy's private switch for its MADV_HUGEPAGE hint (None where this NumPy lacks it)."""
    try:
        from numpy._core import multiarray as ma
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray as ma
    getter, setter = getattr(ma, "_get_madvise_hugepage", None), getattr(ma, "_set_madvise_hugepage", None)
    return (getter, setter) if getter and setter else None


def measure(name: str, fn, a: np.ndarray, b: np.ndarray, iterations: int, passes: int, target: bool) -> Row:
    def default_pass() -> float:
        start = time.perf_counter_ns()
        for _ in range(iterations):
            fn(a, b)
        return (time.perf_counter_ns() - start) / iterations

    def vramkit_pass() -> float:
        with vnp.caching():
            start = time.perf_counter_ns()
            for _ in range(iterations):
                fn(a, b)
            return (time.perf_counter_ns() - start) / iterations

    times = interleaved({"default": default_pass, "vramkit": vramkit_pass}, passes=passes, warmup=1)

    z_default, s_default = fn(a, b)
    with vnp.caching():
        z_vramkit, s_vramkit = fn(a, b)
        probe = np.empty(len(a))  # proves the handler routed a 64 MiB array to the pool
    used_pool = vnp.uses_vramkit(probe) and (z_vramkit is None or vnp.uses_vramkit(z_vramkit))
    used_pool = used_pool and (z_default is None or not vnp.uses_vramkit(z_default))
    arrays_equal = z_default is None or bool(np.array_equal(z_default, z_vramkit))
    sums_equal = abs(s_default - s_vramkit) <= 1e-12 * max(abs(s_default), 1.0)
    del z_default, z_vramkit, probe

    vk, peer = median(times["vramkit"]), median(times["default"])
    speedup = peer / vk
    equal = arrays_equal and sums_equal
    return Row(
        benchmark=f"numpy: {name}", vramkit=vk, vramkit_text=fmt_ns(vk),
        peer_name="NumPy default alloc", peer=peer, peer_text=fmt_ns(peer),
        ratio=speedup, ratio_text=f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower",
        target=">= 2x, equal results" if target else "(info)",
        met=(speedup >= TARGET_SPEEDUP and equal and used_pool) if target else None,
        checks={"results_equal": equal, "vramkit_pool_used": used_pool},
        detail={"array_bytes": ARRAY_BYTES, "iterations_per_pass": iterations, "passes": passes,
                "passes_vramkit": times["vramkit"], "passes_default": times["default"],
                "spread_vramkit": spread(times["vramkit"]), "spread_default": spread(times["default"]),
                "arrays_equal": arrays_equal, "sums_equal": sums_equal, "sum_default": s_default,
                "sum_vramkit": s_vramkit},
    )


def run(quick: bool = False) -> list[Row]:
    iterations, passes = (2, 1) if quick else (5, 7)
    n = ARRAY_BYTES // 8
    rng = np.random.default_rng(SEED)
    was_installed = vnp.is_installed()
    vnp.uninstall()  # inputs and the peer use NumPy's default allocator
    rows = []
    try:
        a = rng.standard_normal(n)
        b = rng.standard_normal(n)
        rows.append(measure("((a*1.5+b)**2).sum(), 1 temp/iter", issue_expr, a, b, iterations, passes, True))
        rows.append(measure("pipeline, 4 temps/iter", pipeline, a, b, iterations, passes, True))
        switch = _hugepage_switch()
        if switch:
            get_hp, set_hp = switch
            previous = get_hp()
            set_hp(False)
            try:
                rows.append(measure("pipeline, NumPy hugepages off (info)", pipeline, a, b, iterations, passes,
                                    False))
            finally:
                set_hp(previous)
        rows[0].detail["cpu_reserved_bytes_after"] = vramkit.memory_reserved("cpu")
    finally:
        if was_installed:
            vnp.install()
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
