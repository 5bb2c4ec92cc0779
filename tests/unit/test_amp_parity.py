"""vramkit.amp.GradScaler against torch.amp.GradScaler("cpu"), case by case.

Each test runs the same training-step code with both scalers on identical copies of a model
and compares gradients, scales, growth trackers and skipped steps exactly (torch is the
reference; nothing is compared against output of vramkit itself). Covered: sparse COO
gradients (coalesced or not, fp32 and fp16 with torch's coalesce-before-check rule), strided
gradients that are not dense (torch tensors and NumPy arrays, bit for bit), gradients on
several devices in one optimizer (grouping and found_inf per device), clipping after
unscale_, several optimizers and losses, gradient accumulation, gradient penalties, the
state dict, and misuse that torch refuses.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vramkit import amp  # noqa: E402
from vramkit.amp import state as _amp_state  # noqa: E402
from vramkit.amp import arrays as _arrays  # noqa: E402


def scalers(**kw):
    return [("torch", torch.amp.GradScaler("cpu", **kw)), ("vramkit", amp.GradScaler("cpu", **kw))]


def inf_val(dtype=torch.float32):
    return torch.tensor(float("inf"), dtype=dtype)


# ---- sparse COO gradients --------------------------------------------------------------------

def sparse_grad(dtype, coalesced, values):
    idx = torch.tensor([[0, 1, 1] if not coalesced else [0, 1, 2], [2, 0, 0] if not coalesced else [2, 0, 1]])
    g = torch.sparse_coo_tensor(idx, torch.tensor(values, dtype=dtype), (3, 3))
    return g.coalesce() if coalesced else g


@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("values,expect_inf", [([4.0, 16.0, -2.0], False), ([4.0, float("inf"), 1.0], True),
                                               ([1.0, float("nan"), 1.0], True)])
def test_sparse_fp32_unscale_matches_torch(coalesced, values, expect_inf):
    results = []
    for name, scaler in scalers(init_scale=4.0):
        p = torch.nn.Parameter(torch.zeros(3, 3))
        p.grad = sparse_grad(torch.float32, coalesced, values)
        opt = torch.optim.SGD([p], lr=1.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) if name == "torch" else \
            sum(float(v) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        results.append((p.grad.is_coalesced(), p.grad._indices().clone(), p.grad._values().clone(), found))
    (tc, ti, tv, tf), (vc, vi, vv, vf) = results
    assert (tc, vc) == (coalesced, coalesced)
    assert torch.equal(ti, vi)
    assert torch.equal(torch.isnan(tv), torch.isnan(vv))
    assert torch.equal(torch.nan_to_num(tv, nan=7.0), torch.nan_to_num(vv, nan=7.0))
    assert (tf != 0) == (vf != 0) == expect_inf
    if not expect_inf:  # and against float64 arithmetic: values / 4
        np.testing.assert_array_equal(vv.numpy(), np.array(values, dtype=np.float64) / 4.0)


def torch_fp16_sparse_reference(grad, inv):
    """torch's scaler on an fp16 sparse grad: its _unscale_grads_ with allow_fp16=True (the
    path fused optimizers take; unscale_ itself refuses fp16 gradients)."""
    scaler = torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float16))
    p.grad = grad
    opt = torch.optim.SGD([p], lr=1.0)
    found = torch.zeros(())
    per_device = scaler._unscale_grads_(opt, torch.full((), inv), found, True)
    return p.grad, sum(v.item() for v in per_device.values())


@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("values", [[1000.0, 40000.0, 40000.0],  # duplicates sum past fp16's 65504
                                    [1000.0, 3.0, 5.0], [1.0, float("inf"), 2.0]])
def test_sparse_fp16_coalesces_then_checks_like_torch(coalesced, values):
    ref_grad, ref_found = torch_fp16_sparse_reference(sparse_grad(torch.float16, coalesced, values), 0.5)
    scaler = amp.GradScaler("cpu", init_scale=2.0)
    p = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float16))
    original = sparse_grad(torch.float16, coalesced, values)
    p.grad = original
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    found = sum(float(v) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    assert p.grad.is_coalesced() and ref_grad.is_coalesced()  # rebound to the coalesced tensor, as torch does
    assert torch.equal(p.grad._indices(), ref_grad._indices())
    assert torch.equal(torch.nan_to_num(p.grad._values().float(), nan=7.0),
                       torch.nan_to_num(ref_grad._values().float(), nan=7.0))
    assert (found != 0) == (ref_found != 0)
    if values[1] == 40000.0 and not coalesced:
        assert found != 0  # the overflow only exists after coalescing


def test_sparse_fp16_uncoalesced_in_a_list_checks_the_coalesced_sum():
    g = sparse_grad(torch.float16, False, [1000.0, 40000.0, 40000.0])
    scaler = amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(np.ones((), np.float32))
    ran = []
    scaler.step([g], step_fn=lambda: ran.append(1))
    assert ran == []  # skipped: coalescing overflows fp16, as torch's check finds
    np.testing.assert_array_equal(g._values().float().numpy(), np.array([500.0, 20000.0, 20000.0]))


def test_sparse_embedding_training_matches_torch():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True), torch.nn.Linear(4, 1))
    idx = torch.randint(0, 20, (6, 5))
    run = {}
    for name, scaler in scalers(init_scale=2.0 ** 10, growth_interval=2):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = []
        for step in range(5):
            opt.zero_grad()
            loss = model(idx).pow(2).mean()
            if step == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            _, skipped = scaler.step(opt, return_found_inf=True) if name == "vramkit" else \
                (scaler.step(opt), sum(v.item() for v in scaler._found_inf_per_device(opt).values()) != 0)
            scaler.update()
            log.append((bool(skipped), scaler.get_scale()))
        run[name] = (log, [p.detach().clone() for p in model.parameters()])
    assert run["torch"][0] == run["vramkit"][0]
    for a, b in zip(run["torch"][1], run["vramkit"][1]):
        assert torch.equal(a, b)


# ---- strided gradients that are not dense -----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("view", ["cols", "rows_and_cols", "transposed_slice", "3d_neg"])
def test_strided_grad_unscales_in_place_bit_exact_with_torch(dtype, view):
    torch.manual_seed(1)
    big = (torch.randn(37, 70, 3) * 1e3).to(dtype)

    def make(t):
        if view == "cols":
            return t[:, ::2, 0]
        if view == "rows_and_cols":
            return t[1::3, 5:60:4, 1:]
        if view == "transposed_slice":
            return t[:, :33, 2].t()
        return t.flip(0)[::2, 1::5]  # flip makes a copy in torch; slice it again

    a_buf, b_buf = big.clone(), big.clone()
    a, b = make(a_buf), make(b_buf)
    assert not a.is_contiguous()
    inv = 1.0 / 1024.0 * 3.0  # not a power of two: rounding matters
    found_t = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([a], found_t, torch.full((), inv))
    assert amp.unscale_([b], inv) is False and found_t.item() == 0.0
    assert torch.equal(a_buf, b_buf)  # the view changed in place, and nothing around it


def test_strided_grad_in_a_model_matches_torch_scaler():
    results = []
    for name, scaler in scalers(init_scale=2.0 ** 8):
        torch.manual_seed(2)
        w = torch.nn.Parameter(torch.randn(8, 5))
        big = torch.randn(8, 10) * 300
        w.grad = big[:, ::2]  # strided, not dense
        opt = torch.optim.SGD([w], lr=0.01)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        results.append((w.detach().clone(), big.clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


def test_strided_inf_is_found_and_step_skipped():
    for name, scaler in scalers():
        w = torch.nn.Parameter(torch.zeros(4, 3))
        big = torch.ones(4, 6)
        big[3, 4] = float("nan")
        big[0, 1] = float("inf")  # outside the view: must not count
        w.grad = big[:, ::2]
        opt = torch.optim.SGD([w], lr=1.0)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 15, name
        assert torch.equal(w.detach(), torch.zeros(4, 3)), name


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_strided_arrays(dtype):
    rng = np.random.default_rng(3)
    buf = (rng.standard_normal((40, 66)) * 500).astype(dtype)
    keep = buf.copy()
    view = buf[::-2, 3::3]
    inv = np.float32(0.37)
    want = (view.astype(np.float64 if dtype == np.float64 else np.float32) * (np.float64(inv) if dtype == np.float64
                                                                            else inv)).astype(dtype)
    assert amp.unscale_([view], float(inv)) is False
    np.testing.assert_array_equal(view, want)
    mask = np.ones(buf.shape, bool)
    mask[::-2, 3::3] = False
    np.testing.assert_array_equal(buf[mask], keep[mask])


def test_strided_norm_and_clip_match_float64():
    big = torch.randn(50, 40, dtype=torch.float32) * 10
    g = big[::2, ::3]
    want = np.sqrt(((g.double().numpy() * 0.5) ** 2).sum())
    found, norm = amp.unscale_and_norm_([g], 0.5)
    assert not found and norm == pytest.approx(want, rel=1e-6)
    before = g.clone()
    amp.scale_([g], 0.25)
    assert torch.equal(g, before * 0.25)


def test_overlapping_strided_grad_is_refused():
    with pytest.raises(RuntimeError):  # torch refuses to write into a stride-0 view
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3).expand(4, 3)], torch.zeros(()),
                                                         torch.full((), 0.5))
    # torch does not detect the second (its overlap test gives up); vramkit refuses both
    for view in (torch.ones(3).expand(4, 3), torch.ones(5).as_strided((3, 3), (1, 1))):
        with pytest.raises(ValueError, match="overlap"):
            amp.unscale_([view], 0.5)


def test_dense_fast_path_unchanged_for_dense_refs():
    # Dense tensors, permuted or not, still go to the dense kernel (no shape/strides in the Ref).
    t = torch.randn(4, 5).t()
    ref = _arrays.describe(t, 0, [])
    assert ref.strides is None and ref.numel == 20
    ref = _arrays.describe(torch.randn(4, 6)[:, ::2], 0, [])
    assert ref.strides == (6, 2) and ref.shape == (4, 3)


# ---- several devices in one optimizer --------------------------------------------------------

class FakeDeviceScalars(_amp_state.HostScalars):
    """Host memory standing in for a second device, so the grouping is exercised honestly:
    the kernels really run, once per device group."""

    def __init__(self, device):
        self.device = device


def test_grads_on_two_devices_keep_found_inf_per_device(monkeypatch):
    real_describe = _arrays.describe
    second = set()

    def describe(obj, i, keep):
        r = real_describe(obj, i, keep)
        return r._replace(device="cuda:7") if r.ptr in second else r

    monkeypatch.setattr(_arrays, "describe", describe)
    # The C walk (torch_spans) sees the real device of each tensor: one here, so it would take
    # them all; the second device is faked in the general walk, which mixed devices go through.
    monkeypatch.setattr(_arrays, "torch_spans", lambda arrays: None)
    monkeypatch.setattr(_arrays, "torch_unscale_cpu", lambda arrays, inv, want: None)
    import vramkit.amp.loss_scaling as amp_mod  # where GradScaler looks these up
    real_scalars = amp_mod.scalars_for
    monkeypatch.setattr(amp_mod, "scalars_for",
                        lambda dev, fam: FakeDeviceScalars(dev) if dev == "cuda:7" else real_scalars(dev, fam))
    calls = []
    real_cpu = amp_mod._cpu_unscale
    monkeypatch.setattr(amp_mod, "_cpu_unscale", lambda refs, inv, n: calls.append([r.device for r in refs])
                        or real_cpu(refs, inv, n))

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.full((3,), 8.0), torch.tensor([8.0, float("inf"), 8.0])
    second.add(b.grad.data_ptr())
    opt = torch.optim.SGD([a, b], lr=1.0)
    scaler = amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    per_device = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert sorted(per_device) == ["cpu", "cuda:7"]
    assert float(per_device["cpu"]) == 0.0 and float(per_device["cuda:7"]) == 1.0
    assert sorted(calls) == [["cpu"], ["cuda:7"]]  # one kernel call per device group
    np.testing.assert_array_equal(a.grad.numpy(), [2.0, 2.0, 2.0])
    assert scaler.step(opt) is None and torch.equal(a.detach(), torch.zeros(3))  # skipped: inf on one device
    scaler.update()
    assert scaler.get_scale() == 2.0  # backed off once, not once per device


# ---- what torch's own GradScaler tests exercise, both scalers side by side ---------------------

def make_models(seed=0, n=2):
    torch.manual_seed(seed)
    base = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)) for _ in range(n)]
    data = [(torch.randn(5, 6), torch.randn(5, 2)) for _ in range(6)]
    return base, data


def params_equal(ma, mb):
    return all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


def run_both(body, **kw):
    """body(scaler, models, opts, data) -> log; returns both logs and models for comparison."""
    base, data = make_models()
    out = {}
    for name, scaler in scalers(**kw):
        models = [copy.deepcopy(m) for m in base]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        out[name] = (body(scaler, models, opts, data), models)
    (lt, mt), (lv, mv) = out["torch"], out["vramkit"]
    assert lt == lv
    for a, b in zip(mt, mv):
        assert params_equal(a, b)
    return lt


def test_basic_loop_with_skipped_steps_matches():
    def body(scaler, models, opts, data):
        log = []
        for i, (x, y) in enumerate(data):
            opts[0].zero_grad()
            loss = torch.nn.functional.mse_loss(models[0](x), y)
            if i in (1, 4):
                loss = loss + float("nan") * models[0][0].weight.sum()
            scaler.scale(loss).backward()
            scaler.step(opts[0])
            scaler.update()
            log.append((scaler.get_scale(), scaler._get_growth_tracker()))
        return log
    log = run_both(body, init_scale=2.0 ** 12, growth_interval=2)
    assert log[1][0] == 2.0 ** 11  # the nan step backed off


def test_clipping_after_unscale_matches():
    def body(scaler, models, opts, data):
        log = []
        for i, (x, y) in enumerate(data):
            opts[0].zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(models[0](x), y) * 50).backward()
            scaler.unscale_(opts[0])
            norm = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
            scaler.step(opts[0])
            scaler.update()
            log.append((float(norm), scaler.get_scale()))
        return log
    run_both(body, init_scale=2.0 ** 10, growth_interval=3)


def test_clipping_with_inf_grad_still_skips():
    def body(scaler, models, opts, data):
        x, y = data[0]
        opts[0].zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(models[0](x), y)).backward()
        models[0][0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opts[0])
        torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0)
        scaler.step(opts[0])
        scaler.update()
        return [scaler.get_scale()]
    assert run_both(body) == [2.0 ** 15]


def test_multiple_models_optimizers_and_losses_match():
    def body(scaler, models, opts, data):
        log = []
        for i, (x, y) in enumerate(data):
            for o in opts:
                o.zero_grad()
            out0, out1 = models[0](x), models[1](x)
            loss0 = torch.nn.functional.mse_loss(out0 + out1, y)
            loss1 = torch.nn.functional.mse_loss(3 * out0 - out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            if i == 3:
                models[1][2].bias.grad = None
                loss1 = loss1 * float("inf")
            scaler.scale(loss1).backward()
            scaler.unscale_(opts[0])
            scaler.step(opts[0])
            scaler.step(opts[1])
            scaler.update()
            log.append(scaler.get_scale())
        return log
    run_both(body, init_scale=2.0 ** 9, growth_interval=1)


def test_gradient_accumulation_matches():
    def body(scaler, models, opts, data):
        log = []
        for i, (x, y) in enumerate(data):
            scaler.scale(torch.nn.functional.mse_loss(models[0](x), y) / 2).backward()
            if i % 2 == 1:
                scaler.step(opts[0])
                scaler.update()
                opts[0].zero_grad()
                log.append(scaler.get_scale())
        return log
    run_both(body, init_scale=2.0 ** 30, growth_interval=1)


def test_gradient_penalty_matches():
    def body(scaler, models, opts, data):
        log = []
        for x, y in data:
            opts[0].zero_grad()
            loss = torch.nn.functional.mse_loss(models[0](x), y)
            params = list(models[0].parameters())
            scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in scaled).sqrt()
            scaler.scale(loss + penalty).backward()
            scaler.step(opts[0])
            scaler.update()
            log.append(scaler.get_scale())
        return log
    run_both(body, init_scale=2.0 ** 5, growth_interval=2)


def test_scale_of_nested_outputs_matches():
    outs = [torch.full((2,), 3.0), (torch.full((1,), 2.0), [torch.full((3,), -1.0)])]
    results = []
    for _, scaler in scalers(init_scale=4.0):
        s = scaler.scale(outs)
        results.append([s[0], s[1][0], s[1][1][0]])
        assert isinstance(s[1], tuple) and isinstance(s[1][1], list)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for _, scaler in scalers():
        with pytest.raises(ValueError):
            scaler.scale(object())


def test_state_dict_round_trip_between_scalers():
    src_t = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    src_t.scale(torch.ones(()))
    sd = src_t.state_dict()
    for _, scaler in scalers():
        scaler.load_state_dict(sd)
        assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                scaler.get_growth_interval()) == (3.0, 4.0, 0.25, 7)
        scaler.scale(torch.ones(()))
        assert scaler.get_scale() == 3.0
    src_v = amp.GradScaler("cpu", init_scale=5.0)
    src_v.scale(torch.ones(()))
    dst = torch.amp.GradScaler("cpu")
    dst.load_state_dict({k: v for k, v in src_v.state_dict().items() if k in sd})
    assert dst.get_scale() == 5.0
    for _, scaler in scalers():
        with pytest.raises(RuntimeError):
            scaler.load_state_dict({})
    for _, scaler in scalers(enabled=False):
        assert scaler.state_dict() == {}


def test_pickle_round_trip_both():
    for _, scaler in scalers(init_scale=8.0, growth_interval=3):
        scaler.scale(torch.ones(()))
        clone = pickle.loads(pickle.dumps(scaler))
        assert clone.get_scale() == 8.0 and clone.get_growth_interval() == 3


def test_update_with_new_scale_matches():
    for _, scaler in scalers():
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=12.0)
        assert scaler.get_scale() == 12.0
        scaler.update(new_scale=torch.tensor(3.0))
        assert scaler.get_scale() == 3.0
    for name, scaler in scalers():
        scaler.scale(torch.ones(()))
        with pytest.raises((ValueError, AssertionError)):  # torch asserts; vramkit raises ValueError
            scaler.update(new_scale=torch.ones(2))


def test_misuse_raises_the_same_exception_types():
    def fresh():
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        return torch.optim.SGD([p], lr=0.1)

    for name, scaler in scalers():
        opt = fresh()
        with pytest.raises(AssertionError):
            scaler.unscale_(opt)  # before scale()
        with pytest.raises(AssertionError):
            scaler.update()
        scaler.scale(torch.ones(()))
        with pytest.raises(AssertionError):
            scaler.update()  # no inf checks recorded
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.step(opt)
        with pytest.raises(AssertionError):
            pickle.dumps(scaler)  # mid-iteration
        scaler.update()
        with pytest.raises(RuntimeError, match="Closure"):
            scaler.step(fresh(), closure=lambda: None)
    for _, cls in (("torch", torch.amp.GradScaler), ("vramkit", amp.GradScaler)):
        with pytest.raises((AssertionError, ValueError)):
            cls("cpu", growth_factor=0.9)


def test_disabled_scalers_are_pass_through():
    for _, scaler in scalers(enabled=False):
        x = torch.ones(2)
        assert scaler.scale(x) is x
        assert scaler.get_scale() == 1.0 and not scaler.is_enabled()


def test_grads_replaced_between_unscale_and_step_match():
    # torch keeps the found_inf of unscale_; a grad swapped in afterwards is not re-checked.
    def body(scaler, models, opts, data):
        x, y = data[0]
        opts[0].zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(models[0](x), y)).backward()
        scaler.unscale_(opts[0])
        models[0][0].weight.grad = torch.full_like(models[0][0].weight, float("inf"))
        models[0][0].weight.grad.zero_()
        scaler.step(opts[0])
        scaler.update()
        return [scaler.get_scale()]
    run_both(body)
