"""The C checkpoint planner against independent references: an exhaustive search over every
valid schedule and a Python simulator written from docs/checkpoint_model.md
(tests/checkpoint_reference.py), Revolve's closed-form operation count, and the baselines."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest

from vramkit import checkpoint as ck

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint_reference as ref  # noqa: E402


def random_chain(rng: random.Random, L: int, unit: int = 1) -> list[ck.Stage]:
    stages = []
    for _ in range(L):
        a = rng.randint(1, 8)
        stages.append(ck.Stage(rng.randint(1, 9), rng.randint(1, 9), a * unit, (a + rng.randint(0, 8)) * unit,
                               rng.randint(0, 3) * unit, rng.randint(0, 3) * unit, rng.randint(0, 3) * unit))
    return stages


def random_loss(rng: random.Random, unit: int = 1) -> ck.Stage:
    """A loss with memory of its own: cross-entropy keeps a softmax the size of its input."""
    a = rng.randint(1, 8)
    return ck.Stage(rng.randint(0, 9), rng.randint(0, 9), a * unit, (a + rng.randint(0, 8)) * unit,
                    rng.randint(0, 3) * unit, rng.randint(0, 8) * unit, rng.randint(0, 3) * unit)


def as_ref(stages):
    return [s.as_tuple() for s in stages]


def ops_of(schedule):
    names = {"forward_nosave": "FN", "forward_check": "FC", "forward_all": "FA", "backward": "B"}
    out = []
    for op in schedule.ops:
        if op.kind == "loss":
            out += [("FA", op.stage), ("B", op.stage)]
        else:
            out.append((names[op.kind], op.stage))
    return out


def test_optimal_equals_exhaustive_search_on_random_small_chains():
    rng = random.Random(1234)
    checked = 0
    for trial in range(300):
        L = rng.randint(1, 6 if trial % 10 else 8)
        stages = random_chain(rng, L)
        loss = random_loss(rng) if trial % 2 else None
        ref_loss = loss.as_tuple() if loss else None
        least = ck.min_budget(stages, loss=loss)
        assert least == ref.min_budget(as_ref(stages), loss=ref_loss)
        full = ck.plan(stages, None, "none", loss=loss).predicted_peak
        budget = rng.randint(least, max(least, full))
        # With sizes in whole bytes and as many slots as bytes, the discretisation is exact.
        got = ck.plan(stages, budget, "optimal", slots=budget, loss=loss)
        best = ref.exhaustive(as_ref(stages), budget, loss=ref_loss)
        assert best is not None, "the exhaustive search found nothing where vramkit planned"
        assert got.predicted_peak <= budget
        assert got.predicted_time == pytest.approx(best[0]), (stages, loss, budget, got, best)
        if trial % 7 == 0:  # nothing fits below the least budget, even for the exhaustive search
            assert ref.exhaustive(as_ref(stages), least - 1, loss=ref_loss) is None
        checked += 1
    assert checked == 300


def test_predictions_are_what_the_independent_simulator_measures():
    rng = random.Random(7)
    for trial in range(200):
        unit = rng.choice([1, 1000, 4096])
        stages = random_chain(rng, rng.randint(1, 12), unit=unit)
        loss = random_loss(rng, unit) if trial % 2 else None
        least = ck.min_budget(stages, loss=loss)
        budget = rng.randint(least, 3 * least)
        for algorithm in ("optimal", "revolve", "sqrt", "none"):
            try:
                s = ck.plan(stages, budget if algorithm != "none" else None, algorithm, loss=loss)
            except ck.BudgetTooSmallError:
                continue
            time, peak = ref.simulate(as_ref(stages), ops_of(s), loss=loss.as_tuple() if loss else None)
            assert (time, peak) == (pytest.approx(s.predicted_time), s.predicted_peak), algorithm
            if algorithm != "none":
                assert s.predicted_peak <= budget


def test_optimal_is_never_worse_than_the_baselines_at_the_same_budget():
    rng = random.Random(99)
    for _ in range(150):
        L = rng.randint(2, 30)
        stages = random_chain(rng, L, unit=1000)
        for other in [("sqrt", {}), ("revolve", {}), ("none", {})] + [("segments", {"segments": k})
                                                                      for k in sorted({1, 2, 3, L}) if k <= L]:
            try:
                base = ck.plan(stages, None if other[0] != "revolve" else 10**12, other[0], **other[1])
            except ck.BudgetTooSmallError:
                continue
            budget = base.predicted_peak
            opt = ck.plan(stages, budget, "optimal", slots=2000)
            assert opt.predicted_peak <= budget
            assert opt.predicted_time <= base.predicted_time * (1 + 1e-12), (other, budget)


def binomial_forward_count(steps: int, snaps: int) -> int:
    """Griewank & Walther: with s snapshots, t such that beta(s, t-1) < l <= beta(s, t),
    p(l, s) = t*l - beta(s+1, t-1), beta(s, t) = C(s+t, s)."""
    beta = lambda s, t: math.comb(s + t, s) if t >= 0 else 0  # noqa: E731
    t = 0
    while beta(snaps, t) < steps:
        t += 1
    return t * steps - beta(snaps + 1, t - 1)


def test_revolve_forward_count_matches_the_binomial_formula():
    seen = set()
    for L in range(1, 60):
        stages = [ck.Stage(1, 1, 100, 100)] * L
        least = ck.min_budget(stages)
        for budget in range(least, least + 100 * 8, 100):  # each 100 bytes more allows one more snapshot
            s = ck.plan(stages, budget, "revolve")
            snaps = _max_live_checkpoints(s)  # Revolve's s: the chain input counts as one
            advances = s.count("forward_nosave") + s.count("forward_check")
            assert advances == binomial_forward_count(L, snaps), (L, budget, snaps, s)
            seen.add(snaps)
    assert seen >= set(range(1, 8))


def _max_live_checkpoints(s) -> int:
    """How many x_i are held as checkpoints at once (x_0 included)."""
    live, best = {0}, 1
    for op in s.ops:
        if op.kind == "forward_check":
            live.add(op.stage)
        elif op.kind == "backward":
            live.discard(op.stage)
        best = max(best, len(live))
    return best


def test_infeasible_budget_names_the_least_one_and_that_one_works():
    rng = random.Random(5)
    for _ in range(50):
        stages = random_chain(rng, rng.randint(1, 20), unit=512)
        least = ck.min_budget(stages)
        best = ref.exhaustive(as_ref(stages), least) if len(stages) <= 6 else (0, None)
        assert best is not None
        with pytest.raises(ck.BudgetTooSmallError) as e:
            ck.plan(stages, least - 1)
        assert e.value.min_budget == least and f"{least:,}" in str(e.value)
        assert ck.plan(stages, least).predicted_peak <= least


def test_schedule_repr_dict_and_argument_errors():
    stages = [ck.Stage(1.0, 2.0, 10, 30)] * 4
    s = ck.plan(stages, 100)
    assert "optimal" in repr(s) and "Loss" in repr(s)
    d = s.to_dict()
    assert d["predicted_peak"] == s.predicted_peak and len(d["ops"]) == len(s.ops)
    with pytest.raises(ValueError, match="saved_bytes .* must include the input"):
        ck.Stage(1, 1, 10, 5)
    with pytest.raises(ValueError, match="unknown algorithm 'fast'"):
        ck.plan(stages, 100, "fast")
    with pytest.raises(ValueError, match="needs segments=k"):
        ck.plan(stages, 100, "segments")
    with pytest.raises(ValueError, match="segments must be an int in 1..4"):
        ck.plan(stages, 100, "segments", segments=5)
    with pytest.raises(ValueError, match="stages is empty"):
        ck.plan([], 100)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        ck.plan(stages, -5)
    with pytest.raises(ValueError, match="op 0: FWD_ALL.1. needs x_1"):
        ck.simulate(stages, [("forward_all", 1)])
    with pytest.raises(ValueError, match=r"output_bytes \(7\) and loss.input_bytes \(10\) disagree"):
        ck.plan(stages, 100, loss=ck.Stage(0, 0, 10, 20), output_bytes=7)
    with pytest.raises(ValueError, match="loss: Stage.saved_bytes"):
        ck.plan(stages, 100, loss=(0, 0, 10, 5))


def test_the_loss_memory_counts_where_the_loss_runs():
    # a chain whose loss keeps a softmax twice its input: the loss, not a stage, sets the peak
    stages = [ck.Stage(1.0, 2.0, 100, 300)] * 3
    free = ck.plan(stages, None, "none")
    ce = ck.Stage(0.5, 0.5, 100, 300, 0, 400)
    costly = ck.plan(stages, None, "none", loss=ce)
    t, p = ref.simulate(as_ref(stages), ops_of(costly), loss=ce.as_tuple())
    assert (costly.predicted_time, costly.predicted_peak) == (pytest.approx(t), p)
    assert costly.predicted_time == pytest.approx(free.predicted_time + 1.0)
    # store-everything: x_0 + 3 x (x_{i+1} + tape_i) = 100 + 3 * 300 = 1000 before the loss, whose
    # forward adds its 200 saved bytes and whose backward adds the 100-byte gradient + 400 transient
    assert free.predicted_peak < costly.predicted_peak == 1000 + 200 + 100 + 400
    # least: a stage's backward needs x_0 + x_i + tape_i + delta_{i+1} + delta_i = 600; the loss's
    # x_0 + x_3 + its tape + delta_3 + its transient = 900
    assert ck.min_budget(stages) == 600 and ck.min_budget(stages, loss=ce) == 900
