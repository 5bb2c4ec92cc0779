"""What the Trainer's and Lightning's batch-size searches share: the result (``TunedBatchSize``:
``vramkit.survive.find_batch_size``'s, plus the knobs it set and what the frameworks' own
searches would have found), the search itself with the framework's trial, and the state a
search must leave as it found it (weights, optimizer and scheduler state, random generators).

Both searches are ``find_batch_size``'s: doubling, then bisection between the last size that fit
and the first that did not, so the answer is the largest size that fits. accelerate's
``find_executable_batch_size`` (behind the Trainer's ``auto_find_batch_size``) shrinks from a
starting size until a size runs (by 10 % a step in accelerate 1.x, by half before), and
Lightning's ``scale_batch_size`` doubles until a failure and keeps the last success
(``mode="power"``) or bisects and then takes its `margin` (5 %) off (``mode="binsearch"``): both
stop below the largest that fits unless it is one of the sizes their steps land on.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ..survive.batch_size import BatchSizeResult, find_batch_size

__all__ = ["TunedBatchSize", "accelerate_note", "doubling_note", "run_search", "state_on_cpu"]


@dataclass
class TunedBatchSize(BatchSizeResult):
    """``find_batch_size``'s result for a framework: `knobs` are the framework settings that give
    the batch size found (set when `applied`), `others` what the framework's own searches would
    have found, given that sizes up to the one found fit and the next does not."""

    knobs: dict[str, int] = field(default_factory=dict)
    applied: bool = False
    others: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [super().__str__()]
        if self.knobs:
            what = ", ".join(f"{k}={v}" for k, v in self.knobs.items())
            lines.append(f"set: {what}" if self.applied else f"not applied (apply=False): {what}")
        lines += [line for line in self.others if line]
        return "\n".join(lines)


def run_search(trial: Callable[[int], Any], *, device: Any, start: int, max_batch_size: int, margin: float,
               effective_batch_size: int | None, multiple_of: int = 1) -> TunedBatchSize:
    """``find_batch_size`` over `trial`; on the CPU (`device` "cpu": torch's CPU tensors, which no
    allocator counter sees) the attempts carry no peak and no margin can be kept."""
    on_cpu = device == "cpu"
    if on_cpu and margin:
        raise ValueError("margin needs the peak memory of each trial, and torch's CPU allocator keeps no counters: "
                         "on the CPU only margin=0 is allowed")
    result = find_batch_size(trial, start=start, max_batch_size=max_batch_size, margin=margin, device=device,
                             effective_batch_size=effective_batch_size, multiple_of=multiple_of)
    if on_cpu:
        # The cpu pool find_batch_size measured is vramkit's, which torch's CPU tensors do not use.
        for attempt in result.attempts:
            attempt.peak_reserved, attempt.leaked = None, 0
        result.device, result.total = "cpu (torch tensors: no allocator counters, no peak)", None
    return TunedBatchSize(**{f.name: getattr(result, f.name) for f in fields(result)})


class _Unknown(Exception):
    """A size the search never tried and cannot infer: between the largest that fit and the
    smallest that did not."""


def _known_fit(result: BatchSizeResult) -> Callable[[int], bool]:
    """Whether a size fits, as far as the search tells (sizes are assumed to fit up to a limit):
    up to the size found, yes; from the smallest failure on, no; in between, ``_Unknown``."""
    n = result.batch_size
    failed = [a.batch_size for a in result.attempts if a.outcome != "fits"]
    first_failure = min(failed) if failed else None

    def fits(batch_size: int) -> bool:
        if batch_size <= n:
            return True
        if first_failure is not None and batch_size >= first_failure:
            return False
        raise _Unknown(batch_size)

    return fits


def accelerate_note(start: int, result: BatchSizeResult) -> str:
    """What accelerate's ``find_executable_batch_size`` (the Trainer's ``auto_find_batch_size``)
    would have run at from `start`: its own code, replayed on what the search found. Empty when
    accelerate is not installed, nothing fits, or its path crosses sizes the search cannot
    speak for (with `effective_batch_size`, only divisors were tried)."""
    if not result.batch_size:
        return ""
    try:
        find = importlib.import_module("accelerate.utils").find_executable_batch_size
    except ImportError:
        return ""
    fits = _known_fit(result)

    def step(batch_size: int) -> int:
        if not fits(batch_size):
            raise RuntimeError("CUDA out of memory.")  # what accelerate recognises, without a device
        return batch_size

    try:
        theirs = int(find(step, starting_batch_size=start)())
    except _Unknown:
        return ""
    if theirs == result.batch_size:
        return f"accelerate's find_executable_batch_size from {start} (auto_find_batch_size) would also run at {theirs}"
    return (f"accelerate's find_executable_batch_size from {start} (the Trainer's auto_find_batch_size) would run "
            f"at {theirs}" + (": it only shrinks from the size it is given" if start < result.batch_size else ""))


def doubling_note(init_val: int, result: BatchSizeResult, max_val: int = 8192) -> str:
    """What Lightning's ``scale_batch_size(mode="power", init_val=...)`` would keep: the last
    size of init_val, 2 init_val, 4 init_val, ... that fits (empty where the search cannot tell)."""
    if not result.batch_size:
        return ""
    fits = _known_fit(result)
    size = init_val
    try:
        if not fits(size):
            return ""
        while size * 2 <= max_val and fits(size * 2):
            size *= 2
    except _Unknown:
        return ""
    if size == result.batch_size:
        return f"Lightning's scale_batch_size(mode='power') from {init_val} would also keep {size}"
    return (f"Lightning's scale_batch_size(mode='power') from {init_val} would keep {size}; mode='binsearch' "
            "bisects, then takes its margin (5 % by default) off")


def _cpu_copy(value: Any) -> Any:
    """`value` (a state dict, nested) with every tensor copied to host memory, so a device does not
    hold two copies while the search measures it."""
    if hasattr(value, "detach") and hasattr(value, "to"):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return value


@contextlib.contextmanager
def state_on_cpu(model: Any, stateful: list[Any], device: Any) -> Iterator[None]:
    """Restore, at the end of the block, the model's weights and buffers, the state of each
    object in `stateful` with a ``state_dict`` (a given optimizer, a scheduler), and torch's
    random generators (CPU and `device`'s): trials train for real, and must leave no trace."""
    import torch

    weights = _cpu_copy(model.state_dict())
    states = [(obj, _cpu_copy(obj.state_dict())) for obj in stateful if obj is not None and hasattr(obj, "state_dict")]
    cuda = [device.index or 0] if getattr(device, "type", None) == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            model.load_state_dict(weights)
            for obj, state in states:
                obj.load_state_dict(state)
