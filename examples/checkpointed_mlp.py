"""The bundled example's second part (when PyTorch is installed): a deep residual MLP trained
with a planned activation-checkpoint schedule inside 30 % of the activation memory that
storing everything needs.

`vramkit.checkpoint.Sequential(blocks, budget=0.3, loss_fn=...)` profiles the chain once
(times, saved tensors, transients, and the loss), plans the schedule with the least
recomputation that fits, and runs it; `vramkit.torch.track()` measures the live tensor memory
of a training step, so the plan's prediction can be compared with what the step really used.
Run it directly too: `python checkpointed_mlp.py`.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from vramkit import checkpoint as ck
from vramkit.torch import track

MiB = 1 << 20


class Block(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 norm(x))."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """One SGD step; (loss, peak bytes of the tensors it created: activations, not weights)."""
    opt.zero_grad(set_to_none=False)  # gradients stay allocated: they are not activation memory
    with track() as meter:
        loss = F.mse_loss(model(x), y)
        loss.backward()
    opt.step()
    return loss.item(), meter.peak


def run(steps: int = 6, blocks: int = 24, width: int = 128, batch: int = 256, budget: float = 0.3) -> None:
    torch.manual_seed(0)
    layers = [Block(width, 4 * width) for _ in range(blocks)]
    teacher = nn.Linear(width, width)
    x = torch.randn(batch, width)
    with torch.no_grad():
        y = torch.tanh(teacher(x))

    def loss_fn(out):  # the planner measures the loss too, so the budget covers it
        return F.mse_loss(out, y)

    plain = nn.Sequential(*copy.deepcopy(layers))
    planned = ck.Sequential(copy.deepcopy(layers), budget=budget, loss_fn=loss_fn)
    t0 = time.perf_counter()
    schedule = planned.schedule_for(x)
    plan_s = time.perf_counter() - t0
    print()
    print(f"activation checkpointing: {blocks} residual MLP blocks ({width} -> {4 * width} -> {width}), "
          f"batch {batch}, budget {budget:.0%} of storing everything")
    print(f"plan (profiled and planned in {plan_s:.2f} s): {schedule!r}")
    recomputed = schedule.count("forward_nosave") + schedule.count("forward_check") + \
        schedule.count("forward_all") - blocks
    print(f"  {recomputed} stage forwards recomputed; predicted peak {schedule.predicted_peak / MiB:.2f} MiB "
          f"within a budget of {schedule.budget / MiB:.2f} MiB")
    results = {}
    for name, model in (("store everything", plain), ("vramkit plan", planned)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # allocated up front, so the meter sees activations only
        losses, peaks, times = [], [], []
        for _ in range(steps):
            t = time.perf_counter()
            loss, peak = _step(model, opt, x, y)
            times.append(time.perf_counter() - t)
            losses.append(loss)
            peaks.append(peak)
        results[name] = (losses, max(peaks), sorted(times)[len(times) // 2])
    (ref_losses, ref_peak, ref_time), (losses, peak, step_s) = results["store everything"], results["vramkit plan"]
    print(f"  store everything: activation peak {ref_peak / MiB:.2f} MiB, step {ref_time * 1e3:.0f} ms, "
          f"loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")
    print(f"  vramkit plan:     activation peak {peak / MiB:.2f} MiB ({peak / ref_peak:.0%}), "
          f"step {step_s * 1e3:.0f} ms ({step_s / ref_time - 1:+.0%}), loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    same = max(abs(a - b) for a, b in zip(ref_losses, losses))
    print(f"checkpointed training: measured peak {peak:,} B vs predicted {schedule.predicted_peak:,} B; "
          f"largest loss difference from storing everything {same:.1e}")


if __name__ == "__main__":
    run()
