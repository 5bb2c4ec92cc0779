"""find_batch_size across the ranks of a distributed job (torchrun, DDP, FSDP2).

Every rank must try the same size at the same time, and when one rank runs out of memory the
others must not be left waiting in a collective of the step: a rank that failed never reaches
it, and the job hangs. Lightning's ``BatchSizeFinder`` refuses DDP for this reason
(Lightning-AI/pytorch-lightning#20994). Three things keep the search in step:

* **One budget.** Before the search every rank is capped to the same headroom: the least any rank
  has free above what it holds now. A step that does the same work on every rank then runs out
  of memory at the same allocation on every rank, before any of them reaches the next
  collective. The caps are lifted when the search ends. (For vramkit's devices the cap is
  ``set_memory_limit``; for torch's CUDA allocator ``set_per_process_memory_fraction``.)
* **One outcome.** After each attempt the ranks exchange what happened, over a gloo group of
  their own (so the exchange never meets a collective of the training job's group), and all
  take the worst: if one rank ran out of memory, the size does not fit anywhere; if one went
  over the margin, it is over the margin. Every rank then empties its caches. The search is
  deterministic given the outcomes, so every rank tries the same sizes and returns the same
  answer.
* **A watchdog.** Should a rank still be held in the step (work that differs between ranks can
  still leave one rank waiting in a collective for another that ran out of memory), the
  exchange times out after `timeout` seconds and raises on the ranks that are waiting, naming
  the attempt, instead of hanging; under torchrun the failed rank ends the job.

The group's ranks must all call ``find_batch_size`` with the same arguments; this is checked.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass
from typing import Any

from .. import _C
from ..memory.api import memory_counters

__all__ = ["Agreement", "DistributedSearchError", "agreement_for"]

OUTCOMES = ("fits", "over margin", "oom", "error")  # by severity: the ranks agree on the worst


class DistributedSearchError(RuntimeError):
    """The ranks of a distributed batch-size search could not agree (different arguments, or a
    rank that never finished an attempt)."""


@dataclass
class _Cap:
    """How one rank was capped for the search, to be undone at its end."""

    kind: str  # "vramkit" or "torch"
    target: Any  # the vramkit device, or the torch device index
    previous: Any  # the vramkit limit (bytes or None) or torch's memory fraction


def agreement_for(process_group: Any) -> Agreement | None:
    """The agreement for ``find_batch_size(process_group=...)``: "auto" (the job's default group
    when torch.distributed is initialized with more than one rank, else none), None (a search of
    this process alone), or a torch ``ProcessGroup``."""
    if process_group is None:
        return None
    torch = sys.modules.get("torch")
    dist: Any = getattr(torch, "distributed", None) if torch is not None else None
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"process_group must be 'auto', None or a torch ProcessGroup, got {process_group!r}")
        if not initialized or dist.get_world_size() < 2:
            return None
        process_group = dist.group.WORLD
    elif not initialized:
        raise ValueError("process_group was given but torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first (torchrun sets its environment)")
    if dist.get_world_size(process_group) < 2:
        return None
    return Agreement(dist, process_group)


class Agreement:
    """The exchange between the ranks of one search (see the module's text)."""

    def __init__(self, dist: Any, group: Any) -> None:
        self.dist = dist
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(self.ranks)
        self.side: Any = None
        self.caps: list[_Cap] = []

    def open(self, timeout: float, arguments: tuple[Any, ...]) -> None:
        """Make the side group (a collective of the group's ranks) and check that every rank
        called with the same arguments."""
        self.side = self.dist.new_group(ranks=self.ranks, backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout),
                                        use_local_synchronization=True)
        gathered: list[Any] = [None] * self.world
        self.dist.all_gather_object(gathered, repr(arguments), group=self.side)
        if len(set(gathered)) > 1:
            raise DistributedSearchError(
                "find_batch_size was called with different arguments on different ranks "
                f"(rank {self.rank}: {gathered[self.rank]}; others: "
                f"{sorted(set(gathered) - {gathered[self.rank]})}): every rank must try the same sizes")

    def _all(self, values: list[int], op: str) -> list[int]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        self.dist.all_reduce(t, op=getattr(self.dist.ReduceOp, op), group=self.side)
        return [int(v) for v in t.tolist()]

    def equalize(self, meter: Any) -> None:
        """Cap every rank at its present holding plus the least headroom of any rank."""
        held, capacity = _held_and_capacity(meter)
        if capacity is None:
            self._all([-1], "MIN")  # (no cap here; the others still wait for this rank's figure)
            return
        headroom = max(0, capacity - held)
        least = self._all([headroom], "MIN")[0]
        if least < 0 or least >= headroom:
            return  # (this rank has the least headroom, or some rank cannot be capped: nothing to do)
        self.caps.append(_cap(meter, held + least))

    def agree(self, outcome: str, peak: int | None, attempt: int, batch_size: int) -> tuple[str, int | None]:
        """(the worst outcome of any rank, the largest peak) for this attempt."""
        try:
            worst, top = self._all([OUTCOMES.index(outcome), -1 if peak is None else peak], "MAX")
        except RuntimeError as exc:  # gloo's timeout
            raise DistributedSearchError(
                f"rank {self.rank}: the other ranks did not finish attempt {attempt} (batch size {batch_size}) "
                f"within the search's timeout; this rank's outcome was {outcome!r}. A rank that ran out of memory "
                "while another went on into a collective of the step leaves that one waiting: make the step do the "
                f"same work on every rank, or raise the timeout ({type(exc).__name__}: {exc})") from exc
        if OUTCOMES[worst] == "error":
            raise DistributedSearchError(f"rank {self.rank}: another rank's step raised an error at attempt {attempt} "
                                         f"(batch size {batch_size}); its log has the traceback")
        return OUTCOMES[worst], None if top < 0 else top

    def fail(self, attempt: int, batch_size: int) -> None:
        """This rank's step raised an error that is no out-of-memory: say so to the others (who
        then raise too, rather than wait) before it propagates here."""
        try:
            self._all([OUTCOMES.index("error"), -1], "MAX")
        except RuntimeError:
            pass  # (the others are gone or held: this rank's own error is the one to report)

    def close(self, together: bool) -> None:
        """Lift the caps and release the side group; `together`: the search ended normally, so
        every rank is here too (else, after an error, no rank waits for the others)."""
        for cap in reversed(self.caps):
            _uncap(cap)
        self.caps.clear()
        if self.side is not None:
            try:
                if together:
                    self.dist.barrier(group=self.side)  # (no rank leaves while another still agrees)
            finally:
                self.dist.destroy_process_group(self.side)
                self.side = None


def _held_and_capacity(meter: Any) -> tuple[int, int | None]:
    """What this rank's allocator holds now (reserved bytes) and the most it may hold."""
    if meter.kind == "vramkit":
        held = memory_counters(meter.device).reserved
        return held, int(_C.get_settings(meter.device)["allowed_bytes"])
    if meter.kind == "torch":
        cuda = sys.modules["torch"].cuda
        total = int(cuda.mem_get_info(meter.index)[1])
        fraction = cuda.get_per_process_memory_fraction(meter.index) if hasattr(
            cuda, "get_per_process_memory_fraction") else 1.0
        return int(cuda.memory_reserved(meter.index)), int(total * fraction)
    return 0, None


def _cap(meter: Any, limit: int) -> _Cap:
    if meter.kind == "vramkit":
        previous = _C.get_settings(meter.device)["memory_limit"]
        _C.set_memory_limit(limit, meter.device)
        return _Cap("vramkit", meter.device, previous)
    cuda = sys.modules["torch"].cuda
    previous = cuda.get_per_process_memory_fraction(meter.index) if hasattr(
        cuda, "get_per_process_memory_fraction") else 1.0
    total = int(cuda.mem_get_info(meter.index)[1])
    cuda.set_per_process_memory_fraction(min(1.0, limit / total), meter.index)
    return _Cap("torch", meter.index, previous)


def _uncap(cap: _Cap) -> None:
    if cap.kind == "vramkit":
        _C.set_memory_limit(cap.previous, cap.target)
    else:
        sys.modules["torch"].cuda.set_per_process_memory_fraction(cap.previous, cap.target)
