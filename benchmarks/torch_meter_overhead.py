"""torch_meter_overhead — what `vramkit run` costs a CPU PyTorch script (the live-tensor meter).

    PYTHONPATH=python python benchmarks/torch_meter_overhead.py

Times one training step (forward, backward) of a 24-block MLP (128 -> 512 -> 128, batch 256,
float32, one intra-op thread) three ways, passes interleaved, best of 7 after a warm-up:
plain; under `vramkit.torch.track()` (the meter: a TorchDispatchMode counting storages); and
under the recorder `vramkit run` uses (the meter plus each storage's Python stack and a
snapshot-format history). This model is many small operations, the worst case for a per-op
Python hook; large operations amortise it.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402

from vramkit.commands.run_torch import _make_recorder  # noqa: E402
from vramkit.torch import LiveMeter, _MeterMode  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                                                      torch.nn.Linear(512, 128)) for _ in range(24)])
    x = torch.randn(256, 128)

    def step() -> None:
        model(x).sum().backward()

    recorder = _make_recorder(100_000)
    sides = {"plain": None, "meter": lambda: _MeterMode(LiveMeter()), "recorder": lambda: _MeterMode(recorder)}
    best = {name: float("inf") for name in sides}
    step()
    for _ in range(7):
        for name, mode in sides.items():
            start = time.perf_counter()
            if mode is None:
                step()
            else:
                with mode():
                    step()
            best[name] = min(best[name], time.perf_counter() - start)
    print("| run | ms per step (best of 7) | vs plain |")
    print("|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / best['plain']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
