"""``vramkit.trace.fit``: the largest batch size that fits a GPU, and what to change when the
batch size you want does not.

Every answer is a replay: the builder's trace at the batch size in question is replayed on a
simulated device of the capacity asked for. The trace is captured on ``meta`` (nothing is
allocated, so a 7B model costs only the capture's Python time) or, once two captures at batch
sizes >= 2 differ only in sizes affine in the batch size and a third capture agrees with the
trace derived for it, derived from them (``derive_batch``) at no capture cost; a step that
breaks that pattern is captured at every batch size. The search doubles the batch size from 2
until a replay runs out of memory, then bisects between the last size that fit and the first
that did not, so it needs about 2 log2(B) probes and, when traces can be derived, 3 captures.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .._core.text_html import TextAsHtml
from .capture_step import capture
from .derive_batch import MIN_BATCH_SIZE, BatchModel, first_difference, mismatch
from .file_format import Trace
from .fake_dist import check_rank
from .gpu_profiles import NCCL_DEFAULT, gpu_profile
from .replay_sim import ON_DEVICE, GpuOverheads, Prediction, _conf_text, format_size, parse_size, peak_live_bytes, replay
from .sharding_changes import change_for, communication_sent, host_bytes, sharding_cost, sharding_techniques

__all__ = ["CAPTURED", "DERIVED", "FitReport", "Probe", "Suggestion", "fit"]

# Where a probe's trace came from: a capture on meta, or derive_batch from two captures.
CAPTURED, DERIVED = "captured", "derived"
_ALL_CAPTURED = "every trace captured"  # how FitReport.derivation starts when derivation was given up


@dataclass
class Probe:
    """One replay at one batch size, of a trace captured on meta or derived from captures."""

    batch_size: int
    prediction: Prediction
    seconds: float
    trace_source: str = CAPTURED  # CAPTURED or DERIVED (then the trace was computed, not run)
    live_peak: int = 0  # peak of live bytes (rounded to blocks) on a GPU large enough for it

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    @property
    def derived(self) -> bool:
        return self.trace_source == DERIVED


@dataclass
class Suggestion:
    """A change that makes the target batch size fit, with its predicted peak and its cost."""

    change: str
    settings: dict[str, Any]
    prediction: Prediction
    cost: str


@dataclass
class FitReport(TextAsHtml):
    """What ``fit`` found: the largest batch size that fits, the target's prediction and the
    changes that make it fit, the probes of the step as written and their traces
    (``trace(batch_size)``), and how many captures it took (the other traces were derived)."""

    capacity: int
    target_batch_size: int | None
    max_batch_size: int  # the largest batch size that fits; 0 if even 1 does not
    probes: list[Probe] = field(default_factory=list)
    target: Prediction | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    searched_up_to: int = 0  # the search's cap; 0 when no search ran
    captures: int = 0  # captures run on meta, every configuration (a derived trace is not one)
    derivation: str = ""  # how the probes' derived traces were made, or why every trace was captured
    fallbacks: list[str] = field(default_factory=list)  # why derivation stopped, per capture configuration
    # The trace of each probed batch size (no checkpointing, no autocast), captured or derived.
    traces: dict[int, Trace] = field(default_factory=dict, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.target.fits if self.target is not None else self.max_batch_size > 0

    def trace(self, batch_size: int) -> Trace:
        """The trace this fit replayed at `batch_size` (the step as written: no checkpointing or
        autocast added), so that it need not be captured again. ``KeyError`` if none was."""
        try:
            return self.traces[batch_size]
        except KeyError:
            raise KeyError(f"batch size {batch_size} was not probed by this fit (probed: "
                           f"{sorted(self.traces) or 'none'}); capture it with vramkit.trace.capture") from None

    def table(self, top: int = 5) -> str:
        lines = []
        if self.target is not None:
            lines += [f"batch size {self.target_batch_size}: " + self.target.table(top), ""]
        if self.searched_up_to:
            if self.max_batch_size:
                cap = " (the search's cap)" if self.max_batch_size >= self.searched_up_to else ""
                lines.append(f"largest batch size that fits: {self.max_batch_size}{cap}")
            else:
                lines.append("no batch size fits: even batch size 1 runs out of memory")
        if self.probes and (self.searched_up_to or len(self.probes) > 1):
            lines.append(f"{'batch':>7}  {'fits':<4}  {'peak allocated':>15}  {'peak reserved':>14}")
            for p in sorted(self.probes, key=lambda p: p.batch_size):
                pr = p.prediction
                alloc = format_size(pr.peak_allocated) if pr.fits else "-"
                res = format_size(pr.peak_reserved) if pr.fits else "OOM"
                mark = "  (derived)" if p.derived else ""
                lines.append(f"{p.batch_size:>7}  {'yes' if pr.fits else 'no':<4}  {alloc:>15}  {res:>14}{mark}")
            if any(p.derived for p in self.probes) or self.derivation.startswith(_ALL_CAPTURED):
                lines.append(f"({self.derivation}; {self.captures} capture{'s' if self.captures != 1 else ''} "
                             "in all)")
        if self.suggestions:
            lines += ["", f"to train batch size {self.target_batch_size} in {format_size(self.capacity)}:"]
            for s in self.suggestions:
                pr = s.prediction
                lines.append(f"  - {s.change}: peak reserved {format_size(pr.peak_reserved)} "
                             f"(allocated {format_size(pr.peak_allocated)}); cost: {s.cost}")
        elif self.target is not None and not self.target.fits:
            lines += ["", f"nothing tried makes batch size {self.target_batch_size} fit "
                          "(gradient accumulation down to micro-batch 1, allocator options)"]
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        return self.table()


def _capture(build: Callable[..., Any], batch_size: int, steps: int, options: Mapping[str, Any],
             progress: Callable[[str], None] | None = None) -> Trace:
    """The one place fit captures: `options` are capture's keyword arguments (checkpoint_blocks,
    autocast, ...), passed through, so that a new capture option is a new entry in fit's
    `capture_options`, nothing here."""
    trace = capture(build, batch_size, device="meta", steps=steps, meta={"batch_size": batch_size},
                    progress=progress, **options)
    if trace.meta.get("form") != "builder":
        name = getattr(build, "__qualname__", type(build).__name__)
        what = trace.meta.get("first_return", "no function")
        raise TypeError(f"{name}({batch_size}) returned {'None' if what == 'NoneType' else 'a ' + what}: the builder "
                        "must build the model, optimizer and batch and return the step function (`return step`)")
    return trace


def _options_key(options: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, str(value)) for name, value in options.items()))


def _how(options: Mapping[str, Any]) -> str:
    """The capture options that differ from the step as written, for progress lines."""
    checkpoint_blocks, autocast = options.get("checkpoint_blocks"), options.get("autocast")
    cuda = options.get("cuda")
    loop = getattr(cuda, "optimizer", True) is False
    half = "bf16" if autocast is None or "bfloat16" in str(autocast) else "fp16"
    sharding = options.get("sharding")
    return ((f" with {sharding.describe()}" if sharding else "") + (" with the optimizer's foreach=False" if loop else "") + (f" with {half} autocast" if autocast else "")
            + ("" if not checkpoint_blocks else " checkpointing every block" if checkpoint_blocks is True
               else f" checkpointing {checkpoint_blocks} blocks"))


class _Configuration:
    """The traces of one set of capture options, and what derivation has learnt from them."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)
        self.traces: dict[int, tuple[Trace, str]] = {}  # batch size -> (trace, CAPTURED or DERIVED)
        self.model: BatchModel | None = None
        self.checked_at = 0  # the capture that agreed with the model event for event (0: none yet)
        self.off = ""  # why traces are no longer derived ("" while they may be)

    def note(self) -> str:
        if self.off:
            return f"{_ALL_CAPTURED}: {self.off}"
        if self.model is None or not self.checked_at:
            return ""
        a, b = self.model.batch_sizes
        return (f"derived: computed from the captures at batch sizes {a} and {b}, sizes affine in the batch size, "
                f"checked against the capture at {self.checked_at}")


class _Traces:
    """Every trace fit replays, by capture options and batch size: captured, or derived.

    Per capture configuration, the first two captures at batch sizes >= 2 make a BatchModel;
    the next capture at a batch size >= 2 is compared with the model's trace there, event for
    event. If it matches, every later batch size >= 2 is derived; if the captures differ in
    more than affine sizes, or the check fails, the configuration is captured at every batch
    size from then on (and `say` is told why). Batch size 1 is always captured."""

    def __init__(self, build: Callable[..., Any], steps: int, derive: bool, say: Callable[[str], None]) -> None:
        self.build, self.steps, self.derive, self.say = build, steps, derive, say
        self.captures = 0
        self.fallbacks: list[str] = []
        self._configs: dict[tuple[tuple[str, str], ...], _Configuration] = {}

    def config(self, options: Mapping[str, Any]) -> _Configuration:
        key = _options_key(options)
        if key not in self._configs:
            self._configs[key] = _Configuration(options)
        return self._configs[key]

    def get(self, batch_size: int, options: Mapping[str, Any]) -> tuple[Trace, str]:
        cfg = self.config(options)
        if batch_size not in cfg.traces:
            cfg.traces[batch_size] = self._make(cfg, batch_size)
        return cfg.traces[batch_size]

    def _make(self, cfg: _Configuration, batch_size: int) -> tuple[Trace, str]:
        if self.derive and cfg.model is not None and cfg.checked_at and not cfg.off and batch_size >= MIN_BATCH_SIZE:
            try:
                return cfg.model.at(batch_size), DERIVED
            except ValueError as exc:  # a size the line takes below 0 or past 2**62 there: capture instead
                self._stop(cfg, str(exc))
        trace = _capture(self.build, batch_size, self.steps, cfg.options, self.say)
        self.captures += 1
        if self.derive and not cfg.off and batch_size >= MIN_BATCH_SIZE:
            self._learn(cfg, batch_size, trace)
        return trace, CAPTURED

    def _learn(self, cfg: _Configuration, batch_size: int, trace: Trace) -> None:
        if cfg.model is None:
            bases = [b for b, (_, how) in cfg.traces.items() if b >= MIN_BATCH_SIZE and how == CAPTURED]
            if bases:
                a = bases[0]
                cfg.model = BatchModel.from_traces(cfg.traces[a][0], a, trace, batch_size)
                if cfg.model is None:
                    why = mismatch(cfg.traces[a][0], a, trace, batch_size)
                    self._stop(cfg, f"the captures at batch sizes {a} and {batch_size} differ in more than sizes "
                                    f"affine in the batch size ({why})")
        elif not cfg.checked_at:
            a, b = cfg.model.batch_sizes
            try:
                diff = first_difference(cfg.model.at(batch_size), trace)
            except ValueError as exc:
                diff = str(exc)
            if diff is None:
                cfg.checked_at = batch_size
            else:
                self._stop(cfg, f"the capture at batch size {batch_size} differs from the trace derived from batch "
                                f"sizes {a} and {b} ({diff})")

    def _stop(self, cfg: _Configuration, why: str) -> None:
        cfg.off = why
        line = f"traces{_how(cfg.options)} captured at every batch size from now on: {why}"
        self.fallbacks.append(line)
        self.say(line)


def fit(build: Callable[..., Any], capacity: Any = None, *, gpu: Any = None, batch_size: int | None = None,
        max_batch_size: int = 1 << 16, steps: int = 2, alloc_conf: Any = None,
        overheads: GpuOverheads | None = None, search: bool = True,
        progress: Callable[[str], None] | None = None, derive: bool = True, world_size: int | None = None,
        rank: int = 0, captured: Mapping[int, Trace] | None = None) -> FitReport:
    """Answer "does it fit, and if not what do I change" for a training step.

    `build(batch_size)` builds the model, optimizer and a batch (on the current default
    device: it runs under ``torch.device("meta")``) and returns the step function, as for
    ``capture``'s builder form. `steps` steps are captured (2 by default: optimizer state is
    created in the first step's ``optimizer.step()``, so the second step is the steady state).

    The GPU: `capacity` ("24GiB"; 24 GiB when neither is given) and/or `gpu`, a profile name
    ("H100-80GB", see ``gpu_profiles``) or a ``GpuProfile``, which sets the capacity unless
    `capacity` is given, the line items unless `overheads` is, and the architecture whose CUDA
    dispatch choices the captures make (attention backend, bf16).

    With `search`, the largest batch size up to `max_batch_size` that fits is found. With
    `batch_size`, that size is predicted and, if it does not fit, the cheapest changes that make
    it fit are searched: allocator options (when the live bytes would fit), then each of bf16
    autocast around the model's forward, gradient accumulation (micro-batches that divide it)
    and activation checkpointing of the model's repeated blocks, then pairs of them, then all
    three. Each suggestion carries its predicted peak and its cost. `progress` receives a line
    per probe, and one when traces stop being derived.

    With `derive` (the default), traces at batch sizes >= 2 are derived from two captures once
    a third capture has matched its derived trace event for event (``derive_batch``); a step
    whose allocations change with the batch size in any other way than affine sizes is captured
    at every batch size. ``derive=False`` captures every batch size probed; the answers are the
    same, except for a step that changes only beyond the three captured sizes, or whose sizes are
    affine on them but not between them (a batch padded to a multiple of 8), which the check
    cannot see. Either way a trace is shared by all allocator options (they change only the
    replay). ``FitReport.captures`` counts the captures, ``Probe.trace_source`` says which
    traces were derived.

    With `world_size` (and `rank`), the step is one rank of a sharded job (``capture``'s
    arguments of the same names): batch sizes are per rank, and NCCL's memory is a line item
    (``GpuOverheads.nccl``) unless `overheads` sets it. ``predict_ranks`` compares the ranks.
    `captured`: traces of the step as written already captured (with these options), by batch
    size, used instead of capturing them again."""
    if not callable(build):
        raise TypeError(f"build must be callable (batch_size -> step function), got {type(build).__name__}")
    profile = gpu_profile(gpu) if gpu is not None else None
    if capacity is None:
        capacity = profile.total_memory if profile is not None else "24GiB"
    cap = parse_size(capacity)
    given = overheads is not None
    if overheads is None and profile is not None:
        overheads = profile.overheads()
    if world_size is not None:
        check_rank(world_size, rank)
        if not given:  # a distributed job: NCCL's buffers outside the allocator, unless the caller said
            overheads = GpuOverheads(**{**(overheads or GpuOverheads()).__dict__, "nccl": NCCL_DEFAULT})
    for name, value in (("max_batch_size", max_batch_size), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    if batch_size is not None and search and batch_size > max_batch_size:
        raise ValueError(f"batch_size ({batch_size}) is above max_batch_size ({max_batch_size}): the search for the "
                         "largest batch that fits would start above its cap; raise max_batch_size or pass search=False")
    if not isinstance(derive, bool):
        raise TypeError(f"derive must be True or False, got {derive!r}")
    say = progress or (lambda line: None)
    # capture's keyword arguments for the step as written; the probes override checkpointing and
    # autocast. A new capture option is one more entry here (it joins the cache keys through it).
    capture_options: dict[str, Any] = {"checkpoint_blocks": False, "autocast": None}
    if profile is not None:
        capture_options["cuda"] = profile.cuda_choices()
    if world_size is not None:  # one rank of a sharded job (fake_dist): the batch size is per rank
        capture_options.update(world_size=world_size, rank=rank)
    traces = _Traces(build, steps, derive, say)
    for bs, trace in (captured or {}).items():
        traces.config(capture_options).traces[bs] = (trace, CAPTURED)
    cache: dict[tuple[int, str, tuple[tuple[str, str], ...]], Probe] = {}

    def probe(bs: int, conf: Any = alloc_conf, checkpoint_blocks: bool | int = False, autocast: Any = None,
              loop: bool = False, sharding: Any = None) -> Probe:
        options = {**capture_options, "checkpoint_blocks": checkpoint_blocks, "autocast": autocast}
        if sharding:
            options["sharding"] = sharding
        if loop:  # the optimizer one parameter at a time: CUDA's foreach choice not made
            options["cuda"] = _without_foreach(options.get("cuda", True))
        key = (bs, str(conf), _options_key(options))
        if key not in cache:
            t0 = time.perf_counter()
            trace, source = traces.get(bs, options)
            pred = replay(trace, cap, conf, overheads=overheads)
            pred.checkpointed_blocks = trace.meta.get("checkpointed_blocks", "")
            pred.checkpointed_count = int(trace.meta.get("checkpointed_count", 0))
            pred.communication_sent = communication_sent(trace)
            pred.host_bytes = host_bytes(trace)
            live = peak_live_bytes(trace, rounded=True, categories=ON_DEVICE)
            p = cache[key] = Probe(bs, pred, time.perf_counter() - t0, source, live)
            verdict = f"fits, peak reserved {format_size(p.prediction.peak_reserved)}" if p.fits else "OOM"
            how = (f" with {conf}" if conf != alloc_conf else "") + _how(options)
            say(f"batch size {bs}{how}: {verdict} ({source}, {p.seconds:.1f} s)")
        return cache[key]

    report = FitReport(capacity=cap, target_batch_size=batch_size, max_batch_size=0)
    if batch_size is not None:
        report.target = probe(batch_size).prediction
    if search:
        report.max_batch_size, report.searched_up_to = _largest(probe, max_batch_size, batch_size,
                                                                report.target)
    if batch_size is not None and report.target is not None and not report.target.fits:  # (target: batch_size set)
        written, _ = traces.get(batch_size, {**capture_options, "checkpoint_blocks": False, "autocast": None})
        # foreach=False is a change only where an optimizer left its implementation to torch and
        # the capture made CUDA's choice for it (foreach).
        foreach = (bool(written.meta.get("optimizer_default_implementation"))
                   and bool(written.meta.get("cuda_choices", {}).get("optimizer")))
        strategy = written.meta.get("strategy") or {}
        report.suggestions = _suggest(probe, batch_size, report.target, alloc_conf, foreach,
                                      bf16=profile is None or profile.bf16, sharding=sharding_techniques(strategy),
                                      # FSDP2 computing in bf16 already: autocast would change next to nothing
                                      amp=strategy.get("param_dtype") not in ("bfloat16", "float16"))
    plain = _options_key(capture_options)
    report.probes = [p for (bs, conf, options), p in sorted(cache.items(), key=lambda kv: kv[0][0])
                     if conf == str(alloc_conf) and options == plain]
    as_written = traces.config(capture_options)
    report.traces = {bs: trace for bs, (trace, _) in sorted(as_written.traces.items())}
    report.captures, report.fallbacks, report.derivation = traces.captures, traces.fallbacks, as_written.note()
    return report


def _largest(probe: Callable[..., Probe], limit: int, target: int | None, target_pred: Prediction | None) -> tuple[int, int]:
    """Largest batch size <= limit that fits: double from 2 (or from a target that fits) until a
    size does not fit, then bisect. Returns (size, limit); size 0 when batch size 1 does not fit.

    It starts at 2, not 1: what fits is taken to be a prefix (memory grows with the batch), so
    when 2 fits, 1 does, and batch size 1 is the one size whose trace is never derived (a
    size-1 dimension can change the op path), so probing it only when 2 does not fit saves a
    capture."""
    lo, hi = 0, None  # lo fits (0: none known), hi does not
    if target is not None and target_pred is not None:
        if target_pred.fits:
            lo = target
        else:
            hi = target
    bs = max(2, 2 * lo)
    while hi is None:
        if lo >= limit:
            return lo, limit
        bs = min(bs, limit)
        if probe(bs).fits:
            lo, bs = bs, 2 * bs
        else:
            hi = bs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo, limit


# Tried in this order, each replayed with PyTorch's policy for it (expandable segments with
# PyTorch's 20 MiB pages); the first that fits is suggested, with what it costs.
_ALLOCATOR_OPTIONS = (
    ("expandable_segments:True", "none in memory; new pages are mapped as segments grow (the first steps are a "
                                 "little slower) and tensors cannot be shared with other processes over CUDA IPC"),
    ("max_split_size_mb:512", "none in memory; the allocator splits or frees cached blocks more often"),
    ("max_split_size_mb:128", "none in memory; the allocator splits or frees cached blocks more often"),
    ("garbage_collection_threshold:0.6", "none in memory; the allocator splits or frees cached blocks more often"),
)


def _without_foreach(cuda: Any) -> Any:
    from dataclasses import replace

    from .cuda_choices import CudaChoices

    choices = cuda if isinstance(cuda, CudaChoices) else CudaChoices() if cuda else CudaChoices.off()
    return replace(choices, optimizer=False)


def _suggest(probe: Callable[..., Probe], target: int, pred: Prediction, alloc_conf: Any,
             foreach: bool = False, bf16: bool = True, sharding: list[str] | None = None,
             amp: bool = True) -> list[Suggestion]:
    """The cheapest changes that make `target` fit: every single change that does, else every
    pair, and so on (allocator options are tried alone, when only fragmentation fails). With
    `foreach` (the step's optimizer runs CUDA's multi-tensor implementation), running it one
    parameter at a time is one of the changes. `sharding`: the sharding changes of a sharded
    step (``sharding_changes.sharding_techniques``), each one more technique. `amp`: whether
    bf16 autocast is one (not where FSDP2 already gathers parameters in bf16)."""
    out: list[Suggestion] = []
    # Fragmentation: the live bytes would fit but the reserved segments do not.
    if pred.oom and pred.oom.get("allocated", 0) + pred.oom.get("size", 0) <= pred.usable:
        for option, cost in _ALLOCATOR_OPTIONS:
            base = _conf_text(alloc_conf)
            if base and option.split(":")[0] in base:
                continue  # the user's own setting stays
            conf = option if not base else f"{base},{option}"
            p = probe(target, conf)
            if p.fits:
                out.append(Suggestion(f"PYTORCH_CUDA_ALLOC_CONF={conf}", {"alloc_conf": conf}, p.prediction, cost))
                break
    blocks = probe(target, alloc_conf, True).prediction.checkpointed_blocks
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
        s = _try(probe, target, alloc_conf, combo, blocks, bf16, base_sent)
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


def _try(probe: Callable[..., Probe], target: int, alloc_conf: Any, combo: tuple[str, ...],
         blocks: str, bf16: bool = True, base_sent: int | None = None) -> Suggestion | None:
    """Probe one combination; with "accumulate", the fewest micro-batches (dividing the target)
    that fit. Autocast is to bf16, or to fp16 on a GPU without bf16 (compute capability < 8)."""
    import torch

    amp = (torch.bfloat16 if bf16 else torch.float16) if "amp" in combo else None
    ckpt = "checkpoint" in combo
    loop = "loop" in combo
    change = change_for(combo)
    if "accumulate" in combo:
        sizes = [(target // k, k) for k in range(2, target + 1) if target % k == 0]
    else:
        sizes = [(target, 1)]
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


def middle_half(lo: int, hi: int, guess: int) -> int:
    """`guess` moved into the middle half of the open bracket (lo, hi), so that an interpolated
    probe shrinks the bracket by at least a quarter whichever way it goes."""
    quarter = -(-(hi - lo) // 4)  # rounded up: a bracket of 5 is probed at its middle
    return min(max(guess, lo + quarter), hi - quarter)
