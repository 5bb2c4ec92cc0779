"""checkpoint_torch — vramkit's planned checkpointing against torch's checkpoint_sequential.

What it measures
  Two chains trained with torch (CPU by default, `--device cuda` on a GPU):
    mlp24        24 residual MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d), the
                 homogeneous case checkpoint_sequential is made for;
    transformer  a small decoder: 6 x (attention block, MLP block) and a vocabulary head, a
                 heterogeneous chain (the head's logits are several times a block's activations).
  A step is forward + loss + backward (parameter gradients preallocated, so they are not
  activation memory). Its peak activation memory is measured with vramkit.torch.track() on
  CPU (live tensor storages created during the step) and with torch.cuda.max_memory_allocated
  above the step's starting point on CUDA.

  Budgets are 20 %, 40 % and 60 % of the measured store-everything peak (the loss included).
  At each budget:
    vramkit  vramkit.checkpoint.Sequential(blocks, budget=bytes, loss_fn=loss) (profiled and
             planned once, outside the timing; the loss is profiled too, so the budget covers
             it);
    torch    torch.utils.checkpoint.checkpoint_sequential(blocks, k, x, use_reentrant=False)
             for every segment count k; of those whose measured peak fits the budget, the
             fastest (so the peer gets its best choice, which its users have to guess): every
             k is screened for step time, and the two fastest that fit are timed again, beside
             vramkit, and the faster of them reported.
  Step times are medians of interleaved passes; the overhead is step time / store-everything
  step time - 1. Two more budgets: "torch's least", the smallest peak any segment count
  reaches, and "vramkit's least", the planner's minimum budget (torch is then compared at the
  peak vramkit measured there).

  `--quick` runs smaller models with fewer passes (a smoke run, not for the record).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from vramkit import checkpoint as ck  # noqa: E402
from vramkit.torch import track  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------- models


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class AttentionBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # explicit softmax attention (what the math backend does): the t x t scores are saved
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.out(y)


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, vocab)

    def forward(self, x):
        return self.proj(self.norm(x))


def make_model(name: str, quick: bool, device: torch.device):
    torch.manual_seed(0)
    if name == "mlp24":
        d, batch = (128, 256) if quick else (256, 512)
        blocks = [MLPBlock(d, 4 * d) for _ in range(24)]
        x = torch.randn(batch, d)
        target = torch.randn(batch, d)

        def loss_fn(out):
            return F.mse_loss(out, target)
    elif name == "transformer":
        b, t, d, heads, vocab, layers = (2, 64, 64, 4, 512, 3) if quick else (4, 256, 256, 4, 4096, 6)
        blocks = []
        for _ in range(layers):
            blocks += [AttentionBlock(d, heads), MLPBlock(d, 4 * d)]
        blocks.append(Head(d, vocab))
        x = torch.randn(b, t, d)
        target = torch.randint(0, vocab, (b, t))

        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), target.flatten())
    else:
        raise ValueError(name)
    blocks = [m.to(device) for m in blocks]
    x, target = x.to(device), target.to(device)
    return blocks, x, loss_fn


# ----------------------------------------------------------------------------- measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_peak(forward, x: torch.Tensor, loss_fn) -> int:
    """Peak activation bytes of one forward + loss + backward."""
    gc.collect()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        base = torch.cuda.memory_allocated(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        xx = x.clone()
        loss_fn(forward(xx)).backward()
        del xx
        torch.cuda.synchronize(x.device)
        return torch.cuda.max_memory_allocated(x.device) - base
    with track() as m:
        xx = x.clone()
        loss_fn(forward(xx)).backward()
        del xx
    return m.peak


def step_time(forward, x: torch.Tensor, loss_fn) -> float:
    _sync(x.device)
    t0 = time.perf_counter()
    loss_fn(forward(x.clone())).backward()
    _sync(x.device)
    return time.perf_counter() - t0


def zero_grads(blocks) -> None:
    for m in blocks:
        for p in m.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # in place from now on: gradients are not activations
            else:
                p.grad.zero_()


def timed(sides: dict, x, loss_fn, blocks, passes: int) -> dict:
    """Median step time of each side, passes interleaved (one warm-up pass each)."""
    out = {k: [] for k in sides}
    for r in range(passes + 1):
        for k, fwd in sides.items():
            zero_grads(blocks)
            t = step_time(fwd, x, loss_fn)
            if r:
                out[k].append(t)
    return {k: statistics.median(v) for k, v in out.items()}


def run_model(name: str, quick: bool, device: torch.device, passes: int) -> list[dict]:
    blocks, x, loss_fn = make_model(name, quick, device)
    L = len(blocks)
    plain = nn.Sequential(*blocks)
    zero_grads(blocks)
    full_peak = step_peak(plain, x, loss_fn)
    torch_fns = {k: (lambda inp, k=k: torch.utils.checkpoint.checkpoint_sequential(blocks, k, inp,
                                                                                      use_reentrant=False))
                 for k in range(1, L + 1)}
    torch_peaks = {}
    for k, fwd in torch_fns.items():
        zero_grads(blocks)
        torch_peaks[k] = step_peak(fwd, x, loss_fn)
    # a screening of every segment count's step time (it does not depend on the budget); the two
    # fastest that fit each budget are timed again beside vramkit
    screen = timed({k: f for k, f in torch_fns.items()}, x, loss_fn, blocks, max(1, passes // 2))
    stages = ck.profile(blocks, x)
    with torch.no_grad():
        loss_stage = ck.profile_loss(loss_fn, plain(x))
    full_pred = ck.plan(stages, None, "none", loss=loss_stage).predicted_peak
    least = ck.min_budget(stages, loss=loss_stage)

    rows = []
    torch_min = min(torch_peaks.values())
    targets = [(f"{int(f * 100)} %", int(f * full_peak)) for f in (0.2, 0.4, 0.6)]
    targets.append(("torch's least", torch_min))  # the smallest peak any segment count reaches
    targets.append(("vramkit's least", None))  # the planner's minimum budget
    for label, budget in targets:
        t0 = time.perf_counter()
        ours = ck.Sequential(blocks, budget=budget if budget is not None else least, loss_fn=loss_fn)
        try:
            sched = ours.schedule_for(x)
        except ck.BudgetTooSmallError:
            sched = None  # below the least budget any schedule needs (one stage's backward)
        plan_s = time.perf_counter() - t0
        zero_grads(blocks)
        our_peak = step_peak(ours, x, loss_fn) if sched else None
        limit = budget if budget is not None else (our_peak or 0)
        fitting = sorted((k for k, p in torch_peaks.items() if p <= limit), key=lambda k: screen[k])[:2]
        sides = {"plain": plain, **({"vramkit": ours} if sched else {})}
        sides.update({f"torch k={k}": torch_fns[k] for k in fitting})
        times = timed(sides, x, loss_fn, blocks, passes)
        best_k = min(fitting, key=lambda k: times[f"torch k={k}"]) if fitting else None
        rows.append({
            "model": name, "L": L, "budget_label": label, "budget": budget, "full_peak": full_peak,
            "full_pred": full_pred, "least_pred": least, "plan_s": plan_s, "schedule": sched,
            "ours_peak": our_peak, "ours_pred": sched.predicted_peak if sched else None,
            "ours_time": times.get("vramkit"),
            "plain_time": times["plain"], "torch_k": best_k,
            "torch_peak": torch_peaks[best_k] if best_k else None,
            "torch_time": times[f"torch k={best_k}"] if best_k else None,
            "torch_min_peak": min(torch_peaks.values()),
        })
    return rows


def fmt_mib(b) -> str:
    return "—" if b is None else f"{b / MiB:.1f} MiB"


def print_table(rows: list[dict], device: torch.device) -> None:
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print("| model | budget | vramkit peak (predicted) | vramkit overhead | torch k | torch peak | torch overhead |"
          " overhead ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = r["budget_label"] if r["budget"] is None else f"{r['budget_label']} = {fmt_mib(r['budget'])}"
        if r["ours_time"] is None:
            ov = None
            ours = f"below least ({fmt_mib(r['least_pred'])})"
        else:
            ov = r["ours_time"] / r["plain_time"] - 1
            fits = r["budget"] is None or r["ours_peak"] <= r["budget"]
            ours = f"{fmt_mib(r['ours_peak'])} ({fmt_mib(r['ours_pred'])}){'' if fits else ' OVER'}"
        if r["torch_k"] is None:
            tk, tp, tov, ratio = "none fits", f"(least {fmt_mib(r['torch_min_peak'])})", "—", "—"
        else:
            tov_v = r["torch_time"] / r["plain_time"] - 1
            tk, tp, tov = str(r["torch_k"]), fmt_mib(r["torch_peak"]), f"{tov_v * 100:+.1f} %"
            ratio = "—" if ov is None else f"{(1 + tov_v) / (1 + ov):.3f}x"
        ovs = "—" if ov is None else f"{ov * 100:+.1f} %"
        print(f"| {r['model']} (L={r['L']}) | {budget} | {ours} | {ovs} | {tk} | {tp} | {tov} | {ratio} |")
    for name in dict.fromkeys(r["model"] for r in rows):
        r = next(r for r in rows if r["model"] == name)
        print(f"{name}: store-everything measured {fmt_mib(r['full_peak'])} (predicted {fmt_mib(r['full_pred'])}), "
              f"step {r['plain_time'] * 1e3:.1f} ms; planner least {fmt_mib(r['least_pred'])}; "
              f"profile + plan {r['plan_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="small models, few passes (smoke run)")
    ap.add_argument("--passes", type=int, default=None, help="timed passes per side (default 7, quick 2)")
    ap.add_argument("--models", default="mlp24,transformer")
    args = ap.parse_args()
    device = torch.device(args.device)
    passes = args.passes or (2 if args.quick else 7)
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args.quick, device, passes)
    print_table(rows, device)


if __name__ == "__main__":
    main()
