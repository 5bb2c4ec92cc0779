"""Mixed-precision training loops driven by vramkit.amp.GradScaler.

An MLP learns four Gaussian blobs: float32 master weights, float16 forward and backward passes,
the loss scaled by the scaler, float16 gradients unscaled (and steps skipped) by
``scaler.step``. Once by hand in NumPy, once in torch under CPU autocast, side by side with
torch.amp.GradScaler. Each run checks itself against independent references: NumPy float32
arithmetic for the unscale, a plain-Python model of the scale rule, torch's own scaler.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from vramkit import amp

F16, F32 = np.float16, np.float32


def blobs(n=512, seed=0):
    """Four well-separated Gaussian blobs in 2-D, labels 0..3."""
    rng = np.random.default_rng(seed)
    centers = np.array([[-2.0, -2.0], [-2.0, 2.0], [2.0, -2.0], [2.0, 2.0]])
    y = rng.integers(0, 4, n)
    x = centers[y] + rng.normal(0.0, 0.7, (n, 2))
    return x.astype(F32), y


def expected_scale(init, flags, growth_interval, growth_factor=2.0, backoff_factor=0.5):
    """The scale after each update, from PyTorch's documented rule (amp.md §2.2), in float32."""
    scale, tracker, out = F32(init), 0, []
    for found in flags:
        if found:
            scale, tracker = F32(np.float64(scale) * backoff_factor), 0
        elif tracker + 1 == growth_interval:
            grown = F32(np.float64(scale) * growth_factor)
            scale, tracker = (grown if np.isfinite(grown) else scale), 0
        else:
            tracker += 1
        out.append(float(scale))
    return out


# ---- NumPy: fp16 compute written by hand ---------------------------------------------------------

def mm16(a, b):
    """float16 inputs and output with float32 accumulation, as tensor cores do. (einsum: no BLAS
    threads, whose hand-offs cost more than these small products.) Overflow to inf is a result
    the scaler must see, not a warning."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.einsum("ij,jk->ik", a.astype(F32), b.astype(F32)).astype(F16)


class NumpyMLP:
    def __init__(self, sizes=(2, 32, 32, 4), seed=1):
        rng = np.random.default_rng(seed)
        self.params = []
        for fan_in, fan_out in itertools.pairwise(sizes):
            self.params += [(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(F32),
                            np.zeros(fan_out, F32)]
        self.velocity = [np.zeros_like(p) for p in self.params]

    def forward_backward(self, x, y, seed_grad):
        """float32 loss and accuracy, and float16 gradients of (loss * seed_grad)."""
        w16 = [p.astype(F16) for p in self.params]
        acts = [x.astype(F16)]
        n_layers = len(w16) // 2
        for i in range(n_layers):
            z = (mm16(acts[-1], w16[2 * i]).astype(F32) + w16[2 * i + 1].astype(F32)).astype(F16)
            acts.append(np.maximum(z, F16(0)) if i < n_layers - 1 else z)
        logits = acts[-1].astype(F32)
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        n = len(y)
        loss = F32(-logp[np.arange(n), y].mean())
        accuracy = float((logits.argmax(axis=1) == y).mean())
        d = np.exp(logp)
        d[np.arange(n), y] -= 1.0
        grad = (d / F32(n) * F32(seed_grad)).astype(F16)  # where loss scaling rescues small values
        grads = [None] * len(w16)
        for i in reversed(range(n_layers)):
            grads[2 * i] = mm16(acts[i].T, grad)
            grads[2 * i + 1] = grad.astype(F32).sum(axis=0).astype(F16)
            if i:
                grad = mm16(grad, w16[2 * i].T)
                grad = np.where(acts[i] > 0, grad, F16(0))
        return loss, accuracy, grads

    def sgd(self, grads, lr=0.1, momentum=0.9):
        for p, v, g in zip(self.params, self.velocity, grads):
            v *= F32(momentum)
            v += g.astype(F32)
            p -= F32(lr) * v
        return "stepped"


def train_numpy(steps, init_scale, growth_interval, inject_at=None, max_scale=None):
    x, y = blobs()
    model = NumpyMLP()
    scaler = amp.GradScaler(init_scale=init_scale, growth_interval=growth_interval, max_scale=max_scale)
    hist = {"loss": [], "acc": [], "found": [], "scale": [], "changed": [], "params": []}
    for step in range(steps):
        # The gradient of the scaled loss with respect to the loss is the scale: what autograd
        # seeds the backward pass with after scaler.scale(loss).backward().
        seed = scaler.scale(np.ones((), F32))
        loss, acc, grads = model.forward_backward(x, y, seed)
        scale = scaler.get_scale()
        scaled_loss = scaler.scale(loss)
        assert seed == F32(scale) and scaled_loss.dtype == F32 and scaled_loss == loss * F32(scale)
        if step == inject_at:
            grads[2][3, 5] = F16(np.inf)
        scaled = [g.copy() for g in grads]
        before = [p.copy() for p in model.params]
        ret, found = scaler.step(grads, grads, step_fn=model.sgd, return_found_inf=True)
        # independent checks of what the scaler did this step
        assert found == (not all(np.isfinite(g).all() for g in scaled))
        assert ret == (None if found else "stepped")
        if not found:
            inv = F32(1.0 / np.float64(F32(scale)))
            for g, s in zip(grads, scaled):  # unscaled in place, as float32 math rounds it
                assert g.dtype == F16
                np.testing.assert_array_equal(g, (s.astype(F32) * inv).astype(F16))
        scaler.update()
        hist["loss"].append(float(loss))
        hist["acc"].append(acc)
        hist["found"].append(found)
        hist["scale"].append(scaler.get_scale())
        hist["changed"].append(any(not np.array_equal(a, b) for a, b in zip(before, model.params)))
        hist["params"].append([p.copy() for p in model.params])
    return hist


def test_numpy_fp16_training_converges_and_skips_only_overflowing_steps():
    steps = 250
    hist = train_numpy(steps, init_scale=2.0 ** 16, growth_interval=100)
    assert hist["loss"][-1] < 0.5 * hist["loss"][0]
    assert hist["loss"][-1] < 0.15 and hist["acc"][-1] >= 0.95
    assert hist["changed"] == [not f for f in hist["found"]]  # exactly the skipped steps left weights alone
    assert hist["scale"] == expected_scale(2.0 ** 16, hist["found"], 100)
    assert 0 < sum(hist["found"]) < steps // 10  # 2**16 overflowed while the scale calibrated, then rarely


def test_numpy_injected_overflow_skips_exactly_that_step():
    k, steps = 60, 120
    kwargs = {"init_scale": 2.0 ** 8, "growth_interval": 25, "max_scale": 2.0 ** 11}
    clean = train_numpy(steps, **kwargs)
    hurt = train_numpy(steps, inject_at=k, **kwargs)
    assert not any(clean["found"])
    assert hurt["found"] == [i == k for i in range(steps)]
    assert hurt["changed"] == [i != k for i in range(steps)]
    for a, b in zip(hurt["params"][k], hurt["params"][k - 1]):  # the weights did not move at step k
        np.testing.assert_array_equal(a, b)
    for i in range(k):  # identical runs up to the overflow
        assert hurt["loss"][i] == clean["loss"][i] and hurt["scale"][i] == clean["scale"][i]
    assert hurt["scale"][k] == hurt["scale"][k - 1] / 2  # backed off at that update
    assert max(hurt["scale"][:k]) > 2.0 ** 8  # it had grown before, so the halving is not the first value
    assert hurt["loss"][-1] < 0.5 * hurt["loss"][0] and hurt["acc"][-1] >= 0.95


def test_numpy_loss_scaling_keeps_small_fp16_gradients_from_underflowing():
    x, y = blobs()
    model = NumpyMLP()
    for _ in range(150):  # train well, so that gradients get small
        _, _, grads = model.forward_backward(x, y, 1.0)
        model.sgd(grads)
    _, _, unscaled16 = model.forward_backward(x, y, 1.0)
    scaler = amp.GradScaler(init_scale=2.0 ** 12)
    _, _, grads = model.forward_backward(x, y, scaler.scale(np.ones((), F32)))
    ref = [g.copy() for g in grads]
    _, found = scaler.step(grads, step_fn=lambda: None, return_found_inf=True)
    assert not found
    zeros_unscaled = sum(int((g == 0).sum()) for g in unscaled16)
    zeros_scaled = sum(int((g == 0).sum()) for g in ref)
    assert zeros_scaled < zeros_unscaled  # fp16 gradients that underflowed without scaling survive with it
    for g, r in zip(grads, ref):
        np.testing.assert_array_equal(g, (r.astype(F32) * F32(2.0 ** -12)).astype(F16))


# ---- torch: CPU autocast fp16, side by side with torch.amp.GradScaler --------------------------

@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: reproducible and faster on one thread
    yield torch
    torch.set_num_threads(threads)


def test_torch_autocast_training_matches_torch_gradscaler(torch):
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            probe = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    except (RuntimeError, AssertionError) as e:  # pragma: no cover - old torch
        pytest.skip(f"CPU autocast to float16 is not supported here: {e}")
    assert probe.dtype == torch.float16

    x_np, y_np = blobs()
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                  torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    ours = amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=40)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=40)
    k, steps = 90, 160
    found_flags, losses, scales = [], [], []
    for step in range(steps):
        step_losses = []
        for model, opt, scaler in ((model_a, opt_a, ours), (model_b, opt_b, ref)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
            assert logits.dtype == torch.float16 and loss.dtype == torch.float32
            scaler.scale(loss).backward()
            if step == k:
                model[2].weight.grad[1, 1] = float("inf")
            step_losses.append(loss.detach())
        assert torch.equal(step_losses[0], step_losses[1]), step
        before = [p.detach().clone() for p in model_a.parameters()]
        _, found = ours.step(opt_a, return_found_inf=True)
        ref.step(opt_b)
        unchanged = all(torch.equal(p0, p) for p0, p in zip(before, model_a.parameters()))
        assert unchanged == found, step
        prev = ours.get_scale()
        ours.update()
        ref.update()
        assert ours.get_scale() == ref.get_scale() and ours._get_growth_tracker() == ref._get_growth_tracker()
        assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters())), step
        if step == k:
            assert ours.get_scale() == prev / 2
        found_flags.append(found)
        losses.append(float(step_losses[0]))
        scales.append(ours.get_scale())
    assert found_flags == [i == k for i in range(steps)]
    assert scales == expected_scale(2.0 ** 8, found_flags, 40)
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        accuracy = float((model_a(x).argmax(dim=1) == y).float().mean())
    assert accuracy >= 0.95
