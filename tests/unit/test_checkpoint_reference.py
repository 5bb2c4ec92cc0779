"""The checkpoint reference (tests/checkpoint_reference.py) checked against itself.

simulate() is the rule book of docs/checkpoint_model.md; exhaustive() searches every valid op
sequence; persistent_dp() transcribes the document's DP; min_budget() is the DP's min-peak
form. These tests pin that they agree:
- every DP schedule replays to exactly the DP's time, within the budget;
- the DP's time equals the general optimum (exhaustive) and feasibility agrees;
- the least feasible budget is min_budget(), which can be *below* the peak of the
  "store only x_0 and recompute" schedule (a counterexample is pinned);
- exhaustive() itself agrees with a blind depth-first enumeration of op sequences on tiny chains.
Set VRAMKIT_CKPT_REF_SCALE=20 (say) for a long run; the default keeps the file under ~15 s.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint_reference as R  # noqa: E402

SCALE = float(os.environ.get("VRAMKIT_CKPT_REF_SCALE", "1"))
KINDS = R.KINDS


def rand_chain(rng, L):
    """Sizes 1..8, times 1..9, transients 0..3, saved = input + 0..8; output size 1..8."""
    stages = []
    for _ in range(L):
        a = rng.randint(1, 8)
        stages.append((rng.randint(1, 9), rng.randint(1, 9), a, a + rng.randint(0, 8),
                       rng.randint(0, 3), rng.randint(0, 3)))
    return stages, rng.randint(1, 8)


def budgets(rng, stages, out):
    lo = R.min_budget(stages, out)
    hi = R.simulate(stages, R.store_all_schedule(len(stages)), out)[1]
    return lo, hi, sorted({lo - 1, lo, hi, rng.randint(lo, hi), rng.randint(lo, hi)})


# ---------------------------------------------------------------------------------------------
# simulate: hand-checked values and rejections
# ---------------------------------------------------------------------------------------------

# One stage: f=5, b=1, a_0=1, saved=1 (tape 0), ft=2, bt=2; output a_1=3.
ONE = [(5, 1, 1, 1, 2, 2)]


def test_simulate_hand_checked_one_stage():
    # store all: FA(0) 1+3+0+2=6, FA(1) 1+3=4, B(1) 1+3+3=7, B(0) x0+delta1+a0+bt0 = 1+3+1+2=7
    assert R.simulate(ONE, R.store_all_schedule(1), output_bytes=3) == (6, 7)
    # recompute all: FC(0) 1+3+2=6, FA(1) 4, B(1) 7, FA(0) x0+delta1+x1+ft0 = 1+3+3+0+2 = 9, B(0) 7
    assert R.recompute_all_schedule(1) == [("FC", 0), ("FA", 1), ("B", 1), ("FA", 0), ("B", 0)]
    assert R.simulate(ONE, R.recompute_all_schedule(1), output_bytes=3) == (11, 9)
    # dicts and tuples are the same chain; the default output size is a_{L-1}
    d = [dict(zip(("fwd_time", "bwd_time", "input_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp"), ONE[0]))]
    assert R.simulate(d, R.store_all_schedule(1), output_bytes=3) == (6, 7)
    assert R.simulate(ONE, R.store_all_schedule(1)) == (6, 1 + 1 + 1 + 2)  # a_1 = a_0 = 1: B(0) peak 5


def test_simulate_hand_checked_two_stages():
    # stage 0: f=2 b=3 a=4 saved=6 (tape 2) ft=1 bt=1; stage 1: f=3 b=4 a=2 saved=5 (tape 3) ft=0 bt=2;
    # output a_2 = 1.
    st = [(2, 3, 4, 6, 1, 1), (3, 4, 2, 5, 0, 2)]
    ops = [("FC", 0), ("FA", 1), ("FA", 2), ("B", 2), ("B", 1), ("FA", 0), ("B", 0)]
    # FC(0): 4 + 2 + 1 = 7 | x0 x1
    # FA(1): 4+2 + 1 + 3 + 0 = 10 | x0 x1 tape1 x2
    # FA(2): 4+2+3+1 = 10 | B(2): 10 + a_2 = 11 | x0 x1 tape1 delta2
    # B(1): 4+2+3+1 + a_1 + bt_1 = 10 + 2 + 2 = 14 | x0 delta1
    # FA(0): 4+2 + a_1 + tape_0 + ft_0 = 6+2+2+1 = 11 (x_1 dropped after: B(1) ran)
    # B(0): 4+2+2 + a_0 + bt_0 = 8+4+1 = 13
    assert R.simulate(st, ops, output_bytes=1) == (2 + 3 + 0 + 0 + 4 + 2 + 3, 14)
    # FN(0) after B(1) does not bring x_1 back, so a following FA(0)'s peak is unchanged
    ops2 = ops[:5] + [("FN", 0)] + ops[5:]
    assert R.simulate(st, ops2, output_bytes=1) == (14 + 2, 14)


def test_fn_consumes_its_input_unless_held():
    st = [(1, 1, 2, 2, 0, 0), (1, 1, 2, 2, 0, 0), (1, 1, 2, 2, 0, 0)]
    # FN(1) consumes x_1: FA(1) afterwards has nothing to run on
    with pytest.raises(ValueError, match=r"^op 2: FA\(1\) needs x_1 present"):
        R.simulate(st, [("FN", 0), ("FN", 1), ("FA", 1)])
    # FC(1) keeps it; x_0 always stays
    R.replay(st, [("FN", 0), ("FC", 1), ("FA", 1), ("FN", 0)])
    # x_1 held by FA(1) survives FN(1)
    R.replay(st, [("FN", 0), ("FA", 1), ("FN", 1), ("FN", 1)])


@pytest.mark.parametrize("ops, message", [
    ([("FA", 1)], r"^op 0: FA\(1\) needs x_1 present"),
    ([("FA", 0), ("FA", 1), ("FA", 2), ("B", 1)], r"^op 3: B\(1\) out of order: the next backward must be B\(2\)"),
    ([("FC", 0), ("FA", 1), ("FA", 2), ("FN", 0)], r"^op 3: FN\(0\) between the loss's FA\(2\) and B\(2\)"),
    ([("FA", 0), ("FN", 1), ("FA", 2), ("B", 2), ("B", 1)], r"^op 4: B\(1\) needs tape_1"),
    ([("FA", 0), ("FA", 1), ("FA", 2), ("B", 2), ("B", 1)], r"^op 5: the schedule ends without delta_0"),
    ([], r"^op 0: the schedule ends without delta_0"),
    (R.store_all_schedule(2) + [("FN", 0)], r"^op 6: FN\(0\) after B\(0\)"),
    ([("FX", 0)], r"^op 0: unknown kind"),
    ([("FN", 3)], r"^op 0: stage index 3 is outside 0..2"),
    ([("FN",)], r"^op 0: .* is not a \(kind, stage\) pair"),
])
def test_simulate_rejects(ops, message):
    st = [(1, 1, 2, 3, 0, 0), (1, 1, 2, 3, 0, 0)]
    with pytest.raises(ValueError, match=message):
        R.simulate(st, ops)


def test_chain_rejects_bad_stages():
    with pytest.raises(ValueError, match="saved_bytes"):
        R.simulate([(1, 1, 4, 3, 0, 0)], R.store_all_schedule(1))
    with pytest.raises(ValueError, match="at least one stage"):
        R.exhaustive([], 10)
    with pytest.raises(ValueError, match="missing key"):
        R.persistent_dp([{"fwd_time": 1}], 10)


# ---------------------------------------------------------------------------------------------
# DP vs simulator vs exhaustive
# ---------------------------------------------------------------------------------------------

def test_dp_schedules_replay_exactly():
    rng = random.Random(20240601)
    for _ in range(int(300 * SCALE)):
        L = rng.randint(1, 6)
        st, out = rand_chain(rng, L)
        lo, hi, bs = budgets(rng, st, out)
        for B in bs:
            r = R.persistent_dp(st, B, out)
            if B < lo:
                assert r is None
                continue
            assert r is not None, (st, out, B)
            t, p = R.simulate(st, r[1], out)
            assert t == r[0] and p <= B, (st, out, B, r, t, p)
        # with an unlimited budget the DP reaches the store-all time (every stage once)
        assert R.persistent_dp(st, hi, out)[0] == sum(s[0] + s[1] for s in st)


def test_dp_equals_exhaustive():
    rng = random.Random(1234567)
    n = 0
    for _ in range(int(220 * SCALE)):
        L = rng.randint(1, 6)
        st, out = rand_chain(rng, L)
        lo, hi, bs = budgets(rng, st, out)
        for B in bs:
            e = R.exhaustive(st, B, out)
            d = R.persistent_dp(st, B, out)
            assert (e is None) == (d is None), (st, out, B, e, d)
            if e is not None:
                assert e[0] == d[0], (st, out, B, e, d)
                t, p = R.simulate(st, e[1], out)
                assert t == e[0] and p <= B, (st, out, B, e, t, p)
                n += 1
    assert n > 500


def test_min_budget_is_exact_and_recompute_all_is_not_minimal():
    rng = random.Random(99)
    strictly_below = 0
    for _ in range(int(150 * SCALE)):
        L = rng.randint(1, 6)
        st, out = rand_chain(rng, L)
        lo = R.min_budget(st, out)
        assert R.exhaustive(st, lo, out) is not None, (st, out, lo)
        assert R.exhaustive(st, lo - 1, out) is None, (st, out, lo)
        assert R.persistent_dp(st, lo, out) is not None and R.persistent_dp(st, lo - 1, out) is None
        _, rc_peak = R.simulate(st, R.recompute_all_schedule(L), out)
        assert rc_peak >= lo
        strictly_below += rc_peak > lo
    # about one chain in five can run below the recompute-all peak
    assert strictly_below > 0


def test_recompute_all_peak_is_not_the_minimum_counterexample():
    # Recomputing x_1 for B(0) runs FA(0) while delta_1 is present (1+3+3+0+2 = 9); keeping x_1 and
    # tape_0 from the first forward instead peaks at 7 (B(1) and B(0)).
    assert R.simulate(ONE, R.recompute_all_schedule(1), output_bytes=3)[1] == 9
    assert R.min_budget(ONE, output_bytes=3) == 7
    e = R.exhaustive(ONE, 8, output_bytes=3)
    assert e is not None and R.simulate(ONE, e[1], output_bytes=3)[1] <= 7
    assert R.exhaustive(ONE, 6, output_bytes=3) is None


# ---------------------------------------------------------------------------------------------
# exhaustive vs a blind enumeration of op sequences (tiny chains)
# ---------------------------------------------------------------------------------------------

def blind_search(st, out, budget, maxlen):
    """Depth-first over every op sequence of length <= maxlen, pruned only by replay's validity,
    the budget, and dominance: a prefix is dropped when replay reports a state already reached
    by another prefix with no more time, no higher peak and no more ops. Least time found, or None."""
    ops_all = [(k, i) for i in range(len(st) + 1) for k in KINDS]
    best = [None]
    seen = {}
    ops = []

    def dfs():
        try:
            t, p, nb, state = R.replay(st, ops, out, with_state=True)
        except ValueError:
            return
        if p > budget or (best[0] is not None and t >= best[0]):
            return
        n = len(ops)
        front = seen.setdefault(state, [])
        if any(t0 <= t and p0 <= p and n0 <= n for t0, p0, n0 in front):
            return
        front.append((t, p, n))
        if nb == -1:
            best[0] = t
            return
        if len(ops) < maxlen:
            for op in ops_all:
                ops.append(op)
                dfs()
                ops.pop()

    dfs()
    return best[0]


# L = 3 (about 15 s a chain) only in long runs
@pytest.mark.parametrize("L, maxlen, chains", [(1, 8, 12), (2, 10, 4)] + ([(3, 12, 1)] if SCALE >= 2 else []))
def test_exhaustive_matches_blind_enumeration(L, maxlen, chains):
    rng = random.Random(5 + L)
    for _ in range(int(chains * SCALE)):
        st, out = rand_chain(rng, L)
        lo, hi, bs = budgets(rng, st, out)
        for B in bs:
            e = R.exhaustive(st, B, out)
            got = blind_search(st, out, B, maxlen)
            assert got == (e[0] if e else None), (st, out, B, e, got)


def test_exhaustive_state_cap():
    rng = random.Random(3)
    st, out = rand_chain(rng, 6)
    lo = R.min_budget(st, out)
    with pytest.raises(R.SearchLimit):
        R.exhaustive(st, lo, out, max_states=5)
