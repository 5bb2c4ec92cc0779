"""amp_host — the host cost of loss scaling in a training loop: vramkit against torch, same process.

Issue 35's first target: a call of ``vramkit.amp.non_finite_check_and_unscale_`` costs the host
no more than torch's ``torch._amp_foreach_non_finite_check_and_unscale_`` over the same
gradients (200 and 2,000 small tensors; dense and strided; float32, float16, bfloat16; CPU, and
CUDA when there is one), and a whole training step with ``vramkit.amp.GradScaler`` (scale,
backward, unscale_, step, update) no more than 1.02x the same step with ``torch.amp.GradScaler``.

Each figure is the median of many calls, the two sides interleaved (A, B, A, B ...) so that a
change in the machine's load falls on both; the gradients are tiny (64 elements: what is timed
is the walk over the list, not arithmetic), finite, and fresh for every call pair. Results are
checked bit for bit against torch's before anything is timed.

    PYTHONPATH=python python benchmarks/amp_host.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402

import vramkit.amp as va  # noqa: E402


def grads_for(count: int, dtype: torch.dtype, strided: bool, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if strided:  # every other column of an 8x16 block: 64 elements, not contiguous
        return [torch.randn(8, 16, generator=g).to(device=device, dtype=dtype)[:, ::2] for _ in range(count)]
    return [torch.randn(64, generator=g).to(device=device, dtype=dtype) for _ in range(count)]


def check_bits(count: int, dtype: torch.dtype, strided: bool, device: str) -> None:
    """vramkit's unscale writes what torch's does, bit for bit, and finds what it finds."""
    for poison in (False, True):
        a, b = grads_for(count, dtype, strided, device, 1), grads_for(count, dtype, strided, device, 1)
        if poison:
            a[count // 2].view(-1)[3] = float("inf")
            b[count // 2].view(-1)[3] = float("inf")
        fa, fb = torch.zeros(1, device=device), torch.zeros(1, device=device)
        inv = torch.full((1,), 1 / 1024, device=device)
        va.non_finite_check_and_unscale_(a, fa, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(b, fb, inv)
        ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
        if fa.item() != fb.item() or not all(torch.equal(x.view(ints), y.view(ints)) for x, y in zip(a, b)):
            raise SystemExit(f"vramkit and torch differ: {count} {dtype} strided={strided} {device} poison={poison}")


def per_call(count: int, dtype: torch.dtype, strided: bool, device: str, reps: int) -> tuple[float, float]:
    """Median microseconds a call: (vramkit, torch)."""
    # Each side walks its own copies of the same gradients: had they shared a list, the second
    # to run on it would find the tensors in cache that the first had just brought in.
    sets = {side: [grads_for(count, dtype, strided, device, s) for s in range(4)] for side in ("mine", "theirs")}
    # A real unscale writes every gradient (inv_scale is 1/scale, not 1): halve, then double, so
    # the values stay finite over thousands of calls and both sides write on every call.
    f = torch.zeros(1, device=device)
    invs = (torch.full((1,), 0.5, device=device), torch.full((1,), 2.0, device=device))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    mine: list[float] = []
    theirs: list[float] = []
    for i in range(reps):
        for fn, out, side in ((va.non_finite_check_and_unscale_, mine, "mine"),
                              (torch._amp_foreach_non_finite_check_and_unscale_, theirs, "theirs")):
            g, inv = sets[side][i % 4], invs[(i // 4) % 2]
            sync()
            t0 = time.perf_counter()
            fn(g, f, inv)
            out.append(time.perf_counter() - t0)  # the host's time: the call returns before a GPU finishes
    sync()
    return statistics.median(mine[reps // 10:]) * 1e6, statistics.median(theirs[reps // 10:]) * 1e6


def mlp_step_times(layers: int, device: str, reps: int) -> tuple[float, float]:
    """Median milliseconds of one training step (forward, scaled backward, unscale_, step,
    update) of a `layers`-deep MLP of width 64 (2 * layers parameters), each scaler."""
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).to(device)

    runs = []
    for scaler_cls in (va.GradScaler, torch.amp.GradScaler):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        scaler = scaler_cls(device) if scaler_cls is torch.amp.GradScaler else scaler_cls()
        x = torch.randn(32, 64, device=device)

        def step():
            loss = m(x).square().mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        runs.append((step, []))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(reps):
        for step, out in runs:
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            out.append(time.perf_counter() - t0)
    (_, mine), (_, theirs) = runs
    return statistics.median(mine[reps // 10:]) * 1e3, statistics.median(theirs[reps // 10:]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    reps = 200 if args.quick else 1000
    print(f"torch {torch.__version__}, vramkit SIMD path {va.simd_path()}, one thread; median of {reps} calls each, "
          "interleaved")
    print()
    print("| device | tensors | dtype | layout | vramkit (us) | torch (us) | vramkit / torch (target <= 1) |")
    print("|---|---|---|---|---|---|---|")
    for device in devices:
        for count in (200, 2000):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for strided in (False, True):
                    check_bits(count, dtype, strided, device)
                    mine, theirs = per_call(count, dtype, strided, device, reps if count == 200 else reps // 4)
                    print(f"| {device} | {count} | {str(dtype)[6:]} | {'strided' if strided else 'dense'} | "
                          f"{mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |", flush=True)
    print()
    print("| device | step | vramkit GradScaler (ms) | torch GradScaler (ms) | vramkit / torch (target <= 1.02) |")
    print("|---|---|---|---|---|")
    for device in devices:
        mine, theirs = mlp_step_times(100, device, reps // 2)
        print(f"| {device} | 100-layer MLP, 200 parameters, SGD | {mine:.2f} | {theirs:.2f} | {mine / theirs:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
