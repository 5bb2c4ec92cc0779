"""vramkit.amp.GradScaler against torch.amp.GradScaler("cpu") and torch's own CPU kernels: the
scale for every dtype, a 10,000-step trajectory, state_dict interop both ways, the state
machine's messages, and unscale_and_clip_ against unscale_ + clip_grad_norm_. The rest of the
GradScaler tests (NumPy, the functional API, devices) are in test_amp_scaler.py."""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import numpy as np
import pytest
from amp_references import (  # tests/unit/amp_references.py
    EMPTY_SD_MSG, FIX, PICKLE_MSG, RuleModel, f32_bits, overflow_pattern,
)
from vramkit import amp


@pytest.fixture
def torch(one_torch_thread):  # tests/conftest.py: tiny tensors, thread hand-offs would cost more than the work
    return pytest.importorskip("torch")


# ---- GradScaler vs torch.amp.GradScaler ----------------------------------------------------------

def _toy_model(torch, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    return model


def test_scale_matches_torch_for_every_dtype(torch):
    for init in (2.0 ** 16, 3.0, 2.0 ** -20, 1.7e38):
        ours, ref = amp.GradScaler("cpu", init_scale=init), torch.amp.GradScaler("cpu", init_scale=init)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            x = (torch.randn(50, dtype=torch.float64) * 3).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a, b = ours.scale(x), ref.scale(x)
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        nested = ours.scale([x.float(), (x.float(), [x.float()])])
        assert isinstance(nested, list) and isinstance(nested[1], tuple) and isinstance(nested[1][1], list)
        assert torch.equal(nested[1][1][0], ref.scale(x.float()))
        for obj in (object(), 3 + 4j):
            assert _error_of(ours.scale, obj) == _error_of(ref.scale, obj) == \
                (ValueError, "outputs must be a Tensor or an iterable of Tensors")


class PlainSGD:
    """What both scalers need of an optimizer (param_groups and step()), without torch.optim's
    per-call bookkeeping, which would dominate a 10,000-step run of tiny tensors."""

    def __init__(self, torch, params, lr):
        self.torch, self.param_groups, self.lr = torch, [{"params": params}], lr

    def step(self):
        with self.torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.add_(p.grad, alpha=-self.lr)
        return "stepped"


def test_ten_thousand_step_trajectory_matches_torch(torch):
    """Identical parameters and optimizers, one driven by each scaler; the scaled "loss
    gradients" come from scale() and overflows are injected in random bursts (and happen
    naturally once the scale nears the top of the float32 range)."""
    rng = np.random.default_rng(2024)
    n = 10_000
    pool = [[torch.randn(8) * 2, torch.randn(4, 3) * 2] for _ in range(64)]
    sides = []
    for cls in (amp.GradScaler, torch.amp.GradScaler):
        params = [torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(4, 3))]
        opt = PlainSGD(torch, params, lr=1e-3)
        sides.append((params, opt, cls("cpu", init_scale=2.0 ** 64, growth_interval=7)))
    (params_a, opt_a, ours), (params_b, opt_b, ref) = sides
    inject = overflow_pattern(rng, n, p_start=0.05, p_continue=0.5)
    which = rng.integers(0, 64, n)
    poison = [float(v) for v in rng.choice([np.inf, -np.inf, np.nan], n)]
    skipped = grown = natural = 0
    top = 0.0
    for i in range(n):
        for params, _, scaler in sides:
            scaled = scaler.scale(pool[which[i]])
            for p, g in zip(params, scaled):
                p.grad = g
            if inject[i]:
                params[i % 2].grad.view(-1)[i % 8] = poison[i]
        # NumPy views for the checks: torch's per-call overhead would dominate on 12 elements
        finite = all(np.isfinite(p.grad.numpy()).all() for p in params_b)
        natural += not inject[i] and not finite
        before = [p.detach().numpy().copy() for p in params_b]
        ret, found = ours.step(opt_a, return_found_inf=True)
        ref_ret = ref.step(opt_b)
        torch_skipped = all(np.array_equal(p0, p.detach().numpy()) for p0, p in zip(before, params_b))
        assert found == torch_skipped == (not finite) == (ret is None) == (ref_ret is None), i
        prev = ours.get_scale()
        ours.update()
        ref.update()
        assert f32_bits(ours.get_scale()) == f32_bits(ref.get_scale()), i
        assert ours._get_growth_tracker() == ref._get_growth_tracker(), i
        assert all(np.array_equal(p.detach().numpy(), q.detach().numpy()) for p, q in zip(params_a, params_b)), i
        skipped += found
        grown += ours.get_scale() > prev
        top = max(top, ours.get_scale())
    # both directions were exercised often, and the scale reached the top of the float32 range
    # (where scaled gradients overflow by themselves) without ever becoming inf
    assert skipped > 500 and grown > 500 and natural > 20, (skipped, grown, natural)
    assert 2.0 ** 126 <= top < math.inf, top


def _drive(torch, scaler, model, opt, x, y, overflow):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if overflow:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("live", [False, True], ids=["fresh", "initialised"])
def test_state_dict_interop_both_ways(torch, live):
    rng = np.random.default_rng(9)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def pair():
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    for src_cls, dst_cls in ((torch.amp.GradScaler, amp.GradScaler), (amp.GradScaler, torch.amp.GradScaler)):
        src = src_cls("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
        m, o = pair()
        for flag in [False, False, True, False, False, False]:
            _drive(torch, src, m, o, x, y, flag)
        sd = src.state_dict()
        assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(sd)
        assert sd["_growth_tracker"] == 3 and sd["scale"] == 1024.0 * 0.25
        dst = dst_cls("cpu")
        m2, o2 = pair()
        if live:
            _drive(torch, dst, m2, o2, x, y, False)
        dst.load_state_dict(sd)
        assert dst.get_scale() == sd["scale"] and dst._get_growth_tracker() == 3
        for flag in overflow_pattern(rng, 40, p_start=0.2):
            _drive(torch, src, m, o, x, y, flag)
            _drive(torch, dst, m2, o2, x, y, flag)
            assert f32_bits(src.get_scale()) == f32_bits(dst.get_scale())
            assert src._get_growth_tracker() == dst._get_growth_tracker()
            assert (src.get_growth_factor(), src.get_backoff_factor(), src.get_growth_interval()) == \
                (dst.get_growth_factor(), dst.get_backoff_factor(), dst.get_growth_interval())


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


def _misuse_scenarios(torch):
    def setup(scaler):
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt

    def backward(scaler, model):
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()

    def unscale_twice(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    def unscale_after_step(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.step(opt)
        scaler.unscale_(opt)

    def step_twice(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.step(opt)
        scaler.step(opt)

    def update_without_checks(scaler):
        model, _ = setup(scaler)
        backward(scaler, model)
        scaler.update()

    def unscale_before_scale(scaler):
        scaler.unscale_(setup(scaler)[1])

    def step_before_scale(scaler):
        scaler.step(setup(scaler)[1])

    def update_before_scale(scaler):
        scaler.update()

    def closure(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.step(opt, closure=lambda: 0.0)

    def pickle_mid_iteration(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.unscale_(opt)
        pickle.dumps(scaler)

    def pickle_after_step(scaler):
        model, opt = setup(scaler)
        backward(scaler, model)
        scaler.step(opt)
        pickle.dumps(scaler)

    def load_empty(scaler):
        scaler.load_state_dict({})

    return {
        "unscale_twice": (unscale_twice, RuntimeError,
                          "unscale_() has already been called on this optimizer since the last update()."),
        "unscale_after_step": (unscale_after_step, RuntimeError, "unscale_() is being called after step()."),
        "step_twice": (step_twice, RuntimeError, "step() has already been called since the last update()."),
        "update_without_checks": (update_without_checks, AssertionError,
                                  "No inf checks were recorded prior to update."),
        "unscale_before_scale": (unscale_before_scale, AssertionError,
                                 f"Attempted unscale_ but _scale is None.  {FIX}"),
        "step_before_scale": (step_before_scale, AssertionError, f"Attempted step but _scale is None.  {FIX}"),
        "update_before_scale": (update_before_scale, AssertionError, f"Attempted update but _scale is None.  {FIX}"),
        "closure": (closure, RuntimeError, "Closure use is not currently supported if GradScaler is enabled."),
        "pickle_mid_iteration": (pickle_mid_iteration, AssertionError, PICKLE_MSG),
        "pickle_after_step": (pickle_after_step, AssertionError, PICKLE_MSG),
        "load_empty": (load_empty, RuntimeError, EMPTY_SD_MSG),
    }


SCENARIOS = ["unscale_twice", "unscale_after_step", "step_twice", "update_without_checks", "unscale_before_scale",
             "step_before_scale", "update_before_scale", "closure", "pickle_mid_iteration", "pickle_after_step",
             "load_empty"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_state_machine_errors_are_pytorchs_verbatim(torch, name):
    fn, exc_type, message = _misuse_scenarios(torch)[name]
    ours = _error_of(fn, amp.GradScaler("cpu"))
    theirs = _error_of(fn, torch.amp.GradScaler("cpu"))
    assert ours == (exc_type, message)
    assert theirs == ours


def test_one_update_after_two_optimizers_steps(torch):
    torch.manual_seed(3)
    x = torch.randn(5, 4)
    models = [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]
    twins = copy.deepcopy(models)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    twin_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in twins]
    ours, ref = amp.GradScaler("cpu", growth_interval=2), torch.amp.GradScaler("cpu", growth_interval=2)
    for it, bad in enumerate([None, 0, None, None, 1, None, None, None]):
        found = []
        for scaler, ms, os_ in ((ours, models, opts), (ref, twins, twin_opts)):
            for o in os_:
                o.zero_grad()
            loss = ms[0](x).pow(2).mean() + ms[1](x).pow(2).mean()
            scaler.scale(loss).backward()
            if bad is not None:
                ms[bad].weight.grad[0, 0] = float("nan")
            scaler.unscale_(os_[0])  # explicit for one optimizer, implicit in step() for the other
            for o in os_:
                r = scaler.step(o, return_found_inf=True) if scaler is ours else scaler.step(o)
                if scaler is ours:
                    found.append(r[1])
            scaler.update()
        assert found == [bad == 0, bad == 1], it
        assert ours.get_scale() == ref.get_scale() and ours._get_growth_tracker() == ref._get_growth_tracker()
        for m, t in zip(models, twins):
            assert all(torch.equal(p, q) for p, q in zip(m.parameters(), t.parameters()))
    model = RuleModel(2.0 ** 16, growth_interval=2)
    for bad in [None, 0, None, None, 1, None, None, None]:
        model.update(bad is not None)
    assert ours.get_scale() == model.scale


# ---- unscale_and_clip_ ------------------------------------------------------------------------

def _clip_setup(torch, shapes, scale, seed):
    torch.manual_seed(seed)
    grads = [torch.randn(*s) * 0.1 for s in shapes]
    params_a = [torch.nn.Parameter(torch.zeros(*s)) for s in shapes]
    params_b = [torch.nn.Parameter(torch.zeros(*s)) for s in shapes]
    for pa, pb, g in zip(params_a, params_b, grads):
        pa.grad = g * scale
        pb.grad = g * scale
    opt_a = torch.optim.SGD(params_a, lr=1.0)
    opt_b = torch.optim.SGD(params_b, lr=1.0)
    ours = amp.GradScaler("cpu", init_scale=scale)
    ref = torch.amp.GradScaler("cpu", init_scale=scale)
    ours.scale(torch.ones(()))
    ref.scale(torch.ones(()))
    return params_a, params_b, opt_a, opt_b, ours, ref, grads


SHAPES = [(300, 70), (1000,), (5,), (3, 3, 3), (40_000,)]


@pytest.mark.parametrize("scale, ratio", [(2.0 ** 16, 1 / 3), (3.0, 0.9), (2.0 ** -3, 0.999), (2.0 ** 7, 1e-4)])
def test_unscale_and_clip_matches_unscale_plus_clip_grad_norm(torch, scale, ratio):
    params_a, params_b, opt_a, opt_b, ours, ref, grads = _clip_setup(torch, SHAPES, scale, 0)
    exact = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    max_norm = exact * ratio
    norm = ours.unscale_and_clip_(opt_a, max_norm)
    ref.unscale_(opt_b)
    t_norm = torch.nn.utils.clip_grad_norm_(params_b, max_norm)
    assert isinstance(norm, float)
    assert norm == pytest.approx(float(t_norm), rel=1e-6)
    assert norm == pytest.approx(exact, rel=1e-6)
    clipped_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params_a))
    assert clipped_norm == pytest.approx(max_norm, rel=1e-5)
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=0)
    _, found = ours.step(opt_a, return_found_inf=True)
    ref.step(opt_b)
    assert not found
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=0)
        assert not torch.equal(pa, torch.zeros_like(pa))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\."):
        ours.unscale_and_clip_(opt_a, 1.0)


def test_unscale_and_clip_below_max_norm_only_unscales(torch):
    params_a, params_b, opt_a, opt_b, ours, ref, grads = _clip_setup(torch, SHAPES, 2.0 ** 10, 1)
    exact = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    norm = ours.unscale_and_clip_(opt_a, exact * 1.5)
    ref.unscale_(opt_b)
    assert norm == pytest.approx(exact, rel=1e-6)
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa.grad, pb.grad)  # unscaled bit for bit as torch does, not multiplied again


def test_unscale_and_clip_with_inf_clips_nothing_and_skips_the_step(torch):
    params_a, params_b, opt_a, opt_b, ours, ref, _ = _clip_setup(torch, SHAPES, 2.0 ** 10, 2)
    params_a[1].grad[17] = float("inf")
    params_b[1].grad[17] = float("inf")
    norm = ours.unscale_and_clip_(opt_a, 1e-3)
    ref.unscale_(opt_b)  # unscale only: the reference for "nothing was clipped"
    assert math.isinf(norm) or math.isnan(norm)
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa.grad, pb.grad)
    _, found = ours.step(opt_a, return_found_inf=True)
    assert found and all(torch.equal(p, torch.zeros_like(p)) for p in params_a)
    ours.update()
    assert ours.get_scale() == 2.0 ** 9


def test_unscale_and_clip_on_numpy_fp16_grads_against_numpy():
    rng = np.random.default_rng(4)
    scale = 2.0 ** 12
    grads = [(rng.standard_normal(n) * 0.05 * scale).astype(np.float16) for n in (5000, 33, 1)]
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
    unscaled = [(g.astype(np.float32) * inv).astype(np.float16) for g in grads]
    exact = math.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in unscaled))
    max_norm = exact / 4
    coef = np.float32(max_norm) / (np.float32(exact) + np.float32(1e-6))
    expected = [(u.astype(np.float32) * coef).astype(np.float16) for u in unscaled]
    scaler = amp.GradScaler(init_scale=scale)
    scaler.scale(np.ones((), np.float32))
    norm = scaler.unscale_and_clip_(grads, max_norm)
    assert norm == pytest.approx(exact, rel=1e-6)
    for g, e in zip(grads, expected):
        assert g.dtype == np.float16
        # within about one fp16 ulp (the coefficient may differ in its last float32 bit)
        np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32), rtol=2e-3, atol=6.1e-8)
    with pytest.raises(ValueError, match="max_norm"):
        amp.GradScaler().unscale_and_clip_(grads, 0.0)
