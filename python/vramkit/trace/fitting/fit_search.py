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

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._core.sizes import format_size
from ..._core.text_html import TextAsHtml
from ..capturing.capture_step import capture
from ..capturing.batch_sizes import batch_sizes_vary
from ..capturing.compiled_regions import EAGER_BOUND
from ..formats.file_format import Trace
from ..replaying.replay_sim import ON_DEVICE, Prediction, peak_live_bytes, region_list, replay
from ..sharding.fake_dist import check_rank
from ..sharding.sharding_changes import communication_sent, host_bytes, sharding_techniques
from ..target.gpu_profiles import AllocConf, GpuOverheads, GpuSpec, Target, resolve_target
from .derive_batch import MIN_BATCH_SIZE, BatchModel, first_difference, mismatch
from .probes import CAPTURED, DERIVED, Probe
from .suggestions import Suggestion, suggest, without_foreach

__all__ = ["FitReport", "fit"]

_ALL_CAPTURED = "every trace captured"  # how FitReport.derivation starts when derivation was given up


@dataclass
class FitReport(TextAsHtml):
    """What ``fit`` found: the largest batch size that fits, the target's prediction and the
    changes that make it fit, the probes of the step as written and their traces
    (``trace(batch_size)``), and how many captures it took (the other traces were derived)."""

    gpu: Target  # the GPU the answers are for
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

    @property
    def capacity(self) -> int:
        """The GPU's memory (``Target.capacity``)."""
        return self.gpu.capacity

    def _regions(self, which: str) -> list[str]:
        names: dict[str, None] = {}
        for pr in [p.prediction for p in self.probes] + ([self.target] if self.target is not None else []):
            names.update(dict.fromkeys(getattr(pr, which)))
        return list(names)

    @property
    def eager_bound_regions(self) -> list[str]:
        """Compiled regions that some probe predicted as eager: there the answers are bounds
        (a batch that fits fits; the largest may be larger)."""
        return self._regions("eager_bound_regions")

    @property
    def lower_bound_regions(self) -> list[str]:
        """Compiled regions predicted without their CUDA graphs: the largest batch may be smaller."""
        return self._regions("lower_bound_regions")

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
                bound = self.eager_bound_regions
                low = f" (at least: compiled {region_list(bound)} predicted as eager, which holds more)" if bound else ""
                fewer = self.lower_bound_regions
                low += f" (at most: the CUDA graphs of compiled {region_list(fewer)} left out)" if fewer else ""
                lines.append(f"largest batch size that fits: {self.max_batch_size}{cap}{low}")
            else:
                lines.append("no batch size fits: even batch size 1 runs out of memory")
        if self.probes and (self.searched_up_to or len(self.probes) > 1):
            lines.append(f"{'batch':>7}  {'fits':<4}  {'peak allocated':>15}  {'peak reserved':>14}")
            for p in sorted(self.probes, key=lambda p: p.batch_size):
                pr = p.prediction
                alloc = format_size(pr.peak_allocated) if pr.fits else "-"
                res = format_size(pr.peak_reserved) if pr.fits else "OOM"
                mark = "  (derived)" if p.derived else ""
                mark += "  (compiled with a symbolic batch size)" if p.symbolic else ""
                lines.append(f"{p.batch_size:>7}  {'yes' if pr.fits else 'no':<4}  {alloc:>15}  {res:>14}{mark}")
            if any(p.symbolic for p in self.probes):
                lines.append("(compiled steps are searched with graphs compiled for any batch size, and the answer "
                             "confirmed with graphs compiled for its batch size, as a training run compiles them)")
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
             progress: Callable[[str], None] | None = None, vary: bool = False) -> Trace:
    """The one place fit captures: `options` are capture's keyword arguments (checkpoint_blocks,
    autocast, ...), passed through, so that a new capture option is a new entry in fit's
    `capture_options`, nothing here. `vary`: under ``batch_sizes_vary`` (a compiled step's
    dynamic-shape graphs serve most batch sizes, not one compile per probe)."""
    with batch_sizes_vary() if vary else contextlib.nullcontext():
        trace = capture(build, batch_size, device="meta", steps=steps, meta={"batch_size": batch_size},
                        progress=progress, **options)
    if trace.meta.get("form") != "builder":
        name = getattr(build, "__qualname__", type(build).__name__)
        what = trace.meta.get("first_return", "no function")
        raise TypeError(f"{name}({batch_size}) returned {'None' if what == 'NoneType' else 'a ' + what}: the builder "
                        "must build the model, optimizer and batch and return the step function (`return step`)")
    return trace


def _compiled_graphs(trace: Trace) -> int:
    """Graphs ``torch.compile`` compiled during the capture of `trace`."""
    return sum(int(r.get("graphs", 0)) for r in trace.meta.get("compiled_regions", ()))


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
        self.bases: list[int] = []  # batch sizes >= 2 captured since the step's graphs last compiled

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

    def __init__(self, build: Callable[..., Any], steps: int, derive: bool, say: Callable[[str], None],
                 vary: bool = False) -> None:
        self.build, self.steps, self.derive, self.say, self.vary = build, steps, derive, say, vary
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
        trace = _capture(self.build, batch_size, self.steps, cfg.options, self.say, self.vary)
        self.captures += 1
        if self.derive and not cfg.off and batch_size >= MIN_BATCH_SIZE:
            self._learn(cfg, batch_size, trace)
        return trace, CAPTURED

    def _learn(self, cfg: _Configuration, batch_size: int, trace: Trace) -> None:
        if _compiled_graphs(trace):
            # This capture compiled graphs (the first, static at its batch size, or the
            # dynamic-shape ones dynamo makes when the batch size changes): the captures of
            # earlier graphs are no base for the graphs that serve from now on.
            cfg.model, cfg.checked_at, cfg.bases = None, 0, [batch_size]
            return
        if cfg.model is None:
            if cfg.bases:
                a = cfg.bases[0]
                cfg.model = BatchModel.from_traces(cfg.traces[a][0], a, trace, batch_size)
                if cfg.model is None:
                    why = mismatch(cfg.traces[a][0], a, trace, batch_size)
                    self._stop(cfg, f"the captures at batch sizes {a} and {batch_size} differ in more than sizes "
                                    f"affine in the batch size ({why})")
            cfg.bases.append(batch_size)
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


def fit(build: Callable[..., Any], gpu: GpuSpec, *, batch_size: int | None = None, max_batch_size: int = 1 << 16,
        steps: int = 2, alloc_conf: AllocConf = None, overheads: GpuOverheads | Mapping[str, int] | None = None,
        search: bool = True, progress: Callable[[str], None] | None = None, derive: bool = True,
        world_size: int | None = None, rank: int = 0, captured: Mapping[int, Trace] | None = None) -> FitReport:
    """Answer "does it fit, and if not what do I change" for a training step.

    `build(batch_size)` builds the model, optimizer and a batch (on the current default
    device: it runs under ``torch.device("meta")``) and returns the step function, as for
    ``capture``'s builder form. `steps` steps are captured (2 by default: optimizer state is
    created in the first step's ``optimizer.step()``, so the second step is the steady state).

    `gpu`: the GPU, as ``resolve_target`` takes it: a profile name (``"H100-80GB"``, see
    ``gpu_profiles``), ``"current"``, a ``GpuProfile``, its memory (``"24GiB"`` or bytes) or a
    ``Target``. A profile sets the capacity, the line items (unless `overheads` changes them)
    and the architecture whose CUDA dispatch choices the captures make (attention backend,
    bf16); a bare memory size keeps ``GpuOverheads()``'s line items and ``CudaChoices()``'s
    architecture. `alloc_conf`: the allocator options the step runs with
    (PYTORCH_CUDA_ALLOC_CONF's form).

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
    if world_size is not None:
        check_rank(world_size, rank)
    target = resolve_target(gpu, overheads=overheads, alloc_conf=alloc_conf, world_size=world_size)
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
    capture_options: dict[str, Any] = {"checkpoint_blocks": False, "autocast": None, "cuda": target.cuda_choices()}
    if world_size is not None:  # one rank of a sharded job (fake_dist): the batch size is per rank
        capture_options.update(world_size=world_size, rank=rank)
    # The search captures under batch_sizes_vary: a compiled step's graphs compile twice (static,
    # then with the batch size symbolic) instead of once per probe. Inductor's plan for symbolic
    # sizes can differ from the static one a run at one batch size compiles, so for such a step
    # the answers are then confirmed by static captures (`exact`), and searched again with them
    # if they disagree.
    searching = _Traces(build, steps, derive, say, vary=True)
    exact = _Traces(build, steps, False, say)
    for traces in (searching, exact):
        for bs, trace in (captured or {}).items():
            traces.config(capture_options).traces[bs] = (trace, CAPTURED)
            if bs >= MIN_BATCH_SIZE:
                traces.config(capture_options).bases.append(bs)
    use = [searching]
    cache: dict[tuple[int, int, str, tuple[tuple[str, str], ...]], Probe] = {}

    def probe(bs: int, conf: str | None = target.alloc_conf, checkpoint_blocks: bool | int = False,
              autocast: Any = None, loop: bool = False, sharding: Any = None) -> Probe:
        options = {**capture_options, "checkpoint_blocks": checkpoint_blocks, "autocast": autocast}
        if sharding:
            options["sharding"] = sharding
        if loop:  # the optimizer one parameter at a time: CUDA's foreach choice not made
            options["cuda"] = without_foreach(options["cuda"])
        traces = use[0]
        key = (int(traces is exact), bs, str(conf), _options_key(options))
        if key not in cache:
            t0 = time.perf_counter()
            trace, source = traces.get(bs, options)
            pred = replay(trace, target.with_alloc_conf(conf))
            pred.checkpointed_blocks = trace.meta.get("checkpointed_blocks", "")
            pred.checkpointed_count = int(trace.meta.get("checkpointed_count", 0))
            pred.communication_sent = communication_sent(trace)
            pred.host_bytes = host_bytes(trace)
            live = peak_live_bytes(trace, rounded=True, categories=ON_DEVICE)
            compiled = _inductor_compiled(trace)
            symbolic = any(r.get("symbolic_sizes") for r in trace.meta.get("compiled_regions", ()))
            p = cache[key] = Probe(bs, pred, time.perf_counter() - t0, source, live, symbolic)
            verdict = f"fits, peak reserved {format_size(p.prediction.peak_reserved)}" if p.fits else "OOM"
            how = (f" with {conf}" if conf != target.alloc_conf else "") + _how(options)
            shapes = (", symbolic batch size" if p.symbolic else ", static shapes" if compiled else "")
            say(f"batch size {bs}{how}: {verdict} ({source}{shapes}, {p.seconds:.1f} s)")
        return cache[key]

    report = FitReport(gpu=target, target_batch_size=batch_size, max_batch_size=0)
    if batch_size is not None:
        report.target = probe(batch_size).prediction
    if search:
        report.max_batch_size, report.searched_up_to = _largest(probe, max_batch_size, batch_size,
                                                                report.target)
    if any(_inductor_compiled(t) for t, _ in searching.config(capture_options).traces.values()):
        use[0] = exact
        _confirm_static(report, probe, max_batch_size, batch_size, exact.fallbacks, say)
    traces = use[0]
    if batch_size is not None and report.target is not None and not report.target.fits:  # (target: batch_size set)
        written, _ = traces.get(batch_size, {**capture_options, "checkpoint_blocks": False, "autocast": None})
        # foreach=False is a change only where an optimizer left its implementation to torch and
        # the capture made CUDA's choice for it (foreach).
        foreach = (bool(written.meta.get("optimizer_default_implementation"))
                   and bool(written.meta.get("cuda_choices", {}).get("optimizer")))
        strategy = written.meta.get("strategy") or {}
        report.suggestions = suggest(probe, batch_size, report.target, target.alloc_conf, foreach, bf16=target.bf16,
                                     sharding=sharding_techniques(strategy),
                                     # FSDP2 computing in bf16 already: autocast would change next to nothing
                                     amp=strategy.get("param_dtype") not in ("bfloat16", "float16"))
    plain = _options_key(capture_options)
    probes: dict[int, Probe] = {}  # by batch size; a static capture's over the search's
    for (_, bs, conf, options), p in sorted(cache.items(), key=lambda kv: kv[0][:2]):
        if conf == str(target.alloc_conf) and options == plain:
            probes[bs] = p
    report.probes = [probes[bs] for bs in sorted(probes)]
    as_written = searching.config(capture_options)
    by_size = {bs: trace for t in (searching, exact) for bs, (trace, _) in t.config(capture_options).traces.items()}
    report.traces = dict(sorted(by_size.items()))  # (a static capture's trace over the search's)
    report.captures = searching.captures + exact.captures
    report.fallbacks, report.derivation = searching.fallbacks + exact.fallbacks, as_written.note()
    return report


def _inductor_compiled(trace: Trace) -> bool:
    """Whether `trace` ran graphs inductor compiled (whose plan depends on static or symbolic sizes)."""
    return any(r.get("backend") == "inductor" and r.get("how") != EAGER_BOUND
               for r in trace.meta.get("compiled_regions", ()))


def _confirm_static(report: FitReport, probe: Callable[..., Probe], limit: int, target: int | None,
                    fallbacks: list[str], say: Callable[[str], None]) -> None:
    """`report`'s answers for a compiled step, found with dynamic-shape graphs, confirmed with the
    static graphs a run at one batch size compiles (``probe`` now captures those): the target
    batch size again, and the largest batch size that fits with the next one; if either
    verdict changes, the search runs again on static captures alone."""
    before = report.target.fits if report.target is not None else None
    if target is not None:
        report.target = probe(target).prediction
    if not report.searched_up_to:
        return
    best = report.max_batch_size
    agree = before == (report.target.fits if report.target is not None else None)
    agree = agree and (best == 0 or probe(best).fits) and (best >= limit or not probe(best + 1).fits)
    if not agree:
        line = ("the compiled step's graphs with a symbolic batch size hold other memory than its static ones "
                f"around batch size {best}: searched again, captured with static shapes at every batch size")
        fallbacks.append(line)
        say(line)
        report.max_batch_size, report.searched_up_to = _largest(probe, limit, target, report.target)


def _largest(probe: Callable[..., Probe], limit: int, target: int | None,
             target_pred: Prediction | None) -> tuple[int, int]:
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


