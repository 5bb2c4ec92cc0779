"""``vramkit.trace.fit`` on a step that calls ``torch.compile``d code (issue 33): the search
compiles the step's graphs twice (static, then with the batch size symbolic, as dynamo does when
shapes change) instead of once per probe, derives the rest, and its answer is the one static
captures give (a training run compiles its graphs for its one batch size), checked here by
capturing the step at the answer and the next size afresh, outside fit; where the symbolic and
static plans disagree at the answer, fit searches again with static captures."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from compiled_models import gpt_loss_step, hf_lm_step  # noqa: E402
from trace_models import GPTConfig  # noqa: E402

from vramkit import trace as vt  # noqa: E402
from vramkit.trace.capturing.batch_sizes import batch_sizes_vary  # noqa: E402
from vramkit.trace.fitting.derive_batch import BatchModel  # noqa: E402

CFG = GPTConfig(vocab=4096, seq=64, dim=64, heads=2, layers=1)  # compiles in about a second
GPU = "768MiB"  # the compiled step's largest batch is in the hundreds here: a long search


def _compiles(trace: vt.Trace) -> int:
    return sum(r["graphs"] for r in trace.meta["compiled_regions"])


def _fits(build, batch: int, gpu) -> bool:
    return vt.replay(vt.capture(build, batch, device="meta"), gpu).fits


def test_fit_on_a_compiled_step_compiles_a_few_times_and_answers_as_static_captures_do():
    torch._dynamo.reset()
    build = gpt_loss_step(CFG, "inductor")
    report = vt.fit(build, GPU, max_batch_size=1024)
    best = report.max_batch_size
    assert 16 < best < 1024
    assert len(report.probes) >= 10  # doubling and bisecting over hundreds of batch sizes
    compiled_at = [bs for bs, t in report.traces.items() if _compiles(t)]
    # the search's static and symbolic graphs, then the static ones at the answer and the next size
    assert compiled_at == [2, 4, best, best + 1], compiled_at
    assert any(p.derived for p in report.probes) and report.derivation.startswith("derived")
    assert all(p.symbolic == (p.batch_size not in (2, best, best + 1)) for p in report.probes)
    assert "symbolic batch size" in report.table()
    # The answer, checked by captures made here, outside fit, which compile static graphs
    # afresh as a run's first step does.
    at_best = vt.capture(build, best, device="meta")
    assert _compiles(at_best) == 2 and not any(r.get("symbolic_sizes") for r in at_best.meta["compiled_regions"])
    assert vt.replay(at_best, GPU).fits
    assert not _fits(build, best + 1, GPU)
    # An answer that the search's symbolic graphs alone would give is the same here.
    assert report.fallbacks == []


def test_captures_compile_afresh_and_reuse_graphs_only_under_batch_sizes_vary():
    torch._dynamo.reset()
    build = gpt_loss_step(CFG, "inductor")
    first, again = vt.capture(build, 4, device="meta"), vt.capture(build, 4, device="meta")
    assert _compiles(first) == 2 and _compiles(again) == 2  # each as a run's first step
    assert vt.replay(first, GPU).peak_reserved == vt.replay(again, GPU).peak_reserved
    # Under batch_sizes_vary: static graphs first, then, once the batch size changed, symbolic
    # ones that every later batch size reuses.
    with batch_sizes_vary():
        made = [vt.capture(build, b, device="meta") for b in (4, 8, 12, 6)]
    assert [_compiles(t) for t in made] == [2, 2, 0, 0]
    assert [bool(t.meta["compiled_regions"][0].get("symbolic_sizes")) for t in made] == [False, True, True, True]
    static = vt.capture(build, 12, device="meta")  # outside the mode: static graphs again
    assert _compiles(static) == 2 and not any(r.get("symbolic_sizes") for r in static.meta["compiled_regions"])
    assert vt.replay(static, GPU).peak_allocated == vt.replay(made[2], GPU).peak_allocated


def test_the_capture_hooks_are_removed_after_a_capture():
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    tables = (module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks,
              module_hooks._global_forward_hooks_always_called, optimizer_hooks._global_optimizer_pre_hooks,
              optimizer_hooks._global_optimizer_post_hooks)
    before = [dict(t) for t in tables]
    seen = []

    def build(batch: int):
        model = torch.nn.Linear(4, 4)
        x = torch.ones(batch, 4)

        def step() -> None:
            seen.append([len(t) for t in tables])
            model(x).sum().backward()

        return step

    vt.capture(build, 2, device="meta", steps=1)
    assert seen and all(n == len(b) + 1 for n, b in zip(seen[0], before))  # installed during the capture
    assert [dict(t) for t in tables] == before
    with batch_sizes_vary():  # (the fixed key)
        vt.capture(build, 2, device="meta", steps=1)
    assert [dict(t) for t in tables] == before
    # the user's own hooks, registered and removed around captures, are not disturbed
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    vt.capture(build, 2, device="meta", steps=1)
    assert handle.id in module_hooks._global_forward_hooks
    handle.remove()
    assert [dict(t) for t in tables] == before


def test_derivation_ignores_how_many_graphs_a_capture_compiled():
    build = gpt_loss_step(CFG, None)  # eager traces, given a compiled region's description by hand
    traces = {b: vt.capture(build, b, device="meta", meta={"batch_size": b}) for b in (2, 4, 6)}
    for b, graphs in ((2, 2), (4, 0), (6, 0)):
        traces[b].meta["compiled_regions"] = [{"name": "WithLoss", "how": "compiled", "backend": "inductor",
                                               "graphs": graphs, "runs": 2, "fused": True}]
    model = BatchModel.from_traces(traces[2], 2, traces[4], 4)
    assert model is not None
    derived = model.at(6)
    assert derived.meta["compiled_regions"][0]["graphs"] == 0
    assert (derived.size == traces[6].size).all()
    # anything else about a region still tells traces apart
    traces[4].meta["compiled_regions"][0]["fused"] = False
    assert BatchModel.from_traces(traces[2], 2, traces[4], 4) is None


def _search_then_confirm(symbolic_limit: int, static_limit: int, target: int | None = None):
    """fit's search on probes that fit up to `symbolic_limit`, then its confirmation on probes
    that fit up to `static_limit` (as symbolic and static graphs would): the report, the probes
    made in each mode and the fallback lines."""
    from types import SimpleNamespace

    from vramkit.trace.fitting.fit_search import FitReport, _confirm_static, _largest
    from vramkit.trace.fitting.probes import Probe

    static: list[int] = []
    limit = [symbolic_limit]
    made: list[tuple[bool, int]] = []  # (static, batch size)

    def probe(bs: int) -> Probe:
        made.append((limit is static, bs))
        return Probe(bs, SimpleNamespace(fits=bs <= limit[0]), 0.0)  # type: ignore[arg-type]

    report = FitReport(gpu=None, target_batch_size=target, max_batch_size=0)  # type: ignore[arg-type]
    if target is not None:
        report.target = probe(target).prediction
    report.max_batch_size, report.searched_up_to = _largest(probe, 256, target, report.target)
    limit = static = [static_limit]
    fallbacks: list[str] = []
    _confirm_static(report, probe, 256, target, fallbacks, lambda line: None)
    return report, [bs for is_static, bs in made if is_static], fallbacks


def test_fit_confirms_its_answer_at_two_batch_sizes_when_static_graphs_agree():
    report, static_probes, fallbacks = _search_then_confirm(40, 40)
    assert report.max_batch_size == 40 and static_probes == [40, 41] and fallbacks == []
    report, static_probes, fallbacks = _search_then_confirm(40, 40, target=64)
    assert report.max_batch_size == 40 and static_probes == [64, 40, 41] and not report.target.fits


@pytest.mark.parametrize("static_limit", [33, 41, 100, 0])
def test_fit_searches_again_with_static_graphs_where_they_disagree(static_limit):
    """Inductor's plan for a symbolic batch size can hold more or less than the static plan
    (Hugging Face GPT-2's differ by 1-3 %): where the static verdicts at the answer and the
    next size disagree with the search, the search runs again on static captures alone."""
    report, static_probes, fallbacks = _search_then_confirm(40, static_limit)
    assert report.max_batch_size == static_limit
    assert len(fallbacks) == 1 and "searched again" in fallbacks[0]
    assert len(static_probes) > 2
    # a target whose verdict changes is searched again too
    report, _, fallbacks = _search_then_confirm(40, static_limit, target=36)
    assert report.max_batch_size == static_limit and report.target.fits == (36 <= static_limit)
    assert len(fallbacks) == 1
