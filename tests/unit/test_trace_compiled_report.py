"""What a prediction says of a step's torch.compile'd regions (``trace.meta["compiled_regions"]``,
written by the capture): never a silent eager answer. A region predicted as eager makes the
verdict an upper bound and is named; malformed entries (a file's meta is untrusted) are dropped."""

from __future__ import annotations

import pytest

import vramkit.trace as vt

MiB = 1 << 20


def trace_with(regions) -> vt.Trace:
    return vt.Trace.from_columns(kind=[vt.STEP, vt.ALLOC, vt.FREE], id=[0, 0, 0], size=[0, 4 * MiB, 4 * MiB],
                                 meta={"compiled_regions": regions})


def test_an_eager_bound_region_is_named_in_the_verdict_and_table():
    regions = [{"name": "model (GPT)", "how": "compiled", "why": "inductor's partition and memory plan",
                "backend": "inductor"},
               {"name": "loss_fn", "how": "eager upper bound", "why": "backend 'mine' is not modelled",
                "backend": "mine"}]
    p = vt.replay(trace_with(regions), "1GiB")
    assert p.eager_bound_regions == ["loss_fn"]
    assert p.verdict().endswith("; an upper bound: compiled loss_fn predicted as eager")
    table = p.table()
    assert "compiled model (GPT)" in table and "predicted as compiled (inductor's partition" in table
    assert "compiled loss_fn" in table and "predicted as EAGER: an upper bound (backend 'mine'" in table
    oom = vt.replay(trace_with(regions), 2 * MiB, overheads=vt.NO_OVERHEADS)
    assert not oom.fits and oom.verdict().endswith("predicted as eager")


def test_all_compiled_is_not_an_upper_bound():
    p = vt.replay(trace_with([{"name": "model", "how": "compiled", "why": "", "backend": "inductor"}]), "1GiB")
    assert p.eager_bound_regions == [] and "upper bound" not in p.verdict()


@pytest.mark.parametrize("regions", ["model", 7, [1, "x", None], {"name": "model"}])
def test_malformed_regions_are_dropped(regions):
    p = vt.replay(trace_with(regions), "1GiB")
    assert p.compiled_regions == [] and "compiled" not in p.table()


def test_fit_says_its_largest_batch_is_a_lower_bound():
    from vramkit.trace.fitting.fit_search import FitReport
    from vramkit.trace.fitting.probes import Probe

    regions = [{"name": "model (GPT)", "how": "eager upper bound", "why": "a cpu capture", "backend": "inductor"}]
    p = vt.replay(trace_with(regions), "1GiB")
    report = FitReport(gpu=p.gpu, target_batch_size=None, max_batch_size=8, probes=[Probe(8, p, 0.0)], searched_up_to=64)
    assert report.eager_bound_regions == ["model (GPT)"]
    assert "largest batch size that fits: 8 (at least: compiled model (GPT) predicted as eager" in report.table()
    plain = FitReport(gpu=p.gpu, target_batch_size=None, max_batch_size=8,
                      probes=[Probe(8, vt.replay(trace_with([]), "1GiB"), 0.0)], searched_up_to=64)
    assert "at least" not in plain.table()


def test_a_region_without_its_cuda_graphs_is_a_lower_bound():
    from vramkit.trace.capturing.compiled_regions import NO_CUDA_GRAPHS
    from vramkit.trace.fitting.fit_search import FitReport
    from vramkit.trace.fitting.probes import Probe

    regions = [{"name": "model (GPT)", "how": NO_CUDA_GRAPHS, "why": "mode='reduce-overhead'", "backend": "inductor"}]
    p = vt.replay(trace_with(regions), "1GiB")
    assert p.lower_bound_regions == ["model (GPT)"] and p.eager_bound_regions == []
    assert p.verdict().endswith("; a lower bound: the CUDA graphs of compiled model (GPT) left out")
    assert "predicted without its CUDA graphs: a lower bound" in p.table()
    report = FitReport(gpu=p.gpu, target_batch_size=None, max_batch_size=8, probes=[Probe(8, p, 0.0)], searched_up_to=64)
    assert "(at most: the CUDA graphs of compiled model (GPT) left out)" in report.table()
