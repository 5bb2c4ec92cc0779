"""vramkit.checkpoint.checkpoint runs on torch's engine: each case a user met with vramkit's own
recompute engine, run through torch.utils.checkpoint.checkpoint and vramkit's on the same inputs,
with the same gradients, exceptions and warnings expected from both."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.utils.checkpoint as tuc  # noqa: E402

from vramkit import checkpoint as ck  # noqa: E402

IMPLEMENTATIONS = {"torch": tuc.checkpoint, "vramkit": lambda *a, **k: ck.checkpoint(*a, **k)}


def both(run):
    """run(checkpoint) with torch's and vramkit's; returns the two results."""
    return run(IMPLEMENTATIONS["torch"]), run(IMPLEMENTATIONS["vramkit"])


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def test_autograd_grad_inside_the_function_a_gradient_penalty():
    w0 = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def run(cp):
        w = w0.clone().requires_grad_()
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()

        def penalised(t):
            y = (t @ w).tanh()
            (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
            return y.sum() + g.pow(2).sum()

        cp(penalised, x, use_reentrant=False).backward()
        return [w.grad, x.grad]

    assert_same(*both(run))


def test_a_function_that_saves_more_when_recomputed():
    def run(cp):
        cache: dict[str, torch.Tensor] = {}
        x = torch.linspace(0.1, 1.0, 6, dtype=torch.float64).requires_grad_()

        def f(t):
            y = t.sin()
            if "seen" in cache:  # the recomputation takes another branch, which saves more tensors
                y = y * t.cos() / t.cos()
            cache["seen"] = y
            return y.exp()

        cp(f, x, use_reentrant=False).sum().backward()
        return [x.grad]

    assert_same(*both(run))


class KeepsTag(torch.autograd.Function):
    """Saves an input that needs no gradient and reads a Python attribute off it in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale * scale.tag, None


def test_a_saved_input_without_grad_keeps_its_python_attributes():
    def run(cp):
        x = torch.ones(3, requires_grad=True)
        scale = torch.full((3,), 2.0)
        scale.tag = 5.0
        cp(lambda a, s: KeepsTag.apply(a, s), x, scale, use_reentrant=False).sum().backward()
        return [x.grad]

    theirs, ours = both(run)
    assert_same(theirs, ours)
    assert torch.equal(ours[0], torch.full((3,), 10.0))  # d(x * 2)/dx, times the tag 5


def test_early_stop_stops_the_recomputation_where_torch_does():
    for early_stop in (True, False):
        def run(cp):
            after_last_saved = []
            x = torch.randn(5, requires_grad=True)

            def f(t):
                y = t.exp()
                after_last_saved.append(1)  # reached by a recomputation only without early stop
                return y * 1.0

            cp(f, x, use_reentrant=False, early_stop=early_stop).sum().backward()
            return len(after_last_saved)

        theirs, ours = both(run)
        assert ours == theirs
    assert theirs == 2  # without early stop the recomputation ran to the end


def test_graph_exec_group_detects_overlapping_backwards_as_torch_does():
    group_type = getattr(tuc, "GraphExecGroup", None)
    if group_type is None:
        pytest.skip("this torch has no torch.utils.checkpoint.GraphExecGroup")

    def run(cp):
        x = torch.linspace(-1.0, 1.0, 4).requires_grad_()
        y = cp(lambda t: t.sin().exp(), x, use_reentrant=False)
        a, b = y[:2].sum(), y[2:].sum()  # both need the same saved activations
        try:
            with group_type():
                torch.autograd.grad(a, x, retain_graph=True)
                torch.autograd.grad(b, x)
        except Exception as exc:  # noqa: BLE001 -- compared with torch's below
            return type(exc), str(exc)
        return None, ""

    (type_t, message_t), (type_v, message_v) = both(run)
    assert type_v is type_t and message_v == message_t
    assert type_t is tuc.CheckpointError


def test_without_graph_exec_group_separate_backwards_recompute_as_torchs():
    def run(cp):
        calls = []
        x = torch.linspace(-1.0, 1.0, 4).requires_grad_()

        def f(t):
            calls.append(1)
            return t.sin().exp()

        y = cp(f, x, use_reentrant=False)
        (g1,) = torch.autograd.grad(y[:2].sum(), x, retain_graph=True)
        (g2,) = torch.autograd.grad(y[2:].sum(), x)
        return len(calls), g1, g2

    (calls_t, *grads_t), (calls_v, *grads_v) = both(run)
    assert calls_v == calls_t
    assert_same(grads_t, grads_v)


def test_debug_true_runs_as_torchs():
    def run(cp):
        x = torch.arange(1.0, 4.0, requires_grad=True)
        cp(torch.exp, x, use_reentrant=False, debug=True).sum().backward()
        return [x.grad]

    assert_same(*both(run))


def test_use_reentrant_omitted_warns_as_torch_at_the_callers_line_and_means_what_torchs_does():
    def run(cp):
        x = torch.randn(3, generator=torch.Generator().manual_seed(4)).requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = cp(torch.exp, x)  # <- the line the warning must name
        with pytest.raises(Exception) as raised, warnings.catch_warnings():  # reentrant refuses autograd.grad
            warnings.simplefilter("ignore")
            torch.autograd.grad(cp(torch.exp, x).sum(), x)
        return caught, type(raised.value), y

    (caught_t, exc_t, y_t), (caught_v, exc_v, y_v) = both(run)
    assert [(str(w.message), w.category) for w in caught_v] == [(str(w.message), w.category) for w in caught_t]
    assert caught_v and caught_v[0].filename == __file__
    assert exc_v is exc_t
    assert torch.equal(y_v, y_t)


def test_checkpoint_sequential_without_use_reentrant_warns_as_torch():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    messages = []
    for cp in (tuc.checkpoint_sequential, ck.checkpoint_sequential):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cp(model, 2, x)
        messages.append([(str(w.message), w.category) for w in caught])
        if cp is ck.checkpoint_sequential:
            assert caught[0].filename == __file__
    assert messages[1] == messages[0] and messages[0]


def test_selective_checkpointing_policies_pass_through():
    create = getattr(tuc, "create_selective_checkpoint_contexts", None)
    if create is None:
        pytest.skip("this torch has no selective activation checkpointing")
    policy = [torch.ops.aten.mm.default]

    def run(cp):
        w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        cp(lambda t: (t @ w).relu() @ w, x, use_reentrant=False,
           context_fn=lambda: create(policy)).sum().backward()
        return [w.grad]

    assert_same(*both(run))
