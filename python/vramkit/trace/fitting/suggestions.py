"""What makes a batch size fit that does not: ``suggest`` tries allocator options, the optimizer
one parameter at a time, the sharding changes, bf16 autocast, gradient accumulation and
activation checkpointing, alone and combined, each through ``fit``'s probe (a replay of a
captured or derived trace), and returns the cheapest that fit, each with its cost."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..._core.sizes import format_size
from ..replaying.replay_sim import Prediction
from ..sharding.sharding_changes import change_for, sharding_cost
from ..target.dispatch import CudaChoices
from .probes import Probe, middle_half

__all__ = ["Suggestion", "suggest", "without_foreach"]


@dataclass
class Suggestion:
    """A change that makes the target batch size fit, with its predicted peak and its cost."""

    change: str
    settings: dict[str, Any]
    prediction: Prediction
    cost: str


def without_foreach(choices: CudaChoices) -> CudaChoices:
    """The target's dispatch choices with CUDA's foreach optimizer choice not made: what
    ``foreach=False`` gives."""
    return replace(choices, optimizer=False)


# Tried in this order, each replayed with PyTorch's policy for it (expandable segments with
# PyTorch's 20 MiB pages); the first that fits is suggested, with what it costs.
_ALLOCATOR_OPTIONS = (
    ("expandable_segments:True", "none in memory; new pages are mapped as segments grow (the first steps are a "
                                 "little slower) and tensors cannot be shared with other processes over CUDA IPC"),
    ("max_split_size_mb:512", "none in memory; the allocator splits or frees cached blocks more often"),
    ("max_split_size_mb:128", "none in memory; the allocator splits or frees cached blocks more often"),
    ("garbage_collection_threshold:0.6", "none in memory; the allocator splits or frees cached blocks more often"),
)


def suggest(probe: Callable[..., Probe], wanted: int, pred: Prediction, alloc_conf: str | None,
            foreach: bool = False, bf16: bool = True, sharding: list[str] | None = None,
            amp: bool = True) -> list[Suggestion]:
    """The cheapest changes that make batch size `wanted` fit (`pred`: its prediction as
    written; `alloc_conf`: the target's allocator options): every single change that does, else
    every pair, and so on (allocator options are tried alone, when only fragmentation fails). With
    `foreach` (the step's optimizer runs CUDA's multi-tensor implementation), running it one
    parameter at a time is one of the changes. `sharding`: the sharding changes of a sharded
    step (``sharding_changes.sharding_techniques``), each one more technique. `amp`: whether
    bf16 autocast is one (not where FSDP2 already gathers parameters in bf16)."""
    out: list[Suggestion] = []
    # Fragmentation: the live bytes would fit but the reserved segments do not.
    if pred.oom and pred.oom.get("allocated", 0) + pred.oom.get("size", 0) <= pred.usable:
        for option, cost in _ALLOCATOR_OPTIONS:
            base = alloc_conf
            if base and option.split(":")[0] in base:
                continue  # the user's own setting stays
            conf = option if not base else f"{base},{option}"
            p = probe(wanted, conf)
            if p.fits:
                out.append(Suggestion(f"PYTORCH_CUDA_ALLOC_CONF={conf}", {"alloc_conf": conf}, p.prediction, cost))
                break
    blocks = probe(wanted, alloc_conf, True).prediction.checkpointed_blocks
    found: dict[frozenset[str], int] = {}  # techniques (without accumulation) -> micro-batches needed
    sharding = [t for t in sharding or () if t != "mp" or bf16]  # (FSDP2 in fp16 needs a sharded grad scaler)
    techniques_here = ((["loop"] if foreach else []) + sharding + (["amp"] if amp else []) + ["accumulate"]
                       + (["checkpoint"] if blocks else []))
    combos = [c for r in range(1, len(techniques_here) + 1) for c in itertools.combinations(techniques_here, r)
              if not ("fsdp" in sharding and "mp" in c and "fsdp" not in c)]  # a DDP script: bf16 needs FSDP2
    base_sent = pred.communication_sent
    # Out of memory while the builder sets up (before any forward): a change to the forward,
    # the backward or the optimizer alone leaves that part of the trace as it is.
    in_setup = (pred.oom or {}).get("phase") == "setup"
    for combo in combos:
        if in_setup and set(combo) <= {"amp", "checkpoint", "loop"}:
            continue
        techniques = frozenset(c for c in combo if c != "accumulate")
        # A combination is worth reporting only if every smaller one needs more micro-batches.
        if any(t <= techniques and t != techniques for t in found if found[t] == 1):
            continue
        s = _try(probe, wanted, alloc_conf, combo, blocks, bf16, base_sent)
        if s is None:
            continue
        k = s.settings.get("accumulation_steps", 1)
        if any(t <= techniques and found[t] <= k for t in found):
            continue
        found[techniques] = k
        out.append(s)
    return out


_LOOP_COST = ("optimizer.step() runs a loop of per-parameter kernels instead of CUDA's default multi-tensor (foreach) "
              "ones, which hold a temporary for every parameter at once (Adam: the square root of every exp_avg_sq); "
              "a slower step, the same result; pass foreach=False to the optimizer")
_FP16_COST = ("the forward under torch.autocast(\"cuda\", dtype=torch.float16) with a torch.amp.GradScaler (this GPU has "
              "no bf16 kernels: compute capability below 8.0); weights, gradients and optimizer state stay float32")
_AMP_COST = ("the forward under torch.autocast(\"cuda\", dtype=torch.bfloat16) (float16 takes the same memory and "
             "needs a GradScaler); weights, gradients and optimizer state stay float32; usually faster on tensor cores")


def _try(probe: Callable[..., Probe], wanted: int, alloc_conf: str | None, combo: tuple[str, ...],
         blocks: str, bf16: bool = True, base_sent: int | None = None) -> Suggestion | None:
    """Probe one combination; with "accumulate", the fewest micro-batches (dividing `wanted`)
    that fit. Autocast is to bf16, or to fp16 on a GPU without bf16 (compute capability < 8)."""
    import torch

    amp = (torch.bfloat16 if bf16 else torch.float16) if "amp" in combo else None
    ckpt = "checkpoint" in combo
    loop = "loop" in combo
    change = change_for(combo)
    if "accumulate" in combo:
        sizes = [(wanted // k, k) for k in range(2, wanted + 1) if wanted % k == 0]
    else:
        sizes = [(wanted, 1)]
    for micro, k in sizes:
        more: dict[str, Any] = {"loop": True} if loop else {}  # (a probe without the option serves the rest)
        if change is not None:
            more["sharding"] = change
        if loop and _before_the_optimizer(probe(micro, alloc_conf, ckpt, amp, sharding=change).prediction):
            continue  # the same trace up to there with either implementation: the loop cannot help
        p = probe(micro, alloc_conf, ckpt, amp, **more)
        if not p.fits:
            continue
        count = total = p.prediction.checkpointed_count
        if ckpt and k == 1:
            count, p = _fewest_blocks(lambda c: probe(micro, alloc_conf, c or False, amp, **more), total, p)
        settings: dict[str, Any]
        parts, costs, settings = [], [], {}
        for technique in (t for t in combo if change is not None and t in ("fsdp", "reshard", "mp", "offload")):
            parts.append({"fsdp": "FSDP2 instead of DDP", "reshard": "reshard_after_forward=True",
                          "mp": "FSDP2's bf16 MixedPrecisionPolicy", "offload": "FSDP2's CPUOffloadPolicy"}[technique])
            costs.append(sharding_cost(technique, blocks))
            settings[technique] = True
            if technique == "offload" and p.prediction.host_bytes:
                costs.append(f"{format_size(p.prediction.host_bytes)} of host memory per rank")
        if change is not None and p.prediction.communication_sent is not None and base_sent is not None:
            sent = p.prediction.communication_sent
            costs.append(f"this rank sends {format_size(sent)} per step in collectives ({_signed(sent - base_sent)} "
                         f"against the script as written)")
        if loop:
            parts.append("the optimizer one parameter at a time (foreach=False)")
            costs.append(_LOOP_COST)
            settings["foreach"] = False
        if amp is not None:
            parts.append("bf16 autocast" if bf16 else "fp16 autocast")
            costs.append(_AMP_COST if bf16 else _FP16_COST)
            settings["autocast"] = "bfloat16" if bf16 else "float16"
        if ckpt:
            which = "every block" if count == total else f"the first {count} of the {total} blocks"
            parts.append(f"activation checkpointing of {which} in {blocks}")
            costs.append(f"the backward recomputes those blocks' forwards: {count} block forward(s) more per step, "
                         f"{count / total:.0%} of a forward pass of {blocks} "
                         "(torch.utils.checkpoint(block, x, use_reentrant=False) around each)")
            settings["checkpoint_blocks"] = blocks
            settings["checkpointed_count"] = count
        if k > 1:
            parts.append(f"gradient accumulation: {k} micro-batches of {micro}")
            costs.append(f"{k} forward/backward passes per optimizer step (same samples, smaller kernels; gradients "
                         "stay allocated between micro-batches, as in this step)")
            settings.update(micro_batch_size=micro, accumulation_steps=k)
        return Suggestion(" + ".join(parts), settings, p.prediction, "; ".join(costs))
    return None


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_size(abs(n))


def _fewest_blocks(probe_at: Callable[[int], Probe], total: int, fits_all: Probe) -> tuple[int, Probe]:
    """The fewest repeated blocks (the first ones: their recomputation comes at the end of the
    backward, when most activations are freed) whose checkpointing fits, and its probe;
    `fits_all` is the probe with all `total` checkpointed, which fits.

    A bisection, but each probe is placed where the line through the peaks live at the
    bracket's ends crosses the largest live peak that fits (the fitting end's, plus the room its
    segments leave), kept within the bracket's middle half (``middle_half``): memory falls
    about linearly with the blocks checkpointed, so this often needs fewer captures than
    halving, and where it does not (a peak that checkpointing does not move) each probe still
    cuts the bracket by a quarter. The answer is a replay that fits, with one block fewer
    replayed as not fitting."""
    lo, hi = 0, total  # checkpointing lo blocks does not fit (0: taken not to, the target does not), hi does
    best = fits_all
    low = probe_at(0)
    while hi - lo > 1:
        span = low.live_peak - best.live_peak
        room = best.prediction.usable - best.prediction.peak_reserved  # what the fitting end leaves
        guess = lo + (low.live_peak - best.live_peak - room) * (hi - lo) / span if span > 0 else (lo + hi) / 2
        mid = middle_half(lo, hi, int(guess) + 1)  # (rounded up: the fewest that may fit)
        q = probe_at(mid)
        if q.fits:
            hi, best = mid, q
        else:
            lo, low = mid, q
    return hi, best


def _before_the_optimizer(pred: Prediction) -> bool:
    """Whether a replay ran out of memory in the first step before its optimizer step, where the
    trace is the same whatever the optimizer's implementation (a loop cannot help then)."""
    oom = pred.oom or {}
    return oom.get("step", 1) <= 0 and oom.get("phase") in ("setup", "forward", "backward")
