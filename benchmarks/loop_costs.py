"""loop_costs — vramkit in the training loop against what it replaces, all of issue 35 in one table.

One row per figure the issue sets a target for, each as vramkit's cost over its peer's, measured
in this run (a ratio below 1 is vramkit cheaper):

  1. loss scaling's host path: ``vramkit.amp.non_finite_check_and_unscale_`` against
     ``torch._amp_foreach_non_finite_check_and_unscale_`` (200 and 2,000 tensors, dense and
     strided, fp32/fp16/bf16; ``amp_host.py``), and a training step with each GradScaler;
  2. the kernels: on the CPU against NumPy (target: 1.5x faster) and torch (faster), ``amp.py``;
     on a GPU, the fraction of a same-size device copy (target 85 %), ``gpu/amp.py``;
  3. vramkit as torch's allocator: the torch hooks over vramkit's own pair and torch's
     bookkeeping around them (``torch_glue.py``), and on a GPU ``torch.empty`` + ``del`` against
     torch's own allocator (target 1.05), ``gpu/alloc.py``;
  4. (PyTorch's allocator checks are tests: tests/unit/test_allocator_consistency.py.)

GPU rows appear when torch sees a CUDA device and vramkit was built with its CUDA kernels.

    PYTHONPATH=python python benchmarks/loop_costs.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import use_source_tree  # noqa: E402

use_source_tree()


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_loop_costs_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(part: str, what: str, mine: str, peer: str, cost: float, target: float, strict: bool = False) -> dict:
    met = cost < target if strict else cost <= target
    return {"part": part, "what": what, "vramkit": mine, "peer": peer, "cost": cost,
            "target": f"{'<' if strict else '<='} {target:.2f}", "met": met}


def host_rows(quick: bool) -> list[dict]:
    import torch

    bench = _load("amp_host")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the host's cost of one call, as amp_host.py measures it)
    try:
        return _host_rows(bench, torch, 200 if quick else 1000)
    finally:
        torch.set_num_threads(threads)  # the kernel rows run torch as a user would, on every core


def _host_rows(bench, torch, reps: int) -> list[dict]:
    rows = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        for count in (200, 2000):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for strided in (False, True):
                    bench.check_bits(count, dtype, strided, device)
                    mine, theirs = bench.per_call(count, dtype, strided, device, reps if count == 200 else reps // 4)
                    rows.append(row("1 host", f"unscale, {device}, {count} x {str(dtype)[6:]}, "
                                    f"{'strided' if strided else 'dense'}", f"{mine:.1f} us", f"{theirs:.1f} us",
                                    mine / theirs, 1.0))
        mine, theirs = bench.mlp_step_times(100, device, reps // 2)
        rows.append(row("1 host", f"GradScaler training step, {device}, 100-layer MLP", f"{mine:.2f} ms",
                        f"{theirs:.2f} ms", mine / theirs, 1.02))
    return rows


def cpu_kernel_rows(quick: bool) -> list[dict]:
    bench = _load("amp")
    rows = []
    for r in bench.run(quick=quick):
        if r.met is None or "unscale_ " not in r.benchmark or "copy" in r.benchmark or "norm" in r.benchmark:
            continue
        versus_numpy = "NumPy" in r.benchmark
        rows.append(row("2 kernels", r.benchmark.replace("amp: ", "cpu "), r.vramkit_text, r.peer_text,
                        r.vramkit / r.peer, 1 / 1.5 if versus_numpy else 1.0, strict=not versus_numpy))
    return rows


def glue_rows(quick: bool) -> list[dict]:
    r = _load("torch_glue").measure("sim", 2_000 if quick else 20_000, 5 if quick else 15)
    return [row("3 allocator", "torch hooks over vramkit's pair (sim device, C loops)", f"{r['hooks']:.1f} ns",
                f"{r['direct']:.1f} ns", r["hooks"] / r["direct"], 1.05),
            {**row("3 allocator", "... inside CUDAPluggableAllocator's bookkeeping (stand-in; info)",
                   f"{r['hooks_and_bookkeeping']:.1f} ns", f"{r['direct']:.1f} ns",
                   r["hooks_and_bookkeeping"] / r["direct"], 1.05), "target": "(info)", "met": None}]


def gpu_rows(quick: bool, results_dir: str | None = None) -> list[dict]:
    """The GPU scripts' rows: run here, or read from ``results_dir`` (their ``amp.json`` and
    ``alloc.json``, as gpu/run_all.sh writes them) so a GPU run does not measure them twice."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.join(os.path.dirname(HERE), "python"),
                                                                     os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        for script in ("amp", "alloc"):
            out = os.path.join(results_dir or tmp, f"{script}.json")
            ok = True
            if results_dir is None:
                args = [sys.executable, os.path.join(HERE, "gpu", f"{script}.py"), "--json", out] + \
                    (["--quick"] if quick else [])
                ok = subprocess.run(args, capture_output=True, text=True, env=env, check=False,
                                    timeout=3000).returncode == 0
            if not ok or not os.path.exists(out):
                rows.append({"part": "gpu", "what": f"gpu/{script}.py failed or was skipped", "vramkit": "-", "peer": "-",
                             "cost": float("nan"), "target": "-", "met": False})
                continue
            with open(out) as f:
                results = json.load(f)["results"]
            for r in results:
                if script == "amp":
                    rows.append(row("2 kernels", f"cuda {r['case']} {r['dtype']} vs a device copy",
                                    f"{r['vramkit_ms']:.3f} ms", f"{r['copy_ms']:.3f} ms",
                                    r["vramkit_ms"] / r["copy_ms"], 1 / 0.85))
                elif r["case"] == "torch.empty + del":
                    rows.append(row("3 allocator", "torch.empty + del, vramkit as torch's allocator",
                                    f"{r['vramkit_ns']:.0f} ns", f"{r['peer_ns']:.0f} ns",
                                    r["vramkit_ns"] / r["peer_ns"], 1.05))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and smaller sets (a smoke run)")
    parser.add_argument("--gpu-results", metavar="DIR",
                        help="read the GPU rows from DIR/amp.json and DIR/alloc.json instead of running them")
    args = parser.parse_args(argv)
    rows = host_rows(args.quick) + cpu_kernel_rows(args.quick) + glue_rows(args.quick) + \
        gpu_rows(args.quick, args.gpu_results)
    print("| part | what | vramkit | peer | vramkit / peer (cost) | target | met |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"| {r['part']} | {r['what']} | {r['vramkit']} | {r['peer']} | {r['cost']:.2f} | {r['target']} | {met} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
