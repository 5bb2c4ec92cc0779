"""What test_amp_scaler.py and test_amp_scaler_torch.py compare against, none of it produced by
the code under test: torch.amp.GradScaler's message texts, and `RuleModel`, the loss-scale rule
written from the comment on vram_scale_policy_t in vramkit.h and from NVIDIA Apex's
update_scale_hysteresis (reference/amp.md §3.1)."""

from __future__ import annotations

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
PICKLE_MSG = ("A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after "
              "scaler.update().")
EMPTY_SD_MSG = ("The source state dict is empty, possibly because it was saved from a disabled instance of "
                "GradScaler.")


def f32_bits(x) -> int:
    return int(np.asarray(x, dtype=np.float32).view(np.uint32))


class RuleModel:
    """The scale rule in plain Python/NumPy.

    PyTorch's _amp_update_scale_ (amp.md §2.2) with `tracker + 1 >= interval` (vramkit.h), a
    floor on back-off and a ceiling on growth, and Apex's hysteresis: an overflow spends one unit
    of the allowance and only backs off once it is used up; every clean step refills it. The
    tracker floors at 0 (Apex lets it go negative, with the same observable scales). Only scales
    that start inside [min_scale, max_scale] are compared with it (they then stay inside); what a
    scale set outside should do is tested separately below.
    """

    def __init__(self, scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=1,
                 min_scale=None, max_scale=None, tracker=0, hyst=None):
        self.scale = np.float32(scale)
        self.gf, self.bf, self.interval, self.hysteresis = growth_factor, backoff_factor, growth_interval, hysteresis
        self.min = np.float32(0.0 if min_scale is None else min_scale)
        self.max = np.float32(np.inf if max_scale is None else max_scale)
        self.tracker = tracker
        self.hyst = hysteresis if hyst is None else hyst

    def update(self, found_inf: bool) -> None:
        if found_inf:
            if self.hysteresis > 1:
                self.hyst -= 1
                if self.hyst > 0:
                    self.tracker = 0
                    return
                self.hyst = 0
            backed = np.float32(np.float64(self.scale) * self.bf)
            if backed < self.min <= self.scale:
                backed = self.min
            self.scale = backed
            self.tracker = 0
            return
        if self.hysteresis > 1:
            self.hyst = self.hysteresis
        if self.tracker + 1 >= self.interval:
            with np.errstate(over="ignore"):
                grown = np.float32(np.float64(self.scale) * self.gf)
            if grown > self.max >= self.scale:
                grown = self.max
            if np.isfinite(grown):
                self.scale = grown
            self.tracker = 0
        else:
            self.tracker += 1


def overflow_pattern(rng, n, p_start=0.06, p_continue=0.6):
    """Random overflow flags with bursts: a two-state Markov chain."""
    flags, prev = [], False
    for _ in range(n):
        prev = bool(rng.random() < (p_continue if prev else p_start))
        flags.append(prev)
    return flags
