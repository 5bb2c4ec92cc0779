"""gpu/amp — vramkit's CUDA unscale + inf/NaN check against torch's kernel and the copy limit.

    PYTHONPATH=python python benchmarks/gpu/amp.py                 # full run (needs a CUDA GPU)
    PYTHONPATH=python python benchmarks/gpu/amp.py --quick         # seconds; smaller sets
    PYTHONPATH=python python benchmarks/gpu/amp.py --json r.json   # also save every figure as JSON

Needs torch with CUDA and vramkit built with its CUDA kernels (VRAMKIT_CUDA=1); without either
it prints why and exits 0, so it is safe to call anywhere. Not part of benchmarks/report.py.

What it measures, per gradient set (torch CUDA tensors of float32, float16 and bfloat16):
  * 64 Mi and 512 Mi elements in 200 tensors of log-uniform sizes (seed 1234), and 2000 tensors
    of 4096 elements (launch and per-tensor overhead dominate there).
  * vramkit: `vramkit.amp.non_finite_check_and_unscale_(grads, found_inf, inv_scale)` with 0-d
    float32 CUDA tensors, as GradScaler calls it.
  * torch: `torch._amp_foreach_non_finite_check_and_unscale_` with the same arguments; a dtype
    it rejects (bfloat16 in the torch versions we know) is reported as 'not supported'.
  * copy: one `copy_` between two flat CUDA buffers of the set's total bytes — one kernel,
    read N + write N, the traffic of an in-place unscale: the bandwidth roof.
Two times per side, medians of interleaved passes (ABBA) after warm-up, CUDA events:
  * kernel: a `torch.cuda._sleep` is queued before the start event, long enough (calibrated)
    that the host has issued the whole call before the GPU reaches it, so the figure is GPU
    time only. GB/s = 2 x gradient bytes / kernel time; targets: >= 85 % of copy, < torch.
  * e2e: the GPU idle at the start event, so host work (Python, argument checks, launches)
    counts: what one call costs when nothing else hides it.
inv_scale alternates 2.0 / 0.5 (one toggle for all sides, exact in every dtype; values are
floored at |x| >= 2^-8 so nothing rounds). Before timing, on clones, results are checked bit
for bit against torch's kernel (where it supports the dtype) and against torch's contract
computed elementwise, `(g.float() * inv).to(dtype)`, at 2.0, 0.5 and a rounding inv; an
injected inf and NaN must be found, and found_inf must still be 0 after the timed passes.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common

from _common import median, spread, use_source_tree, write_json

use_source_tree()

SEED = 1234
INVS = (2.0, 0.5)
COPY_TARGET = 0.85
BITS = {}  # dtype -> same-size integer dtype, for bit-exact comparison (filled once torch is imported)


def tensor_sizes(total: int, count: int, seed: int = SEED) -> list[int]:
    """count sizes summing to total, log-uniform over a 1000x range (same rule as benchmarks/amp.py)."""
    import numpy as np

    w = np.exp(np.random.default_rng(seed).uniform(0.0, math.log(1000.0), count))
    sizes = np.maximum(np.floor(w / w.sum() * total).astype(np.int64), 1)
    sizes[int(np.argmax(sizes))] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def make_grads(torch, sizes: list[int], dtype, device: str) -> list:
    gen = torch.Generator(device=device).manual_seed(SEED)
    out = []
    for n in sizes:
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        out.append(torch.copysign(x.abs().clamp_(min=2.0 ** -8), x).to(dtype))  # see the docstring
    return out


def torch_supports(torch, dtype, device: str) -> bool:
    try:
        found = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(8, device=device, dtype=dtype)], found,
                                                          torch.ones((), device=device))
        return found.item() == 0.0  # .item() waits, so an asynchronous launch error surfaces here
    except (RuntimeError, NotImplementedError):
        return False


def verify(torch, amp, grads: list, dtype, torch_ok: bool, device: str) -> None:
    """Bit-exact checks on clones, before anything is timed; raises AssertionError on a mismatch."""
    same = lambda a, b: all(torch.equal(x.view(BITS[dtype]), y.view(BITS[dtype])) for x, y in zip(a, b))
    for inv in INVS + (1.0 / 3.0,):
        inv_t = torch.full((), inv, device=device, dtype=torch.float32)
        ref = [(g.float() * inv_t).to(dtype) for g in grads]  # torch's contract, elementwise
        vk, found = [g.clone() for g in grads], torch.zeros((), device=device)
        amp.non_finite_check_and_unscale_(vk, found, inv_t)
        assert found.item() == 0.0, f"{dtype}: vramkit reports inf/NaN in finite data"
        assert same(vk, ref), f"{dtype}: vramkit differs from (g.float() * inv).to(dtype) at inv={inv}"
        if torch_ok:
            tt, tfound = [g.clone() for g in grads], torch.zeros((), device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tt, tfound, inv_t)
            assert same(vk, tt), f"{dtype}: vramkit differs from torch's kernel at inv={inv}"
        del ref, vk
    for bad in (math.inf, math.nan):
        vk, found = [g.clone() for g in grads], torch.zeros((), device=device)
        vk[len(vk) // 2][-1] = bad
        amp.non_finite_check_and_unscale_(vk, found, torch.full((), 0.5, device=device))
        assert found.item() == 1.0, f"{dtype}: vramkit misses an injected {bad}"
        del vk


def sleep_cycles_per_ms(torch) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm the kernel
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def measure(torch, sides: dict, passes: int, warmup: int, cycles_per_ms: float | None) -> dict:
    """{side: {"kernel": [ms...], "e2e": [ms...]}}, passes interleaved ABBA."""
    host_ms = 0.0
    for _ in range(warmup):
        for fn in sides.values():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host_ms = max(host_ms, (time.perf_counter() - t0) * 1e3)  # host time to issue one call
            torch.cuda.synchronize()
    # Queue 2x the slowest issue time (+1 ms) of sleep so the GPU never waits on the host.
    cycles = int((2 * host_ms + 1.0) * cycles_per_ms) if cycles_per_ms else 0

    def one(fn, hide_host: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if hide_host and cycles:
            torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    names = list(sides)
    out = {n: {"kernel": [], "e2e": []} for n in names}
    for i in range(passes):
        for n in (names if i % 2 == 0 else names[::-1]):
            out[n]["kernel"].append(one(sides[n], True))
            out[n]["e2e"].append(one(sides[n], False))
    out["_host_issue_ms"] = host_ms
    return out


def run_case(torch, amp, label: str, sizes: list[int], dtype, passes: int, warmup: int, cpm, device: str) -> dict:
    grads = make_grads(torch, sizes, dtype, device)
    torch_ok = torch_supports(torch, dtype, device)
    verify(torch, amp, grads, dtype, torch_ok, device)
    nbytes = sum(g.numel() for g in grads) * grads[0].element_size()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    invs = [torch.full((), v, device=device, dtype=torch.float32) for v in INVS]
    found = torch.zeros((), device=device)
    toggle = [0]

    def inv():
        toggle[0] ^= 1
        return invs[toggle[0]]

    sides = {"vramkit": lambda: amp.non_finite_check_and_unscale_(grads, found, inv()),
             "copy": lambda: dst.copy_(src)}
    if torch_ok:
        sides["torch"] = lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv())
    times = measure(torch, sides, passes, warmup, cpm)
    assert found.item() == 0.0, f"{label}: found_inf set during the timed passes (values drifted?)"
    med = {n: {k: median(v) for k, v in t.items()} for n, t in times.items() if not n.startswith("_")}
    vk, cp = med["vramkit"]["kernel"], med["copy"]["kernel"]
    rec = {"case": label, "dtype": str(dtype).replace("torch.", ""), "tensors": len(sizes), "elements": sum(sizes),
           "bytes_moved": 2 * nbytes, "vramkit_ms": vk, "vramkit_gbs": 2 * nbytes / vk / 1e6, "copy_ms": cp,
           "copy_gbs": 2 * nbytes / cp / 1e6, "pct_of_copy": 100.0 * cp / vk, "vramkit_e2e_ms": med["vramkit"]["e2e"],
           "torch_ms": med["torch"]["kernel"] if torch_ok else None,
           "torch_e2e_ms": med["torch"]["e2e"] if torch_ok else None,
           "torch_over_vramkit": med["torch"]["kernel"] / vk if torch_ok else None,
           "torch_over_vramkit_e2e": med["torch"]["e2e"] / med["vramkit"]["e2e"] if torch_ok else None,
           "host_issue_ms": times["_host_issue_ms"], "kernel_time_is_gpu_only": bool(cpm),
           "passes": {n: t for n, t in times.items() if not n.startswith("_")},
           "spread": {n: spread(t["kernel"]) for n, t in times.items() if not n.startswith("_")}}
    rec["met_copy"] = rec["pct_of_copy"] >= 100 * COPY_TARGET
    rec["met_torch"] = None if not torch_ok else rec["torch_over_vramkit"] > 1.0
    return rec  # the set's memory is freed on return; main() empties torch's cache between sets


def fmt_table(recs: list[dict]) -> str:
    head = ("case", "dtype", "vramkit", "GB/s", "% copy (>=85)", "copy GB/s", "torch", "vs torch", "e2e vramkit",
            "e2e torch")
    rows = []
    for r in recs:
        t_ok = r["torch_ms"] is not None
        rows.append((r["case"], r["dtype"], f"{r['vramkit_ms']:.3f} ms", f"{r['vramkit_gbs']:.0f}",
                     f"{r['pct_of_copy']:.1f} %" + ("" if r["met_copy"] else " NO"), f"{r['copy_gbs']:.0f}",
                     f"{r['torch_ms']:.3f} ms" if t_ok else "not supported",
                     (f"{r['torch_over_vramkit']:.2f}x" + ("" if r["met_torch"] else " NO")) if t_ok else "-",
                     f"{r['vramkit_e2e_ms']:.3f} ms", f"{r['torch_e2e_ms']:.3f} ms" if t_ok else "-"))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]  # markdown, as gpu/alloc.py
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sets, few passes (seconds)")
    parser.add_argument("--passes", type=int, default=None, help="measured passes per side (default 21, quick 5)")
    parser.add_argument("--json", metavar="PATH", help="also write device info and every figure as JSON")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu/amp: torch is not installed; skipped (nothing to compare with)")
        return 0
    if not torch.cuda.is_available():
        print("gpu/amp: no CUDA device (torch.cuda.is_available() is False); skipped")
        return 0
    import vramkit
    from vramkit import amp

    device = f"cuda:{torch.cuda.current_device()}"
    try:  # vramkit built without its CUDA kernels raises here
        probe = torch.ones(4, device=device)
        amp.non_finite_check_and_unscale_([probe], torch.zeros((), device=device), torch.full((), 0.5, device=device))
        assert probe.eq(0.5).all().item()
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot benchmark here
        print(f"gpu/amp: vramkit's CUDA kernel cannot run here ({type(exc).__name__}: {exc}); "
              "build with VRAMKIT_CUDA=1; skipped")
        return 0
    BITS.update({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16})
    passes = args.passes or (5 if args.quick else 21)
    warmup = 2 if args.quick else 3
    cpm = sleep_cycles_per_ms(torch) if hasattr(torch.cuda, "_sleep") else None
    mi = 1 << 20
    cases = [("4 Mi / 200", tensor_sizes(4 * mi, 200)), ("200 x 4096", [4096] * 200)] if args.quick else \
        [("64 Mi / 200", tensor_sizes(64 * mi, 200)), ("512 Mi / 200", tensor_sizes(512 * mi, 200)),
         ("2000 x 4096", [4096] * 2000)]
    props = torch.cuda.get_device_properties(device)
    info = {"gpu": props.name, "memory_gib": round(props.total_memory / 2 ** 30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "vramkit": vramkit.__version__, "python": platform.python_version(),
            "passes": passes, "warmup": warmup, "quick": args.quick, "sleep_cycles_per_ms": cpm,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("gpu/amp — " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "sleep_cycles_per_ms"))
    if not cpm:
        print("(torch.cuda._sleep is missing: 'kernel' times include host issue time)")
    recs = []
    for label, sizes in cases:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            recs.append(run_case(torch, amp, label, sizes, dtype, passes, warmup, cpm, device))
            torch.cuda.empty_cache()  # 512 Mi fp32 sets take 6 GiB with the copy buffers
            print(f"  done: {label} {recs[-1]['dtype']}", file=sys.stderr, flush=True)
    print(fmt_table(recs))
    print("\nkernel = GPU time only (host issue hidden behind a queued sleep); e2e = host work included. "
          "GB/s = 2 x gradient bytes / kernel time; % copy = copy time / vramkit time.")
    write_json(args.json, info, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
