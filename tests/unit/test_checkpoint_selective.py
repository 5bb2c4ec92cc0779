"""Selective activation checkpointing in vramkit.checkpoint.apply: the per-op pricing
(checked against sizes computed here), the simulator model of a selective block (level 0 must be
exactly whole-block checkpointing), and the plans apply makes, run against torch's own
selective checkpointing on the same blocks and the uncheckpointed model (CPU, float64)."""

from __future__ import annotations

import copy
import random

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as tuc  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vramkit import checkpoint as ck  # noqa: E402
from vramkit.checkpoint import choose as ch  # noqa: E402
from vramkit.checkpoint import selective as sel  # noqa: E402

from test_checkpoint_any import _same, gpt_case, resnet_case, step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

aten = torch.ops.aten


# ----------------------------------------------------------------------------- the simulator model


def _random_chain(rng: random.Random, n: int) -> tuple[list[ck.Stage], int]:
    stages = []
    for _ in range(n):
        a = rng.randrange(1, 50) * 64
        stages.append(ck.Stage(rng.uniform(0.1, 2), rng.uniform(0.1, 4), a, a + rng.randrange(0, 400) * 64,
                               rng.randrange(0, 100) * 64, rng.randrange(0, 100) * 64, rng.randrange(0, 100) * 64))
    return stages, rng.randrange(1, 50) * 64


def test_level_zero_is_exactly_whole_block_checkpointing():
    """selective_stage at level 0 (nothing saved), run as FA(i) ... B(i), has the peak and the
    time of FC(i) ... FA(i) B(i) with the block's own stage, for every subset of blocks."""
    rng = random.Random(7)
    level0 = sel.SelectiveLevel((), 0, 0.0)
    for _ in range(60):
        n = rng.randrange(1, 7)
        stages, out = _random_chain(rng, n)
        nxt = [s.input_bytes for s in stages[1:]] + [out]
        for mask in range(1 << n):
            whole = {i for i in range(n) if mask >> i & 1}
            t_ref, p_ref = ck.simulate(stages, ch.block_schedule(n, whole), output_bytes=out)
            as_sel = [sel.selective_stage(s, level0, nxt[i]) if i in whole else s for i, s in enumerate(stages)]
            t, p = ck.simulate(as_sel, ch.block_schedule(n, set()), output_bytes=out)
            assert p == p_ref
            assert t == pytest.approx(t_ref)


def test_selective_stage_keeps_what_it_saves_and_recomputes_the_rest():
    s = ck.Stage(2.0, 3.0, 100, 1000, 50, 70, 40)
    lvl = sel.SelectiveLevel((aten.mm.default,), 300, 0.5)
    t = sel.selective_stage(s, lvl, 100)
    assert (t.input_bytes, t.saved_bytes) == (100, 400)  # the input and the saved outputs
    assert t.bwd_time == pytest.approx(3.0 + 1.5)  # the backward reruns the 1.5 s not spared
    assert t.bwd_tmp == (900 - 300) + max(70, 100 + 40 - 100)  # the recomputed rest of the tape


# ----------------------------------------------------------------------------- pricing the ops


class Mixed(nn.Module):
    """One of each kind of op that profile_ops must treat differently."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.a(x)            # addmm: its output is changed in place below
        h.relu_()                # in place: aliases its input
        g = F.gelu(h)            # a fresh output
        g = self.drop(g)         # random (on CPU: bernoulli_ into empty_like, then mul)
        v = g.view(-1, g.shape[-1])  # a view
        return self.b(v).view_as(x) + x  # addmm, then add: the block's output


def test_profile_ops_prices_each_op_and_names_why_some_are_never_saved():
    torch.manual_seed(0)
    block = Mixed().double()
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    costs = {c.op: c for c in sel.profile_ops(block, x, forward_time=1.0, repeats=2)}
    nbytes = 8  # float64
    assert costs[aten.addmm.default].calls == 2
    assert "in place" in costs[aten.addmm.default].never_saved  # the first one's output is relu_'d
    assert "aliases" in costs[aten.relu_.default].never_saved
    random_ops = [op for op in costs if torch.Tag.nondeterministic_seeded in op.tags]  # dropout's
    assert random_ops and all("random" in costs[op].never_saved for op in random_ops)
    assert "aliases" in costs[aten.view.default].never_saved
    assert costs[aten.gelu.default].never_saved == ""
    assert costs[aten.gelu.default].kept_bytes == 4 * 8 * 64 * nbytes
    assert costs[aten.add.Tensor].kept_bytes == 0  # the block's output exists anyway
    assert sum(c.time for c in costs.values()) == pytest.approx(1.0)  # scaled to the block's time
    lad = sel.ladder(list(costs.values()))
    assert lad[0].ops == () and lad[0].kept_bytes == 0
    saved = {op for lvl in lad for op in lvl.ops}
    assert aten.addmm.default not in saved and not saved & set(random_ops)
    for lo, hi in zip(lad, lad[1:]):  # each level saves one more type, keeping and sparing more
        assert hi.ops[:-1] == lo.ops and hi.kept_bytes >= lo.kept_bytes and hi.saved_time > lo.saved_time


# ----------------------------------------------------------------------------- apply's plans


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[object, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _counted_step(model, inp, loss_fn):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(5)
    with _Count() as c:
        loss_fn(model(inp)).backward()
    return c.calls


def _selective_handle(make, budgets):
    """(model with a selective plan applied, an untouched copy of it, input, loss_fn, handle)."""
    for budget in budgets:
        model, inp, loss_fn = make()
        plain = copy.deepcopy(model)
        h = ck.apply(model, budget, sample_input=inp, loss_fn=loss_fn)
        if h.selective:
            return model, plain, inp, loss_fn, h
        h.remove()
    raise AssertionError(f"no budget in {budgets} gave a selective plan")


@pytest.mark.parametrize("make", [gpt_case, resnet_case], ids=["gpt", "resnet"])
def test_selective_plan_runs_as_torch_selective_checkpointing(make):
    """A selective plan: gradients and buffers identical to the plain model, the measured peak
    within the budget and equal to torch's own selective checkpointing of the same blocks with
    the same op lists, the saved ops not recomputed and the others recomputed once."""
    ours_model, plain, inp, loss_fn, h2 = _selective_handle(make, (0.9, 0.8, 0.7, 0.5))
    full, ref_grads, ref_bufs = step(copy.deepcopy(plain), inp, loss_fn)
    peak, grads, bufs = step(ours_model, inp, loss_fn)
    assert peak <= h2.budget
    assert 0.85 * h2.predicted_peak <= peak <= 1.02 * h2.predicted_peak
    _same(ref_grads, grads)
    _same(ref_bufs, bufs)
    calls = _counted_step(ours_model, inp, loss_fn)
    h2.remove()

    theirs = copy.deepcopy(plain)
    for name in h2.checkpointed:
        mod = theirs.get_submodule(name)
        ops = [_op(n) for n in h2.selective.get(name, [])]
        ctx = (lambda o: (lambda: tuc.create_selective_checkpoint_contexts(o)))(ops) if ops else tuc.noop_context_fn
        mod.forward = (lambda f, c: lambda *a, **k: tuc.checkpoint(f, *a, use_reentrant=False, context_fn=c,
                                                                    **k))(mod.forward, ctx)
    t_peak, t_grads, _ = step(theirs, inp, loss_fn)
    _same(t_grads, grads)
    t_calls = _counted_step(theirs, inp, loss_fn)
    base = _counted_step(copy.deepcopy(plain), inp, loss_fn)
    # vramkit's recomputation context keeps BatchNorm statistics aside (a clone and a copy back
    # per statistic: detach, clone, copy_); every other op runs exactly as often as under torch's own SAC
    bn_ops = {aten.detach.default, aten.clone.default, aten.copy_.default}
    assert {op: n for op, n in calls.items() if op not in bn_ops} == \
        {op: n for op, n in t_calls.items() if op not in bn_ops}
    if make is gpt_case:
        assert peak == t_peak and calls == t_calls
    else:  # the statistics kept aside: a few hundred bytes
        assert abs(peak - t_peak) <= 4096
    assert sum(calls.values()) > sum(base.values())  # something was recomputed
    for name, saved in h2.selective.items():  # random ops are never saved
        assert saved and not any(torch.Tag.nondeterministic_seeded in _op(n).tags for n in saved), name
    # an op type that every checkpointed block saves is not recomputed at all
    if len(h2.selective) == len(h2.checkpointed):
        for op_name in set.intersection(*(set(v) for v in h2.selective.values())):
            assert calls.get(_op(op_name), 0) == base.get(_op(op_name), 0), op_name


def _op(name):
    """An OpOverload from its str(), e.g. "aten.mm.default"."""
    ns, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


def test_selective_false_checkpoints_whole_blocks_and_bad_values_are_refused():
    model, inp, loss_fn = gpt_case()
    with ck.apply(model, 0.5, sample_input=inp, loss_fn=loss_fn, selective=False) as h:
        assert h.checkpointed and h.selective == {} and h.whole_block_recompute_time is None
        assert h.to_dict()["selective"] == {}
    with pytest.raises(TypeError, match="selective must be True or False"):
        ck.apply(model, 0.5, sample_input=inp, loss_fn=loss_fn, selective="yes")
    assert all("forward" not in m.__dict__ for m in model.modules())  # state unchanged


def test_selective_plan_recomputes_less_than_the_whole_block_plan_it_beat():
    model, _, inp, loss_fn, h = _selective_handle(gpt_case, (0.9, 0.8, 0.7, 0.5))
    assert h.whole_block_recompute_time is not None
    assert h.recompute_time < h.whole_block_recompute_time
    assert h.predicted_peak <= h.budget
    assert "selectively" in repr(h)
    h.remove()
