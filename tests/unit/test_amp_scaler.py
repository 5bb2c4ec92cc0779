"""vramkit.amp.GradScaler and the functional update/clip API, against independent references.

References: torch.amp.GradScaler("cpu") and torch._amp_update_scale_ (PyTorch's own CPU
kernels) where torch is installed; otherwise NumPy arithmetic and `RuleModel`, a pure-Python
model of the loss-scale rule written from the comment on vram_scale_policy_t in vramkit.h and
from NVIDIA Apex's update_scale_hysteresis (reference/amp.md §3.1). Nothing here compares with
values produced by running the code under test.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
import warnings

import numpy as np
import pytest
from amp_references import (  # tests/unit/amp_references.py
    EMPTY_SD_MSG, FIX, FLT_MAX, PICKLE_MSG, RuleModel, f32_bits, overflow_pattern,
)
from vramkit import amp
from vramkit.amp import loss_scaling as amp_impl  # its private helpers


@pytest.fixture
def torch(one_torch_thread):  # tests/conftest.py: tiny tensors, thread hand-offs would cost more than the work
    return pytest.importorskip("torch")


# ---- functional update_scale_ -------------------------------------------------------------------

def random_scale(rng) -> np.float32:
    kind = rng.integers(0, 6)
    if kind == 0:  # any positive finite float, subnormals included
        return np.uint32(rng.integers(1, 0x7F800000)).view(np.float32)
    if kind == 1:  # near the top of the float32 range: growth must never make inf
        return np.float32(FLT_MAX) / np.float32(2.0 ** float(rng.uniform(0, 3)))
    if kind == 2:  # tiny
        return np.uint32(rng.integers(1, 0x00900000)).view(np.float32)
    if kind == 3:
        return np.float32(rng.choice([0.0, 1.0, 2.0 ** 16, 2.0 ** 127, FLT_MAX, np.inf, np.nan, 1e-45]))
    return np.float32(2.0 ** float(rng.uniform(-30, 60)))


def test_update_scale_is_bit_exact_against_torch(torch):
    rng = np.random.default_rng(1234)
    grown_to_top = backed_off = 0
    for _ in range(4000):
        scale = random_scale(rng)
        interval = int(rng.integers(1, 12))
        tracker = int(rng.integers(0, interval))
        found = float(rng.choice([0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.5, np.nan, np.inf]))
        growth = float(rng.choice([2.0, 1.0 + 2.0 ** -23, 1.0 + 2.0 ** -22, rng.uniform(1.0, 4.0), 65536.0]))
        backoff = float(rng.choice([0.5, rng.uniform(0.0, 1.0), 1e-30, 0.999999]))

        t_scale = torch.tensor(scale, dtype=torch.float32)
        t_tracker = torch.tensor(tracker, dtype=torch.int32)
        t_found = torch.tensor(found, dtype=torch.float32)
        torch._amp_update_scale_(t_scale, t_tracker, t_found, growth, backoff, interval)

        v_scale = np.array(scale, dtype=np.float32)
        v_tracker = np.array(tracker, dtype=np.int32)
        v_found = np.array(found, dtype=np.float32)
        ret = amp.update_scale_(v_scale, v_tracker, v_found, growth, backoff, interval)
        assert ret is v_scale
        case = (float(scale), tracker, found, growth, backoff, interval)
        assert f32_bits(v_scale) == f32_bits(t_scale.numpy()), case
        assert int(v_tracker) == int(t_tracker), case
        assert float(v_found) == found or math.isnan(found)  # found_inf is only read
        if np.isfinite(scale) and scale > FLT_MAX / 4 and found == 0.0 and tracker + 1 == interval:
            grown_to_top += 1
            assert np.isfinite(v_scale)
        backed_off += found != 0.0
    assert grown_to_top > 20 and backed_off > 1000  # the interesting cases were drawn


def test_update_scale_on_torch_tensors_matches_torch(torch):
    rng = np.random.default_rng(5)
    ours = [torch.full((), 2.0 ** 16), torch.zeros((), dtype=torch.int32)]
    ref = [t.clone() for t in ours]
    for found in overflow_pattern(rng, 500, p_start=0.2):
        f = torch.full((), float(found))
        assert amp.update_scale_(ours[0], ours[1], f.clone(), 2.0, 0.5, 3) is ours[0]
        torch._amp_update_scale_(ref[0], ref[1], f.clone(), 2.0, 0.5, 3)
        assert ours[0].item() == ref[0].item() and ours[1].item() == ref[1].item()


def test_update_scale_near_float32_max_never_overflows():
    for scale in (FLT_MAX, np.float32(2.0 ** 127), np.nextafter(np.float32(2.0 ** 127), np.float32(0))):
        s, t = np.array(scale, np.float32), np.array(0, np.int32)
        amp.update_scale_(s, t, np.zeros((), np.float32), 2.0, 0.5, 1)
        assert np.isfinite(s) and int(t) == 0
        expected = np.float32(np.float64(scale) * 2.0) if np.float64(scale) * 2.0 <= FLT_MAX else scale
        assert f32_bits(s) == f32_bits(expected)


def test_update_scale_with_bounds_and_hysteresis_matches_model():
    rng = np.random.default_rng(77)
    for _ in range(3000):
        hysteresis = int(rng.integers(1, 5))
        interval = int(rng.integers(1, 6))
        lo = float(2.0 ** rng.integers(-10, 10)) if rng.random() < 0.7 else None
        hi = float((lo or 1.0) * 2.0 ** rng.integers(0, 20)) if rng.random() < 0.7 else None
        gf, bf = float(rng.uniform(1.01, 3.0)), float(rng.uniform(0.1, 0.99))
        lo_, hi_ = (lo or 0.0), (hi or FLT_MAX)
        scale = np.float32(lo_ + (min(hi_, 2.0 ** 40) - lo_) * rng.random())
        tracker, hyst = int(rng.integers(0, interval)), int(rng.integers(0, hysteresis + 1))
        found = bool(rng.random() < 0.5)
        model = RuleModel(scale, gf, bf, interval, hysteresis, lo, hi, tracker=tracker, hyst=hyst)
        model.update(found)
        s, t, h = np.array(scale, np.float32), np.array(tracker, np.int32), np.array(hyst, np.int32)
        amp.update_scale_(s, t, np.array(float(found), np.float32), gf, bf, interval, hysteresis_tracker=h,
                          hysteresis=hysteresis, min_scale=lo, max_scale=hi)
        case = (scale, tracker, hyst, found, gf, bf, interval, hysteresis, lo, hi)
        assert f32_bits(s) == f32_bits(model.scale), case
        assert (int(t), int(h)) == (model.tracker, model.hyst), case
        assert model.min <= s <= model.max, case


def test_tracker_above_a_lowered_interval_grows_on_the_next_clean_update():
    # vramkit.h: PyTorch's `== interval` never grows again; vramkit's `>=` does.
    s, t = np.array(8.0, np.float32), np.array(9, np.int32)
    amp.update_scale_(s, t, np.zeros((), np.float32), 2.0, 0.5, 4)
    assert float(s) == 16.0 and int(t) == 0


def test_update_scale_argument_checks():
    s, t, f = np.array(1.0, np.float32), np.array(0, np.int32), np.zeros((), np.float32)
    with pytest.raises(ValueError, match="hysteresis_tracker"):
        amp.update_scale_(s, t, f, 2.0, 0.5, 10, hysteresis=2)
    with pytest.raises(TypeError, match="growth_tracker"):
        amp.update_scale_(s, np.array(0, np.int64), f, 2.0, 0.5, 10)
    with pytest.raises(ValueError, match="growth_interval"):
        amp.update_scale_(s, t, f, 2.0, 0.5, 0)
    assert float(s) == 1.0 and int(t) == 0


def test_a_scale_beyond_a_bound_is_not_moved_further_out_nor_pulled_back():
    # As documented for vram_scale_policy_t: e.g. a torch checkpoint's scale loaded into a scaler
    # with tighter bounds stays put until the rule moves it towards the allowed range.
    clean, overflow = np.zeros((), np.float32), np.ones((), np.float32)
    s, t = np.array(1024.0, np.float32), np.array(0, np.int32)
    amp.update_scale_(s, t, clean, 2.0, 0.5, 1, max_scale=256.0)
    assert float(s) == 1024.0 and int(t) == 0  # growth would leave the range further: held
    amp.update_scale_(s, t, overflow, 2.0, 0.5, 1, max_scale=256.0)
    assert float(s) == 512.0  # backoff moves it towards the range
    s = np.array(0.25, np.float32)
    amp.update_scale_(s, t, overflow, 2.0, 0.5, 1, min_scale=1.0)
    assert float(s) == 0.25  # below the floor: a backoff does not lower it further
    amp.update_scale_(s, t, clean, 2.0, 0.5, 1, min_scale=1.0)
    assert float(s) == 0.5  # growth moves it towards the range
    s = np.array(3.0, np.float32)
    amp.update_scale_(s, t, overflow, 2.0, 0.5, 1, min_scale=2.0)
    assert float(s) == 2.0  # inside the range, backoff stops at the floor


# ---- the NumPy API (no torch needed) ------------------------------------------------------------

def test_step_fn_runs_only_for_finite_grads():
    scaler = amp.GradScaler(init_scale=256.0, growth_interval=1000)
    grads = [np.zeros(10, np.float16), np.zeros((3, 4), np.float32)]
    calls = []

    def step_fn(k, tag):
        calls.append((k, tag))
        return f"ran{k}"

    for i, poison in enumerate([None, np.inf, None, np.nan, -np.inf, None]):
        loss = scaler.scale(np.full((), 0.5, np.float32))
        assert float(loss) == 0.5 * scaler.get_scale()
        grads[0][:] = np.float16(3.0 * scaler.get_scale())
        grads[1][:] = np.float32(-0.25 * scaler.get_scale())
        if poison is not None:
            grads[i % 2].flat[i] = poison
        if i % 2:  # positional and keyword arguments both reach step_fn
            out = scaler.step(grads, i, step_fn=step_fn, return_found_inf=True, tag="x")
        else:
            out = scaler.step(grads, k=i, tag="x", step_fn=step_fn, return_found_inf=True)
        expected_found = poison is not None
        assert out == ((None, True) if expected_found else (f"ran{i}", False))
        if not expected_found:
            np.testing.assert_array_equal(grads[0], np.float16(3.0))  # unscaled in place before step_fn ran
            np.testing.assert_array_equal(grads[1], np.float32(-0.25))
        scaler.update()
    assert calls == [(0, "x"), (2, "x"), (5, "x")]
    assert scaler.get_scale() == 256.0 * 0.5 ** 3
    scaler.scale(np.ones(1, np.float32))
    with pytest.raises(TypeError, match="step_fn"):
        scaler.step(grads)


def test_scale_keeps_numpy_dtypes_and_rounds_like_float32_math():
    for init in (2.0 ** 16, 3.0, 2.0 ** -8):
        scaler = amp.GradScaler(init_scale=init)
        for dtype in (np.float16, np.float32, np.float64):
            x = np.array([0.5, -1.25, 3e-5, 7.0, 65504.0], dtype=dtype)
            out = scaler.scale(x)
            assert isinstance(out, np.ndarray) and out.dtype == dtype
            with np.errstate(over="ignore"):
                ref = (x.astype(np.float32) * np.float32(init)).astype(dtype) if dtype == np.float16 \
                    else x * dtype(np.float32(init))
            np.testing.assert_array_equal(out, ref)
            with np.errstate(over="ignore"):
                expected = float(dtype(np.float32(0.75) * np.float32(init)))
            zero_d = scaler.scale(np.array(0.75, dtype=dtype))
            assert zero_d.dtype == dtype and float(zero_d) == expected
            scalar = scaler.scale(dtype(0.75))  # a NumPy loss such as x.mean() is a NumPy scalar
            assert scalar.dtype == dtype and float(scalar) == expected
    assert amp.GradScaler(init_scale=8.0).scale(1.5) == 12.0


def test_bf16_warning_is_emitted_once():
    try:
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)

        def make(shape):
            return np.ones(shape, dtype=bf16)
    except ImportError:
        torch = pytest.importorskip("torch", reason="needs ml_dtypes or torch for a bfloat16 array")

        def make(shape):
            return torch.ones(shape, dtype=torch.bfloat16)

    scaler = amp.GradScaler(init_scale=4.0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loss = scaler.scale(make(()))
        grads = [make(8) * 4, make(3) * 4]
        scaler.step(grads, step_fn=lambda: None)
        scaler.update()
        scaler.scale(make(()))
    bf16_warnings = [x for x in w if "bfloat16" in str(x.message)]
    assert len(bf16_warnings) == 1 and issubclass(bf16_warnings[0].category, UserWarning)
    assert float(loss) == 4.0 and all(float(v) == 1.0 for g in grads for v in g.reshape(-1))

    other = amp.GradScaler()  # a scaler that first sees bf16 in unscale_ warns there, once
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        other.scale(np.ones((), np.float32))
        g = [make(4)]
        other.unscale_(g)
        other.step(g, step_fn=lambda: None)
    assert len([x for x in w if "bfloat16" in str(x.message)]) == 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = amp.GradScaler()
        s.scale(np.ones(3, np.float16))
        s.step([np.ones(3, np.float16)], step_fn=lambda: None)
    assert not w


def test_disabled_scaler_passes_everything_through():
    scaler = amp.GradScaler(enabled=False, growth_factor=0.1)  # no validation when disabled, as in PyTorch
    x = np.array([1.0, 2.0], np.float16)
    assert scaler.scale(x) is x and not scaler.is_enabled()
    grads = [np.array([np.inf, 2.0], np.float32)]
    scaler.unscale_(grads)
    assert grads[0][1] == 2.0
    assert scaler.step(grads, step_fn=lambda: "stepped", return_found_inf=True) == ("stepped", False)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and scaler._get_growth_tracker() == 0
    scaler.load_state_dict({})  # a no-op, not an error
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 1.0 and not clone.is_enabled()
    grads = [np.array([3.0, 0.0], np.float32), np.array([[4.0]], np.float32)]
    norm = scaler.unscale_and_clip_(grads, 1.0)  # disabled: clip_grad_norm_ alone, nothing unscaled
    assert norm == 5.0
    coef = np.float32(1.0) / (np.float32(5.0) + np.float32(1e-6))
    np.testing.assert_allclose(np.concatenate([g.ravel() for g in grads]), [3 * coef, 0.0, 4 * coef], rtol=1e-6)


def test_load_empty_state_dict_raises_pytorchs_message():
    with pytest.raises(RuntimeError) as e:
        amp.GradScaler().load_state_dict({})
    assert str(e.value) == EMPTY_SD_MSG


def test_numpy_state_machine_messages():
    scaler = amp.GradScaler()
    grads = [np.ones(4, np.float32)]
    with pytest.raises(AssertionError) as e:
        scaler.unscale_(grads)
    assert str(e.value) == f"Attempted unscale_ but _scale is None.  {FIX}"
    scaler.scale(np.ones(()))
    scaler.unscale_(grads)
    with pytest.raises(RuntimeError) as e:
        scaler.unscale_(list(grads))  # a rebuilt list of the same arrays is the same "optimizer"
    assert str(e.value) == "unscale_() has already been called on this optimizer since the last update()."
    scaler.step(grads, step_fn=lambda: None)
    with pytest.raises(RuntimeError) as e:
        scaler.step(grads, step_fn=lambda: None)
    assert str(e.value) == "step() has already been called since the last update()."
    with pytest.raises(RuntimeError) as e:
        scaler.step(grads, step_fn=lambda: None, closure=lambda: 0)
    assert str(e.value) == "Closure use is not currently supported if GradScaler is enabled."
    scaler.update()
    with pytest.raises(AssertionError) as e:
        scaler.update()
    assert str(e.value) == "No inf checks were recorded prior to update."


def test_pickling_after_update_and_not_mid_iteration():
    scaler = amp.GradScaler(init_scale=2.0 ** 10, growth_interval=3, hysteresis=3, min_scale=2.0)
    grads = [np.ones(6, np.float16)]
    pattern = [False, True, False, True, True]

    def iteration(s, overflow):
        s.scale(np.ones((), np.float32))
        grads[0][:] = np.inf if overflow else 1.0
        s.step(grads, step_fn=lambda: None)
        s.update()

    for flag in pattern:
        iteration(scaler, flag)
    sd = scaler.state_dict()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == sd
    model = RuleModel(2.0 ** 10, 2.0, 0.5, 3, 3, 2.0)
    for flag in pattern:
        model.update(flag)
    assert (sd["scale"], sd["_growth_tracker"], sd["_hysteresis_tracker"]) == (model.scale, model.tracker,
                                                                               model.hyst)
    for flag in [True, False, False, False, True, True, True]:
        iteration(scaler, flag)
        iteration(clone, flag)
        assert scaler.state_dict() == clone.state_dict()

    scaler.scale(np.ones((), np.float32))
    scaler.unscale_(grads)
    with pytest.raises(AssertionError) as e:
        pickle.dumps(scaler)
    assert str(e.value) == PICKLE_MSG
    scaler.step(grads, step_fn=lambda: None)
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.update()
    pickle.dumps(scaler)
    assert pickle.loads(pickle.dumps(amp.GradScaler(init_scale=5.0))).get_scale() == 5.0


def test_state_dict_round_trip_keeps_the_extensions():
    kwargs = {"init_scale": 2.0 ** 8, "growth_interval": 4, "hysteresis": 3, "min_scale": 1.0, "max_scale": 2.0 ** 10}
    a = amp.GradScaler(**kwargs)
    grads = [np.ones(5, np.float32)]

    def iteration(s, overflow):
        s.scale(np.ones((), np.float32))
        grads[0][:] = np.nan if overflow else 1.0
        s.step(grads, step_fn=lambda: None)
        s.update()

    for flag in [True, True, False, False, True]:  # trackers now: growth 0, hysteresis 2
        iteration(a, flag)
    sd = a.state_dict()
    assert (sd["_growth_tracker"], sd["_hysteresis_tracker"]) == (0, 2)
    assert (sd["min_scale"], sd["max_scale"], sd["hysteresis"]) == (1.0, 2.0 ** 10, 3)
    fresh, live = amp.GradScaler(), amp.GradScaler()
    iteration(live, False)
    for b in (fresh, live):
        b.load_state_dict(sd)
        assert b.state_dict() == sd
    for flag in [True, False, True, True, False, False, False, False, False, False, False]:
        for s in (a, fresh, live):
            iteration(s, flag)
        assert a.state_dict() == fresh.state_dict() == live.state_dict()


@pytest.mark.parametrize("seed", range(4))
def test_min_max_hysteresis_against_model_5000_steps(seed):
    rng = np.random.default_rng(seed)
    hysteresis = [1, 2, 3, 5][seed]
    lo = [None, 1.0, 4.0, 0.5][seed]
    hi = [2.0 ** 20, None, 2.0 ** 12, 2.0 ** 9][seed]
    gf, bf = [(2.0, 0.5), (1.5, 0.7), (3.0, 0.25), (2.0, 0.5)][seed]
    interval = int(rng.integers(2, 9))
    init = float(np.clip(2.0 ** 10, lo or 0.0, hi or np.inf))
    scaler = amp.GradScaler(init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval,
                            hysteresis=hysteresis, min_scale=lo, max_scale=hi)
    model = RuleModel(init, gf, bf, interval, hysteresis, lo, hi)
    grads = [np.empty(7, np.float16), np.empty(130, np.float32)]
    pattern = overflow_pattern(rng, 5000, p_start=0.15 if lo is not None else 0.03, p_continue=0.7)
    at_floor = at_ceiling = held = 0
    for i, overflow in enumerate(pattern):
        if rng.random() < 0.01:  # intervals change mid-run; the tracker may then be above the new one
            interval = int(rng.integers(1, 9))
            scaler.set_growth_interval(interval)
            model.interval = interval
        scaler.scale(np.ones((), np.float32))
        s = scaler.get_scale()
        grads[0][:] = 0.0  # an fp16 gradient that cannot overflow when unscaled, even for a tiny scale
        grads[1][:] = np.float32(s)
        if overflow:
            grads[i % 2].flat[int(rng.integers(0, grads[i % 2].size))] = [np.inf, np.nan][i % 3 == 0]
        _, found = scaler.step(grads, step_fn=lambda: None, return_found_inf=True)
        assert found == overflow, i
        scaler.update()
        hyst_before = model.hyst
        model.update(overflow)
        sd = scaler.state_dict()
        assert f32_bits(sd["scale"]) == f32_bits(model.scale), i
        assert (sd["_growth_tracker"], sd["_hysteresis_tracker"]) == (model.tracker, model.hyst), i
        at_floor += lo is not None and model.scale == np.float32(lo)
        at_ceiling += hi is not None and model.scale == np.float32(hi)
        held += overflow and hyst_before > 1
    if lo is not None:
        assert at_floor > 0
    if hi is not None:
        assert at_ceiling > 0
    if hysteresis > 1:
        assert held > 100


@pytest.mark.parametrize("kwargs, field", [
    ({"growth_factor": 1.0}, "growth factor"), ({"growth_factor": 0.5}, "growth factor"),
    ({"growth_factor": float("nan")}, "growth factor"), ({"backoff_factor": 1.0}, "backoff factor"),
    ({"backoff_factor": 2.0}, "backoff factor"), ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"), ({"growth_interval": -5}, "growth_interval"),
    ({"hysteresis": 0}, "hysteresis"), ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale"),
    ({"min_scale": -1.0}, "min_scale"), ({"max_scale": 0.0}, "max_scale"),
])
def test_invalid_arguments_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        amp.GradScaler(**kwargs)


def test_setters_validate_and_keep_the_old_value():
    scaler = amp.GradScaler(growth_interval=13)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_interval() == 13
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(0.0)
    assert scaler.get_backoff_factor() == 0.5
    scaler.set_growth_interval(2)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    assert (scaler.get_growth_interval(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (2, 4.0, 0.125)
    grads = [np.ones(3, np.float32)]
    for overflow, expected in [(False, 2.0 ** 16), (False, 2.0 ** 18), (True, 2.0 ** 15)]:
        scaler.scale(np.ones((), np.float32))
        grads[0][0] = np.inf if overflow else 1.0
        scaler.step(grads, step_fn=lambda: None)
        scaler.update()
        assert scaler.get_scale() == expected


def test_update_with_new_scale():
    scaler = amp.GradScaler()
    scaler.scale(np.ones((), np.float32))
    scaler.update(123.0)
    assert scaler.get_scale() == 123.0
    assert float(scaler.scale(np.ones((), np.float32))) == 123.0
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(np.ones(2, np.float32))


# ---- devices ----------------------------------------------------------------------------------

class FakeCudaArray:
    """Describes (never touches) 4 float32s of device memory."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (4,), "typestr": "<f4", "data": (0x10000, False), "version": 3}


no_gpu_scalars = pytest.mark.skipif(amp_impl._cuda_usable() or importlib.util.find_spec("cupy") is not None,
                                    reason="CUDA (or CuPy) is usable here")


@no_gpu_scalars
def test_cuda_scaler_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling."):
        scaler = amp.GradScaler("cuda")
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@no_gpu_scalars
def test_cuda_memory_without_torch_cuda_or_cupy_gives_a_clear_error():
    try:  # a CPU-only torch must not send the search for a scalar namespace round in circles
        import torch  # noqa: F401
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="needs torch or CuPy"):
        amp.GradScaler().scale(FakeCudaArray())
