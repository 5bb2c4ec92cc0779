"""vramkit.trace.fitting.derive_batch and fit's use of it: traces derived from two captures equal the
captures at other batch sizes, column for column; steps whose allocations change with the batch
size in any other way are refused and fit captures them instead, with the same answers as a fit
that captures every probe; and a fit that derives captures a bounded number of times."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from vramkit import trace as vt

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from vramkit.trace.fitting import fit_search  # noqa: E402
from vramkit.trace.fitting.derive_batch import BatchModel, first_difference, mismatch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_models import GPTConfig, gpt_builder, resnet_builder  # noqa: E402

MiB = 1 << 20
COLUMNS = ("kind", "id", "size", "stream", "alloc_dtype", "alloc_category", "alloc_module", "alloc_op")


def mlp_builder(width: int = 128, depth: int = 3, features: int = 32, classes: int = 10,
                extra_above: int | None = None, pairwise: bool = False, odd_half: bool = False):
    """An MLP trained with AdamW. `extra_above`: the step allocates one more tensor when the
    batch is larger (another allocation sequence); `pairwise`: a batch x batch matrix (sizes
    quadratic in the batch); `odd_half`: a buffer of ceil(batch / 2) floats (not affine)."""
    def build(batch_size: int):
        torch.manual_seed(0)
        dims = [features] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, classes))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(batch_size, features)
        y = torch.randint(0, classes, (batch_size,))

        def step():
            h = model(x)
            if extra_above is not None and batch_size > extra_above:
                h = h + torch.zeros_like(h)
            loss = F.cross_entropy(h, y)
            if pairwise:
                loss = loss + (x @ x.t()).mean() * 0
            if odd_half:
                loss = loss + torch.zeros((batch_size + 1) // 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


MODELS = {
    "gpt-sdpa": gpt_builder(GPTConfig()),
    "gpt-matmul-attention": gpt_builder(GPTConfig(sdpa=False)),
    "gpt-checkpointed": gpt_builder(GPTConfig(checkpoint=True)),
    "resnet": resnet_builder(),
    "mlp-adamw": mlp_builder(),
}


def cap(build, batch: int, **options) -> vt.Trace:
    """A capture as fit makes it."""
    return vt.capture(build, batch, device="meta", steps=2, meta={"batch_size": batch}, **options)


def assert_same_trace(derived: vt.Trace, captured: vt.Trace) -> None:
    """Every column, string table and meta entry; not through derive_batch's own comparison."""
    for name in COLUMNS:
        a, b = getattr(derived, name), getattr(captured, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert (derived.dtypes, derived.modules, derived.ops) == (captured.dtypes, captured.modules, captured.ops)
    assert derived.meta == captured.meta
    assert first_difference(derived, captured) is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_derived_traces_equal_captures(name):
    build = MODELS[name]
    model = BatchModel.from_traces(cap(build, 2), 2, cap(build, 4), 4)
    assert model is not None, mismatch(cap(build, 2), 2, cap(build, 4), 4)
    grows = model.slope != 0
    assert grows.any() and (~grows).any()  # activations grow with the batch, parameters do not
    for batch in (3, 5, 8, 13):
        derived = model.at(batch)
        assert derived.meta["batch_size"] == batch
        assert_same_trace(derived, cap(build, batch))


@pytest.mark.parametrize("options", [{"checkpoint_blocks": True}, {"autocast": "bf16"}, {"checkpoint_blocks": 1}],
                         ids=["checkpoint-every-block", "bf16-autocast", "checkpoint-one-block"])
def test_derived_traces_equal_captures_with_fits_capture_options(options):
    options = {k: (torch.bfloat16 if v == "bf16" else v) for k, v in options.items()}
    build = gpt_builder(GPTConfig(layers=3))
    model = BatchModel.from_traces(cap(build, 2, **options), 2, cap(build, 6, **options), 6)
    assert model is not None
    for batch in (3, 4, 9):
        assert_same_trace(model.at(batch), cap(build, batch, **options))


def test_batch_size_one_is_never_a_base_nor_derived():
    build = MODELS["gpt-matmul-attention"]
    # A (1, L, D) tensor is contiguous where (2, L, D) is not: batch 1 takes another op path.
    assert cap(build, 1).num_events != cap(build, 2).num_events
    with pytest.raises(ValueError, match="integer >= 2"):
        BatchModel.from_traces(cap(build, 1), 1, cap(build, 2), 2)
    model = BatchModel.from_traces(cap(build, 2), 2, cap(build, 3), 3)
    with pytest.raises(ValueError, match="integer >= 2"):
        model.at(1)
    with pytest.raises(ValueError, match="must differ"):
        BatchModel.from_traces(cap(build, 2), 2, cap(build, 2), 2)
    with pytest.raises(ValueError, match="meta says batch size 2"):
        BatchModel.from_traces(cap(build, 2), 3, cap(build, 4), 4)
    with pytest.raises(TypeError, match="must be a vramkit.trace.Trace"):
        BatchModel.from_traces("t.vktrace", 2, cap(build, 4), 4)


def test_steps_that_are_not_batch_affine_are_refused():
    extra = mlp_builder(extra_above=4)
    # Two captures below the change make a model; the capture above it disagrees.
    model = BatchModel.from_traces(cap(extra, 2), 2, cap(extra, 4), 4)
    assert model is not None
    assert "events" in first_difference(model.at(8), cap(extra, 8))
    assert BatchModel.from_traces(cap(extra, 2), 2, cap(extra, 8), 8) is None
    assert "events at batch size 2" in mismatch(cap(extra, 2), 2, cap(extra, 8), 8)
    # Quadratic sizes: any two captures fit a line (p(b) - p(a) is a multiple of b - a), a third does not.
    pairwise = mlp_builder(pairwise=True)
    model = BatchModel.from_traces(cap(pairwise, 2), 2, cap(pairwise, 4), 4)
    assert model is not None
    assert first_difference(model.at(8), cap(pairwise, 8)).startswith("event ")
    # ceil(b / 2) floats: 4 bytes at 2, 12 at 5, not a whole number of bytes per sample.
    odd = mlp_builder(odd_half=True)
    assert BatchModel.from_traces(cap(odd, 2), 2, cap(odd, 5), 5) is None
    assert "not a whole number of bytes per sample" in mismatch(cap(odd, 2), 2, cap(odd, 5), 5)
    # Anything but sizes: meta (other than the batch size), the per-allocation tables.
    a, b = cap(MODELS["mlp-adamw"], 2), cap(MODELS["mlp-adamw"], 4)
    b.meta["steps"] = 3
    assert "meta['steps']" in mismatch(a, 2, b, 4)
    b.meta["steps"] = a.meta["steps"]
    b.alloc_category[5] = (a.alloc_category[5] + 1) % len(vt.CATEGORIES)
    assert mismatch(a, 2, b, 4).startswith("allocation 5: category")
    assert mismatch(a, 2, cap(MODELS["mlp-adamw"], 4), 4) is None


def test_sizes_that_leave_the_valid_range_are_refused():
    def trace(size: int, batch: int) -> vt.Trace:
        return vt.Trace.from_columns(kind=[vt.ALLOC, vt.FREE], id=[0, 0], size=[size, size], meta={"batch_size": batch})

    model = BatchModel.from_traces(trace(100, 2), 2, trace(50, 4), 4)
    assert int(model.at(6).size[0]) == 0
    with pytest.raises(ValueError, match="would have size -50"):
        model.at(8)
    big = BatchModel.from_traces(trace(1 << 40, 2), 2, trace(1 << 41, 4), 4)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        big.at(1 << 30)


def answers(report: vt.FitReport):
    return (report.max_batch_size, report.fits,
            [(p.batch_size, p.fits, p.prediction.peak_allocated, p.prediction.peak_reserved) for p in report.probes],
            [(s.change, s.settings, s.prediction.peak_allocated, s.prediction.peak_reserved, s.cost)
             for s in report.suggestions],
            report.target.verdict() if report.target is not None else None)


@pytest.fixture
def count_captures(monkeypatch):
    """What fit captures, by wrapping the capture it calls: (batch size, capture options)."""
    seen: list[tuple[int, str]] = []
    real = fit_search.capture

    def counting(build, batch_size, **kwargs):
        options = {k: v for k, v in kwargs.items() if k not in ("device", "steps", "meta")}
        seen.append((batch_size, str(sorted(options.items()))))
        return real(build, batch_size, **kwargs)

    monkeypatch.setattr(fit_search, "capture", counting)
    return seen


def fit_both(count_captures, build, capacity, progress=None, **kwargs):
    """fit with derivation (telling `progress`) and without, and the batch sizes each captured
    (in order)."""
    derived = vt.fit(build, capacity, overheads=vt.NO_OVERHEADS, progress=progress, **kwargs)
    captured_by_derived = [b for b, _ in count_captures]
    count_captures.clear()
    every = vt.fit(build, capacity, overheads=vt.NO_OVERHEADS, derive=False, **kwargs)
    return derived, captured_by_derived, every, [b for b, _ in count_captures]


@pytest.mark.parametrize("name, capacity", [("resnet-small", 4 * MiB), ("gpt-sdpa", 200 * MiB),
                                            ("gpt-matmul-attention", 120 * MiB)])
def test_fit_answers_do_not_depend_on_derivation(count_captures, name, capacity):
    build = (resnet_builder(widths=(8, 16), blocks=(1, 1), image=16) if name == "resnet-small"
             else MODELS[name])
    derived, sizes, every, all_sizes = fit_both(count_captures, build, capacity)
    assert answers(derived) == answers(every)
    assert derived.max_batch_size > 8  # deep enough that traces were derived
    assert sizes == [2, 4, 8] and derived.captures == 3
    assert sorted(all_sizes) == [p.batch_size for p in every.probes] and every.captures == len(all_sizes)
    assert all(not p.derived for p in every.probes) and every.derivation == ""
    assert {p.batch_size for p in derived.probes if not p.derived} == {2, 4, 8}
    # What fit replayed is what a capture gives, and it is what cmd_fit saves and draws.
    best = derived.max_batch_size
    assert_same_trace(derived.trace(best), cap(build, best))
    with pytest.raises(KeyError, match="was not probed"):
        derived.trace(10 ** 6)


def test_a_search_into_the_hundreds_captures_three_times(count_captures):
    build = mlp_builder(width=256)
    capacity = vt.replay(cap(build, 300), "1GiB", overheads=vt.NO_OVERHEADS).peak_reserved
    lines: list[str] = []
    derived, sizes, every, all_sizes = fit_both(count_captures, build, capacity, progress=lines.append)
    best = derived.max_batch_size
    assert best >= 256
    assert answers(derived) == answers(every)
    assert sizes == [2, 4, 8] and len(all_sizes) == len(every.probes) > 12
    # Checked by capture, independently of fit: best fits, best + 1 does not.
    assert vt.replay(cap(build, best), capacity, overheads=vt.NO_OVERHEADS).fits
    assert not vt.replay(cap(build, best + 1), capacity, overheads=vt.NO_OVERHEADS).fits
    # The progress lines and the table say which traces were derived.
    assert sum("(derived, " in line for line in lines) == len(derived.probes) - 3
    assert sum("(captured, " in line for line in lines) == 3
    table = derived.table()
    assert table.count("(derived)") == len(derived.probes) - 3
    assert "from the captures at batch sizes 2 and 4" in table and "3 captures in all" in table


@pytest.mark.parametrize("kind", ["extra-allocation-above-4", "pairwise-quadratic"])
def test_fit_falls_back_to_capturing_with_the_same_answers(count_captures, kind):
    build = mlp_builder(extra_above=4) if kind.startswith("extra") else mlp_builder(pairwise=True)
    capacity = vt.replay(cap(build, 40), "1GiB", overheads=vt.NO_OVERHEADS).peak_reserved
    lines: list[str] = []
    derived, sizes, every, all_sizes = fit_both(count_captures, build, capacity, progress=lines.append)
    assert answers(derived) == answers(every)
    assert derived.max_batch_size >= 16
    # The check at 8 failed: nothing was derived, every probe was captured.
    assert not any(p.derived for p in derived.probes)
    assert sorted(sizes) == sorted(all_sizes) == [p.batch_size for p in derived.probes]
    assert len(derived.fallbacks) == 1 and "differs from the trace derived from batch sizes 2 and 4" \
        in derived.fallbacks[0]
    assert derived.fallbacks[0] in lines and derived.derivation.startswith("every trace captured")
    assert "every trace captured" in derived.table()


def test_fit_suggestions_do_not_depend_on_derivation(count_captures):
    """A batch that does not fit: accumulation probes micro-batches (derived once checked),
    checkpointing and autocast are captured per configuration, allocator options reuse traces."""
    build = gpt_builder(GPTConfig(layers=3, seq=128, dim=64))
    capacity = vt.replay(cap(build, 4), "8GiB", overheads=vt.NO_OVERHEADS).peak_reserved
    derived = vt.fit(build, capacity, overheads=vt.NO_OVERHEADS, batch_size=32, search=False)
    keys = list(count_captures)
    count_captures.clear()
    every = vt.fit(build, capacity, overheads=vt.NO_OVERHEADS, batch_size=32, search=False, derive=False)
    assert not derived.target.fits and derived.suggestions
    assert answers(derived) == answers(every)
    assert derived.captures == len(keys) < len(count_captures) == every.captures
    # One capture per batch size and configuration at most: allocator options replay the same trace.
    assert len(set(keys)) == len(keys) and len(set(count_captures)) == len(count_captures)


def test_derive_must_be_a_bool():
    with pytest.raises(TypeError, match="derive must be True or False"):
        vt.fit(MODELS["mlp-adamw"], "1GiB", derive="yes")
