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

Page release (the cpu pool gives the pages of freed blocks of 64 MiB and more back with
MADV_FREE, so cached memory costs nothing under pressure): the row "page release on vs off"
runs the pipeline inside caching() with host_page_release_mb at its default and at None,
passes interleaved, and reports the ratio (its cost; 1.00x means none).

Pressure (benchmarks/host_pressure.py, each run a fresh child Python): the issue's case,
`grow` (an X array and its temporary freed, then a 2X array and its temporary; X = 256 MiB,
NumPy's allocator needs 4X at the peak; 8 rounds), and `random` (a seeded sequence of 160
growing, shrinking and varying arrays up to X, at most 3X live). Rows: wall time with and without the
handler (children interleaved, median of 3; 1 with --quick); their peak resident set (VmHWM,
what `top` shows, which counts MADV_FREE pages until the kernel takes them) and the peak of
Rss - LazyFree between steps (what the process holds against the machine). Where a memory
cgroup can be made (root, or a delegated cgroup), `grow` also runs under a hard limit of
1.25 x NumPy's own peak: with NumPy's allocator, with vramkit, and with vramkit's old policy
(no host check, no page release, no cache limit), which the kernel OOM-kills.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads competing for 2 cores
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_bytes, fmt_ns, interleaved, main_for, median, spread, use_source_tree

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


def measure_release_cost(a: np.ndarray, b: np.ndarray, iterations: int, passes: int) -> Row:
    """The pipeline in caching(), page release at its default against page release off."""
    default_release = vramkit.get_settings("cpu")["host_page_release"]
    default_mb = None if default_release is None else default_release >> 20

    def side(release_mb):
        def one_pass() -> float:
            vramkit.configure("cpu", host_page_release_mb=release_mb)
            with vnp.caching():
                start = time.perf_counter_ns()
                for _ in range(iterations):
                    pipeline(a, b)
                return (time.perf_counter_ns() - start) / iterations
        return one_pass

    def result(release_mb):
        vramkit.configure("cpu", host_page_release_mb=release_mb)
        with vnp.caching():
            pipeline(a, b)  # a pass that frees (and releases) blocks the next one reuses
            return pipeline(a, b)

    before = vramkit.memory_stats("cpu")["num_host_page_releases"]
    try:
        times = interleaved({"on": side(default_mb), "off": side(None)}, passes=passes, warmup=1)
        (z_on, s_on), (z_off, s_off) = result(default_mb), result(None)
    finally:
        vramkit.configure("cpu", host_page_release_mb=default_mb)
    releases = vramkit.memory_stats("cpu")["num_host_page_releases"] - before
    equal = bool(np.array_equal(z_on, z_off)) and s_on == s_off
    used_pool = vnp.uses_vramkit(z_on) and vnp.uses_vramkit(z_off)
    del z_on, z_off
    on, off = median(times["on"]), median(times["off"])
    return Row(
        benchmark="numpy: pipeline, page release on vs off", vramkit=on, vramkit_text=fmt_ns(on),
        peer_name="vramkit, host_page_release_mb:None", peer=off, peer_text=fmt_ns(off),
        ratio=off / on, ratio_text=f"{off / on:.2f}x (cost {100 * (on - off) / off:+.1f} %)", target="(info)", met=None,
        checks={"results_equal": equal, "vramkit_pool_used": used_pool, "pages_released": releases > 0},
        detail={"passes_on": times["on"], "passes_off": times["off"], "page_releases": releases,
                "threshold_mb": default_mb},
    )


def pressure_rows(quick: bool) -> list[Row]:
    """The workloads of host_pressure.py in child processes, with and without the handler."""
    import host_pressure as hp

    scale = (64 if quick else 256) << 20
    passes = 1 if quick else 3
    rows = []
    # Enough rounds that the steady state, not the first touch of fresh memory (which a VM can
    # make 10-40x dearer, and unevenly), decides the time.
    for workload, rounds in (("grow", 1 if quick else 8), ("random", 20 if quick else 160)):
        runs: dict[str, list[dict]] = {"default": [], "vramkit": []}
        for i in range(passes):  # children interleaved, order flipped every round
            for side in (("default", "vramkit") if i % 2 == 0 else ("vramkit", "default")):
                runs[side].append(hp.run_child(workload, scale, side == "vramkit", seed=11, rounds=rounds))
        ok = all(r.get("ok") for side in runs.values() for r in side)
        equal = ok and len({r["checksum"] for side in runs.values() for r in side}) == 1
        t = {side: median(r["seconds"] for r in rs) for side, rs in runs.items()} if ok else {}
        if not ok:
            raise RuntimeError(f"pressure workload {workload} failed: {runs}")
        hwm = {side: max(r["vm_hwm"] for r in rs) for side, rs in runs.items()}
        held = {side: max(r["peak_held"] for r in rs) for side, rs in runs.items()}
        detail = {"scale": scale, "rounds": rounds, "runs": runs}
        rows.append(Row(
            benchmark=f"numpy pressure: {workload}, time", vramkit=t["vramkit"], vramkit_text=f"{t['vramkit']:.2f} s",
            peer_name="NumPy default alloc", peer=t["default"], peer_text=f"{t['default']:.2f} s",
            ratio=t["default"] / t["vramkit"], ratio_text=f"{t['default'] / t['vramkit']:.2f}x faster"
            if t["default"] >= t["vramkit"] else f"{t['vramkit'] / t['default']:.2f}x slower",
            target="(info)", met=None, checks={"results_equal": equal}, detail=detail))
        for name, fig in (("peak RSS (VmHWM)", hwm), ("peak Rss - LazyFree", held)):
            rows.append(Row(
                benchmark=f"numpy pressure: {workload}, {name}", vramkit=fig["vramkit"],
                vramkit_text=fmt_bytes(fig["vramkit"]), peer_name="NumPy default alloc", peer=fig["default"],
                peer_text=fmt_bytes(fig["default"]), ratio=fig["vramkit"] / fig["default"],
                ratio_text=f"{fig['vramkit'] / fig['default']:.2f}x NumPy's", target="(info)", met=None))
        if workload != "grow" or hp.MemoryCgroup.unavailable_reason() is not None:
            continue
        limit = int(1.25 * hwm["default"])
        outcomes = {}
        for side, handler, conf in (("default", False, ""), ("vramkit", True, ""),
                                    ("old policy", True, "host_memory_check:False,host_page_release_mb:None,"
                                                         "host_cache_limit_fraction:None")):
            with hp.MemoryCgroup(limit) as cg:
                outcomes[side] = hp.run_child(workload, scale, handler, seed=11, rounds=rounds, conf=conf, cgroup=cg)
                outcomes[side]["oom_kills"] = cg.oom_kills()
        done = {k: bool(v.get("ok")) for k, v in outcomes.items()}
        text = {k: (f"completed, {v['seconds']:.2f} s" if v.get("ok") else
                    "OOM-killed" if v.get("killed") else "MemoryError") for k, v in outcomes.items()}
        secs = {k: v.get("seconds", float("nan")) for k, v in outcomes.items()}
        rows.append(Row(
            benchmark=f"numpy pressure: grow in a cgroup of {fmt_bytes(limit)} (1.25x NumPy's peak)",
            vramkit=secs["vramkit"] if done["vramkit"] else float("nan"), vramkit_text=text["vramkit"],
            peer_name="NumPy default alloc", peer=secs["default"] if done["default"] else float("nan"),
            peer_text=text["default"],
            ratio=secs["default"] / secs["vramkit"] if done["vramkit"] and done["default"] else float("nan"),
            ratio_text=f"old vramkit policy: {text['old policy']}",
            target="completes where NumPy's does", met=done["vramkit"] and done["default"],
            checks={"vramkit_completed": done["vramkit"],
                    "results_equal": done["vramkit"] and outcomes["vramkit"]["checksum"] == runs["default"][0]["checksum"]},
            detail={"limit": limit, "outcomes": outcomes}))
    return rows


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
        rows.append(measure_release_cost(a, b, iterations, passes))
        rows[0].detail["cpu_reserved_bytes_after"] = vramkit.memory_reserved("cpu")
        del a, b
    finally:
        if was_installed:
            vnp.install()
    vramkit.empty_cache("cpu")  # the children below measure a machine without our cache in it
    return rows + pressure_rows(quick)


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
