"""Survive "out of memory": find the largest batch size that fits, by trying it.

    from vramkit.survive import find_batch_size

    def probe(batch_size):            # one (or a few) representative training steps
        train_steps(model, loader(batch_size), steps=2)

    result = find_batch_size(probe, max_batch_size=1024, margin=0.05)
    print(result)                     # every attempt: size, outcome, peak, time
    train(batch_size=result.batch_size)

In the spirit of accelerate's ``find_executable_batch_size``, with these differences:

* **Search.** Doubling until an attempt fails, then bisection between the last size that fit
  and the first that did not, instead of halving from a guess. It finds the largest size, not
  the first power-of-two fraction that works.
* **What counts as out of memory.** Recognised by type: ``vramkit.OutOfMemoryError``,
  ``torch.OutOfMemoryError`` (and ``torch.cuda.OutOfMemoryError``), CuPy's
  ``OutOfMemoryError``, and ``MemoryError`` (NumPy's allocations). Only as a last resort, a
  ``RuntimeError`` whose message is one of torch's known allocation failures ("CUDA out of
  memory", "CUBLAS_STATUS_ALLOC_FAILED", "DefaultCPUAllocator: can't allocate memory"); each
  attempt says which rule matched. Any other exception propagates at once.
* **Cleanup.** After a failure the frames of the traceback are cleared (a failed step's local
  tensors would otherwise stay alive through the exception), then ``gc.collect()`` and the
  right allocator's ``empty_cache()``: vramkit's pool, torch's CUDA allocator or CuPy's pool.
  The next attempt starts from the memory the first one found.
* **Margin.** ``margin=0.05`` keeps 5 % of the device free: an attempt whose peak reserved
  memory exceeds 95 % of the device counts as not fitting, so a run that just fits in a probe
  does not fail later on a longer batch.
* **Accumulation.** With ``effective_batch_size=256`` only micro-batch sizes that divide 256
  are tried, and the result says how many accumulation steps keep the effective batch.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _C
from .._core.sizes import format_size
from .._core.text_html import TextAsHtml
from ..memory.api import memory_counters

__all__ = ["Attempt", "BatchSizeResult", "find_batch_size", "out_of_memory_rule"]

# torch's allocation failures that reach Python as a plain RuntimeError (older torch, cuBLAS,
# the CPU allocator): the last resort, after the exception types.
_OOM_MESSAGES = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "DefaultCPUAllocator: can't allocate memory",
                 "HIP out of memory", "MPS backend out of memory")


def out_of_memory_rule(exc: BaseException) -> str | None:
    """The rule by which find_batch_size counts `exc` as running out of memory: "vramkit",
    "torch", "cupy" or "MemoryError" (its type), or "message: <text>" for the last-resort match
    of a RuntimeError's message; None when it is no out-of-memory error (find_batch_size then
    lets it propagate)."""
    from .._core.errors import OutOfMemoryError

    if isinstance(exc, OutOfMemoryError):
        return "vramkit"
    torch = sys.modules.get("torch")
    if torch is not None:
        kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if isinstance(k, type))
        if kinds and isinstance(exc, kinds):
            return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        kind = getattr(getattr(getattr(cupy, "cuda", None), "memory", None), "OutOfMemoryError", None)
        if isinstance(kind, type) and isinstance(exc, kind):
            return "cupy"
    if isinstance(exc, MemoryError):
        return "MemoryError"
    if isinstance(exc, RuntimeError):
        text = str(exc)
        for m in _OOM_MESSAGES:
            if m in text:
                return f"message: {m}"
    return None


@dataclass
class Attempt:
    batch_size: int
    outcome: str  # "fits", "oom", or "over margin" (it ran, but its peak left less than the margin free)
    peak_reserved: int | None  # bytes, on the device measured; None where it cannot be measured
    seconds: float
    error: str = ""  # the first line of the OOM message
    matched: str = ""  # which rule recognised the OOM (see out_of_memory_rule)
    leaked: int = 0  # bytes still allocated after the attempt and its cleanup, beyond what was before
    # In a distributed search: this rank's own outcome ("outcome" is the worst of all ranks'),
    # and the largest peak reserved of any rank ("peak_reserved" is this rank's). Else "" and None.
    local_outcome: str = ""
    job_peak_reserved: int | None = None

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


@dataclass
class BatchSizeResult(TextAsHtml):
    batch_size: int  # the largest size that fit (0: none did)
    attempts: list[Attempt] = field(default_factory=list)
    device: str = ""
    total: int | None = None  # the device's capacity, bytes
    margin: float = 0.0
    effective_batch_size: int | None = None
    capped: bool = False  # the search stopped at max_batch_size, which fit
    ranks: int = 1  # the ranks that searched together (a torchrun job's), each outcome the worst of theirs

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step that keep `effective_batch_size` (None without it)."""
        if self.effective_batch_size is None or not self.batch_size:
            return None
        return self.effective_batch_size // self.batch_size

    def __str__(self) -> str:
        head = (f"largest batch size that fits on {self.device}: {self.batch_size}"
                + (" (the cap)" if self.capped else "") if self.batch_size else
                f"no batch size fits on {self.device}: even the smallest tried runs out of memory")
        if self.accumulation_steps:
            head += (f"; effective batch {self.effective_batch_size} = {self.batch_size} x "
                     f"{self.accumulation_steps} accumulation steps")
        if self.ranks > 1:
            head += (f"; searched by {self.ranks} ranks together (each outcome the worst of any rank's; "
                     "this rank's own in brackets where it differs)")
        lines = [head, f"{'batch':>7}  {'outcome':<11}  {'peak reserved':>14}  {'time':>8}"]
        for a in self.attempts:
            peak = format_size(a.peak_reserved) if a.peak_reserved is not None else "-"
            own = f" [{a.local_outcome}]" if a.local_outcome and a.local_outcome != a.outcome else ""
            lines.append(f"{a.batch_size:>7}  {a.outcome:<11}  {peak:>14}  {a.seconds:>7.2f}s"
                         + (f"  {a.error.split('. ')[0][:60]}" if a.error else "") + own)
        return "\n".join(lines)


class _Meter:
    """Peak, capacity and empty_cache of the allocator the attempts run on."""

    def __init__(self, device: Any) -> None:
        torch = sys.modules.get("torch")
        self.kind, self.index = "vramkit", None
        if torch is not None and isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"a torch device must be a CUDA device ('cuda:N'), got {device}; for host memory pass "
                                 "a vramkit device such as 'cpu'")
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.kind, self.index, self.name = "torch", index, f"torch cuda:{index}"
        elif device == "cupy":
            self.kind, self.name = "cupy", "cupy's default memory pool"
        elif device is None and torch is not None and torch.cuda.is_available():
            self.kind, self.index, self.name = "torch", torch.cuda.current_device(), "torch cuda"
        else:
            self.device = _C.canonical_device(device)  # raises ValueError for a bad name
            self.name = self.device

    def reset(self) -> None:
        if self.kind == "vramkit":
            _C.reset_peak_memory_stats(self.device)
        elif self.kind == "torch":
            sys.modules["torch"].cuda.reset_peak_memory_stats(self.index)

    def peak(self) -> int | None:
        if self.kind == "vramkit":
            return memory_counters(self.device).peak_reserved
        if self.kind == "torch":
            return int(sys.modules["torch"].cuda.max_memory_reserved(self.index))
        return None

    def allocated(self) -> int | None:
        if self.kind == "vramkit":
            return memory_counters(self.device).allocated
        if self.kind == "torch":
            return int(sys.modules["torch"].cuda.memory_allocated(self.index))
        return None

    def total(self) -> int | None:
        if self.kind == "vramkit":
            return _C.mem_get_info(self.device)[1]
        if self.kind == "torch":
            return int(sys.modules["torch"].cuda.mem_get_info(self.index)[1])
        return None

    def empty_cache(self) -> None:
        if self.kind == "vramkit":
            _C.empty_cache(self.device)
        elif self.kind == "torch":
            sys.modules["torch"].cuda.empty_cache()
        else:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def _candidates(effective: int | None, multiple_of: int, limit: int) -> list[int] | None:
    if effective is None:
        return None
    return [b for b in range(1, min(effective, limit) + 1) if effective % b == 0 and b % multiple_of == 0]


def find_batch_size(step: Callable[[int], Any], *, start: int = 1, max_batch_size: int = 1 << 16,
                    margin: float = 0.0, device: Any = None, effective_batch_size: int | None = None,
                    multiple_of: int = 1, on_attempt: Callable[[Attempt], None] | None = None,
                    process_group: Any = "auto", timeout: float = 1800.0) -> BatchSizeResult:
    """Call ``step(batch_size)`` for growing sizes and return the largest that fits.

    `step` runs one or a few representative training steps at that size; an out-of-memory
    error (see ``out_of_memory_rule``) means the size does not fit. `device`: where memory is
    measured and released: a vramkit device ("cpu", "cuda:0", "sim:0"), a ``torch.device``
    (torch's CUDA allocator), or "cupy" (CuPy's pool; no peak, so no margin). None: torch's
    current CUDA device if torch is imported and has one, else vramkit's default device.
    `margin`: the fraction of the device to keep free at the peak. `effective_batch_size`:
    try only sizes dividing it (and `multiple_of`). `on_attempt` is called after each try.

    Under torchrun (torch.distributed initialized, more than one rank) every rank of
    `process_group` ("auto": the job's default group; None: this process alone) must call it with
    the same arguments: the ranks are capped to the same headroom, agree on each attempt's outcome
    (the worst of any rank), empty their caches together and return the same answer; a rank that
    waits more than `timeout` seconds for the others raises instead of hanging
    (``vramkit.survive.batch_agree``).
    """
    if not callable(step):
        raise TypeError(f"step must be callable (batch_size -> anything), got {type(step).__name__}")
    for name, value in (("start", start), ("max_batch_size", max_batch_size), ("multiple_of", multiple_of)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if start > max_batch_size:
        raise ValueError(f"start ({start}) must not exceed max_batch_size ({max_batch_size})")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1) of the device to keep free, got {margin!r}")
    if effective_batch_size is not None and (not isinstance(effective_batch_size, int)
                                             or isinstance(effective_batch_size, bool) or effective_batch_size < 1):
        raise ValueError(f"effective_batch_size must be an integer >= 1 or None, got {effective_batch_size!r}")
    meter = _Meter(device)
    if margin and meter.total() is None:
        raise ValueError(f"margin needs a device whose peak can be measured; {meter.name} has none")
    cands: list[int] | range | None = _candidates(effective_batch_size, multiple_of, max_batch_size)
    if cands is not None and not cands:
        raise ValueError(f"no batch size up to {max_batch_size} divides effective_batch_size={effective_batch_size} "
                         f"and is a multiple of {multiple_of}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    from .batch_agree import agreement_for

    agreement = agreement_for(process_group)
    result = BatchSizeResult(0, device=meter.name, total=meter.total(), margin=float(margin),
                             effective_batch_size=effective_batch_size,
                             ranks=agreement.world if agreement is not None else 1)
    tried: dict[int, bool] = {}

    def fits(bs: int) -> bool:
        if bs not in tried:
            try:
                attempt = _attempt(step, bs, meter, margin)
            except Exception:
                if agreement is not None:
                    agreement.fail(len(result.attempts), bs)
                raise
            if agreement is not None:
                attempt.local_outcome = attempt.outcome
                attempt.outcome, attempt.job_peak_reserved = agreement.agree(attempt.outcome, attempt.peak_reserved,
                                                                             len(result.attempts), bs)
            result.attempts.append(attempt)
            tried[bs] = attempt.fits
            if on_attempt is not None:
                on_attempt(attempt)
        return tried[bs]

    if cands is None:
        if multiple_of > max_batch_size:
            raise ValueError(f"no multiple of {multiple_of} is at most max_batch_size ({max_batch_size})")
        cands = range(multiple_of, max_batch_size + 1, multiple_of)
    from .oom import active

    watch = active()
    finished = False
    try:
        if agreement is not None:
            agreement.open(float(timeout), (start, max_batch_size, float(margin), effective_batch_size, multiple_of))
            agreement.equalize(meter)
        with watch.paused() if watch is not None else contextlib.nullcontext():  # its OOMs are the search's answers
            result.batch_size, failed = _search_list(cands, fits, start)
        finished = True
    finally:
        if agreement is not None:
            agreement.close(together=finished)
    result.capped = failed is None and result.batch_size > 0
    return result


def _search_list(sizes: Any, fits: Callable[[int], bool], start: int) -> tuple[int, int | None]:
    """Over the sorted candidate sizes: double the index from `start`'s until a size fails, then
    bisect. Returns (largest size that fits or 0, smallest that does not or None)."""
    i = _first_at_least(sizes, start)
    lo, hi = -1, None  # indexes: sizes[lo] fits, sizes[hi] does not
    while hi is None:
        if fits(sizes[i]):
            lo = i
            if i == len(sizes) - 1:
                break
            i = min(len(sizes) - 1, 2 * i + 1)
        else:
            hi = i
    if hi is not None and lo == -1 and hi > 0:
        lo_i = -1  # the start failed: search below it
        while hi - lo_i > 1:
            mid = (lo_i + hi) // 2
            if fits(sizes[mid]):
                lo_i = mid
            else:
                hi = mid
        lo = lo_i
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            lo = mid
        else:
            hi = mid
    return (sizes[lo] if lo >= 0 else 0), (sizes[hi] if hi is not None else None)


def _first_at_least(sizes: Any, start: int) -> int:
    """Index of the first candidate >= start (the last one if none is)."""
    if isinstance(sizes, range):
        return min(len(sizes) - 1, max(0, -(-(start - sizes.start) // sizes.step)))
    return next((k for k, b in enumerate(sizes) if b >= start), len(sizes) - 1)


def _attempt(step: Callable[[int], Any], bs: int, meter: _Meter, margin: float) -> Attempt:
    gc.collect()
    meter.empty_cache()
    before = meter.allocated()
    meter.reset()
    t0 = time.perf_counter()
    outcome, error, matched = "fits", "", ""
    try:
        step(bs)
    except BaseException as exc:  # noqa: BLE001 -- classified below; anything but OOM is re-raised
        why = out_of_memory_rule(exc) if isinstance(exc, Exception) else None
        if why is None:
            raise
        outcome, matched = "oom", why
        _C._drain_oom_queue()  # a vramkit pool's OOM report, handed over now, while the post-mortem is paused
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        # The traceback keeps every frame of the failed step alive, and with them its tensors.
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        del exc
    seconds = time.perf_counter() - t0
    peak = meter.peak()
    gc.collect()
    meter.empty_cache()
    total = meter.total()
    if outcome == "fits" and margin and peak is not None and total and peak > (1 - margin) * total:
        outcome = "over margin"
    after = meter.allocated()
    leaked = max(0, after - before) if after is not None and before is not None else 0
    return Attempt(bs, outcome, peak, seconds, error, matched, leaked)
