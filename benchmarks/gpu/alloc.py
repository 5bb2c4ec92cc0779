"""gpu/alloc — GPU allocation latency: vramkit's cuda pool against torch's caching allocator, CuPy's
memory pool and CUDA's stream-ordered allocator (cudaMallocAsync), over the same size sequence.

    PYTHONPATH=python python benchmarks/gpu/alloc.py                  # full run (needs a CUDA GPU)
    PYTHONPATH=python python benchmarks/gpu/alloc.py --quick          # seconds
    PYTHONPATH=python python benchmarks/gpu/alloc.py --json r.json    # also every figure as JSON
    PYTHONPATH=python python benchmarks/gpu/alloc.py --device sim     # no GPU: vramkit's rows only,
                                                                      # on a simulated device (a dry run)

Sizes: benchmarks/alloc.py's "realistic mix" (512 B - 64 MiB in three log-uniform bands that
mimic a training step's tensors; seed 1234), 20 000 sizes (2 000 with --quick). Every side is
warm (a discarded pass drew its segments first), which is the state a training loop runs in.
Medians of interleaved passes (ABBA), ns per alloc+free pair:

  * C level, no Python in the loop: `vramkit._C.bench_pool_pairs("cuda:0", sizes)` (vram_malloc +
    vram_free) against `vramkit._C.bench_cuda_async_pairs(0, sizes)` (cudaMallocAsync +
    cudaFreeAsync on the default stream and pool, release threshold at the maximum as PyTorch's
    cudaMallocAsync backend sets it; the pass ends with a stream synchronize).
  * Python level, each loop written the same way, `free(alloc(n))`:
      vramkit   `vramkit.raw_free(vramkit.raw_alloc(n, "cuda:0"))`
      torch     `torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(n))`
      CuPy      `pool.malloc(n)` dropped at once, on a private `cupy.cuda.MemoryPool()`
      async     `cupy.cuda.MemoryAsyncPool().malloc(n)` dropped at once (cudaMallocAsync)
    Target (issue 11): vramkit below torch's caching allocator.
  * Tensor level, what a training script pays: `torch.empty(n, dtype=torch.uint8,
    device="cuda")` then `del`, in a child Python with torch's own allocator and in one with
    vramkit's (`vramkit.torch.use_as_cuda_allocator()`); torch cannot switch allocators within a
    process, so the children run one after the other in the order torch, vramkit, vramkit, torch,
    and the passes are pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/, for _common and alloc

from _common import fmt_ns, interleaved, median, spread, use_source_tree, write_json  # noqa: E402

use_source_tree()


def sizes_for(n: int):
    from alloc import realistic_mix

    return realistic_mix(n)


def python_sides(device: str, sizes: list[int]) -> dict:
    """Pass functions (ns per pair) for each allocator present here, all looped alike."""
    import vramkit

    raw_alloc, raw_free = vramkit.raw_alloc, vramkit.raw_free
    n = len(sizes)

    def timed(loop):
        def one_pass() -> float:
            start = time.perf_counter_ns()
            loop()
            return (time.perf_counter_ns() - start) / n
        return one_pass

    def vramkit_loop() -> None:
        for size in sizes:
            raw_free(raw_alloc(size, device))

    sides = {"vramkit": timed(vramkit_loop)}
    if not device.startswith("cuda"):
        return sides
    try:
        import torch

        if torch.cuda.is_available():
            alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

            def torch_loop() -> None:
                for size in sizes:
                    delete(alloc(size))

            sides["torch"] = timed(torch_loop)
    except ImportError:
        pass
    try:
        import cupy

        pool = cupy.cuda.MemoryPool()

        def cupy_loop() -> None:
            for size in sizes:
                pool.malloc(size)  # the MemoryPointer dies at once: freed back to the pool

        sides["cupy"] = timed(cupy_loop)
        try:
            async_pool = cupy.cuda.MemoryAsyncPool()

            def async_loop() -> None:
                for size in sizes:
                    async_pool.malloc(size)
                cupy.cuda.Stream.null.synchronize()

            async_pool.malloc(512)  # raises where the driver has no stream-ordered allocator
            sides["async"] = timed(async_loop)
        except Exception:  # noqa: BLE001 -- not supported here: the row says so
            pass
    except ImportError:
        pass
    return sides


TENSOR_CHILD = r"""
import json, sys, time
import torch
which, n_sizes, passes, sizes_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if which == "vramkit":
    import vramkit.torch
    vramkit.torch.use_as_cuda_allocator()
sizes = json.load(open(sizes_path))[:n_sizes]
empty, u8 = torch.empty, torch.uint8
def one_pass():
    start = time.perf_counter_ns()
    for s in sizes:
        t = empty(s, dtype=u8, device="cuda")
        del t
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / len(sizes)
one_pass(); one_pass()
print(json.dumps([one_pass() for _ in range(passes)]))
"""


def tensor_level(sizes: list[int], passes: int, tmp: str) -> dict[str, list[float]]:
    sizes_path = os.path.join(tmp, "sizes.json")
    with open(sizes_path, "w") as f:
        json.dump(sizes, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(HERE)) + "/python",
                                                    env.get("PYTHONPATH")) if p)
    out: dict[str, list[float]] = {"torch": [], "vramkit": []}
    for which in ("torch", "vramkit", "vramkit", "torch"):
        proc = subprocess.run([sys.executable, "-c", TENSOR_CHILD, which, str(len(sizes)), str(max(1, passes // 2)),
                               sizes_path], capture_output=True, text=True, timeout=300, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"tensor-level child ({which}) failed:\n{proc.stderr[-2000:]}")
        out[which] += json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def row(name: str, vk: list[float], peer_name: str, peer: list[float] | None, target: str = "") -> dict:
    rec = {"case": name, "vramkit_ns": median(vk), "vramkit_spread": spread(vk), "peer": peer_name,
           "peer_ns": median(peer) if peer else None, "peer_spread": spread(peer) if peer else None, "target": target}
    rec["peer_over_vramkit"] = rec["peer_ns"] / rec["vramkit_ns"] if peer else None
    rec["met"] = (rec["vramkit_ns"] < rec["peer_ns"]) if (peer and target) else None
    return rec


def fmt_table(recs: list[dict]) -> str:
    head = ("case", "vramkit", "peer", "peer ns", "peer / vramkit", "target", "met?")
    cells = []
    for r in recs:
        have = r["peer_ns"] is not None
        cells.append((r["case"], fmt_ns(r["vramkit_ns"]), r["peer"], fmt_ns(r["peer_ns"]) if have else "not available",
                      f"{r['peer_over_vramkit']:.2f}x" if have else "-", r["target"] or "(info)",
                      "-" if r["met"] is None else ("yes" if r["met"] else "NO")))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 000 sizes, few passes (seconds)")
    parser.add_argument("--device", default="cuda:0",
                        help="vramkit device: cuda:N (default cuda:0), or 'sim' for a dry run without a GPU")
    parser.add_argument("--json", metavar="PATH", help="also write device info and every figure as JSON")
    args = parser.parse_args(argv)
    import vramkit
    from vramkit import _C

    if args.device == "sim":
        device = vramkit.sim.create(64 << 30)
    else:
        device = args.device
        if not vramkit.is_available("cuda"):
            print("gpu/alloc: vramkit sees no CUDA device (no GPU, or built without VRAMKIT_CUDA=1); skipped")
            return 0
    n = 2_000 if args.quick else 20_000
    passes, warmup = (5, 1) if args.quick else (15, 2)
    sizes = sizes_for(n)
    size_list = [int(s) for s in sizes]
    recs = []

    c_sides = {"vramkit": lambda: _C.bench_pool_pairs(device, sizes, 1)[0]}
    if device.startswith("cuda") and hasattr(_C, "bench_cuda_async_pairs"):
        index = int(device.partition(":")[2] or 0)
        c_sides["async"] = lambda: _C.bench_cuda_async_pairs(index, sizes, 1)[0]
    c = interleaved(c_sides, passes=passes, warmup=warmup)
    recs.append(row("C pair, realistic mix", c["vramkit"], "cudaMallocAsync+cudaFreeAsync", c.get("async"),
                    "< cudaMallocAsync"))

    py = interleaved(python_sides(device, size_list), passes=passes, warmup=warmup)
    recs.append(row("Python pair, realistic mix", py["vramkit"], "torch caching_allocator_alloc+delete",
                    py.get("torch"), "< torch"))
    recs.append(row("Python pair, realistic mix", py["vramkit"], "CuPy MemoryPool", py.get("cupy")))
    recs.append(row("Python pair, realistic mix", py["vramkit"], "CuPy MemoryAsyncPool (cudaMallocAsync)",
                    py.get("async")))

    if device.startswith("cuda"):
        import tempfile

        try:
            import torch  # noqa: F401

            with tempfile.TemporaryDirectory() as tmp:
                t = tensor_level(size_list, passes, tmp)
            recs.append(row("torch.empty + del", t["vramkit"], "torch's caching allocator", t["torch"], "< torch"))
        except ImportError:
            pass

    info = {"device": device, "vramkit": vramkit.__version__, "python": platform.python_version(), "sizes": n,
            "passes": passes, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import torch

        if torch.cuda.is_available():
            info.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda)
    except ImportError:
        pass
    print("gpu/alloc — " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(fmt_table(recs))
    write_json(args.json, info, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
