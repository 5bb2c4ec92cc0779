"""What every search of ``fitting`` is made of: a ``Probe`` (one replay at one batch size) and
``middle_half``, the rule that keeps an interpolated probe inside its bracket."""

from __future__ import annotations

from dataclasses import dataclass

from ..replaying.replay_sim import Prediction

__all__ = ["CAPTURED", "DERIVED", "Probe", "middle_half"]

# Where a probe's trace came from: a capture on meta, or derive_batch from two captures.
CAPTURED, DERIVED = "captured", "derived"


@dataclass
class Probe:
    """One replay at one batch size, of a trace captured on meta or derived from captures."""

    batch_size: int
    prediction: Prediction
    seconds: float
    trace_source: str = CAPTURED  # CAPTURED or DERIVED (then the trace was computed, not run)
    live_peak: int = 0  # peak of live bytes (rounded to blocks) on a GPU large enough for it
    # Its compiled graphs had the batch size symbolic (fit's search of a compiled step), not
    # static as a run at this one batch size compiles them: inductor may plan other buffers.
    symbolic: bool = False

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    @property
    def derived(self) -> bool:
        return self.trace_source == DERIVED


def middle_half(lo: int, hi: int, guess: int) -> int:
    """`guess` moved into the middle half of the open bracket (lo, hi), so that an interpolated
    probe shrinks the bracket by at least a quarter whichever way it goes."""
    quarter = -(-(hi - lo) // 4)  # rounded up: a bracket of 5 is probed at its middle
    return min(max(guess, lo + quarter), hi - quarter)
