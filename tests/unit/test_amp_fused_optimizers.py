"""GradScaler.step with optimizers that unscale their gradients themselves (torch's
``_step_supports_amp_scaling``): torch's fused Adam, AdamW, SGD and Adagrad on CPU, and a
custom optimizer of the older ``grad_scaler=`` form. Every check runs torch.amp.GradScaler
and vramkit.amp.GradScaler side by side on the same model, gradients and overflows, and
compares parameters, optimizer state and scale bit for bit."""

from __future__ import annotations

import warnings

import pytest

from vramkit import amp
from vramkit.amp.self_scaling import LEGACY_WARNING

torch = pytest.importorskip("torch")

OPTIMIZERS = [
    ("Adam", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9}),
    ("Adagrad", {"lr": 1e-1}),
]


def make_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def run(scaler, name: str, options: dict, *, steps: int, overflow_at: set[int], unscale_first: bool,
        user_grad_scale: float | None = None):
    """Train a copy of the same model; returns (parameters, optimizer state, scale per step, seen)."""
    model = make_model(0)
    opt = getattr(torch.optim, name)(model.parameters(), fused=True, **options)
    data = torch.Generator().manual_seed(1)
    scales, seen = [], []
    real_step = opt.step

    def watching_step(*args, **kwargs):  # what the optimizer is handed during its step
        seen.append((getattr(opt, "grad_scale", "unset"), getattr(opt, "found_inf", "unset")))
        return real_step(*args, **kwargs)

    opt.step = watching_step
    for i in range(steps):
        x = torch.randn(32, 8, generator=data)
        y = torch.randn(32, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if i in overflow_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if user_grad_scale is not None:
            opt.grad_scale = torch.tensor(user_grad_scale)
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], opt.state, scales, seen


def pair(**kwargs):
    return (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3, **kwargs),
            amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3, **kwargs))


def assert_same_run(theirs, ours):
    params_t, state_t, scales_t, seen_t = theirs
    params_v, state_v, scales_v, seen_v = ours
    assert scales_v == scales_t
    for a, b in zip(params_t, params_v):
        assert torch.equal(a, b)
    for (pt, st), (pv, sv) in zip(state_t.items(), state_v.items()):
        assert st.keys() == sv.keys()
        for key in st:
            assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(sv[key])), key
    assert len(seen_v) == len(seen_t)
    for (gs_t, fi_t), (gs_v, fi_v) in zip(seen_t, seen_v):
        assert (gs_t is None) == (gs_v is None)
        if gs_t is not None:
            assert torch.equal(torch.as_tensor(gs_t), torch.as_tensor(gs_v))
        assert torch.equal(fi_t, fi_v)


@pytest.mark.parametrize("name, options", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_fused_optimizer_steps_exactly_as_with_torchs_scaler(name, options, unscale_first):
    overflow_at = {2, 3, 9}
    torch_scaler, vramkit_scaler = pair()
    theirs = run(torch_scaler, name, options, steps=14, overflow_at=overflow_at, unscale_first=unscale_first)
    ours = run(vramkit_scaler, name, options, steps=14, overflow_at=overflow_at, unscale_first=unscale_first)
    assert_same_run(theirs, ours)
    # the optimizer unscaled by itself: it was handed the scale (None once unscale_ ran) and the flags
    for i, (grad_scale, found_inf) in enumerate(ours[3]):
        assert grad_scale is None if unscale_first else float(grad_scale) == ours[2][i - 1] if i else 2.0 ** 10
        assert float(found_inf) == (1.0 if i in overflow_at else 0.0)


def test_a_grad_scale_the_user_set_is_multiplied_in_as_torch_does():
    torch_scaler, vramkit_scaler = pair()
    theirs = run(torch_scaler, "Adam", {"lr": 1e-2}, steps=4, overflow_at=set(), unscale_first=False,
                 user_grad_scale=2.0)
    ours = run(vramkit_scaler, "Adam", {"lr": 1e-2}, steps=4, overflow_at=set(), unscale_first=False,
               user_grad_scale=2.0)
    assert_same_run(theirs, ours)
    assert float(ours[3][0][0]) == 2.0 ** 11


def test_the_attributes_are_removed_after_the_step():
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    scaler = amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update"):
        scaler.step(opt)


def test_return_found_inf_reports_the_flags_handed_to_the_optimizer():
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scaler = amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    _, found = scaler.step(opt, return_found_inf=True)
    assert found is True
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the fused kernel skipped it


class LegacyOptimizer(torch.optim.SGD):
    """A custom optimizer of the older protocol: step(grad_scaler=...) does its own unscaling."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.handed = grad_scaler
        inv = 1.0 / grad_scaler.get_scale()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(inv)
        return super().step()


@pytest.mark.parametrize("make_scaler", [lambda: torch.amp.GradScaler("cpu"), lambda: amp.GradScaler("cpu")],
                         ids=["torch", "vramkit"])
def test_the_older_protocol_hands_the_scaler_itself_with_torchs_warning(make_scaler):
    model = make_model(0)
    opt = LegacyOptimizer(model.parameters(), lr=0.1)
    scaler = make_scaler()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(opt)
    assert opt.handed is scaler
    assert [str(w.message) for w in caught if w.category is FutureWarning] == [LEGACY_WARNING]
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_the_legacy_warning_text_is_torchs():
    import inspect

    import torch.amp.grad_scaler as torch_grad_scaler

    source = " ".join(inspect.getsource(torch_grad_scaler.GradScaler.step).split())
    for sentence in LEGACY_WARNING.split(". "):
        assert " ".join(sentence.split()) in source.replace('" "', "")
