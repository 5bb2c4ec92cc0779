"""vramkit.watch_leaks: the seed's accumulated-loss loop is reported with its line; the same
loop with .item() / .detach() is clean; a cache that fills then plateaus is not a leak."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import vramkit
from vramkit.leaks import LeakWatchWarning, watch_leaks

torch = pytest.importorskip("torch")


def line_of(func, text: str) -> int:
    source, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(source) if text in line)


def train(accumulate: str, steps: int = 8, backward: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    total_loss = 0
    with watch_leaks(warmup=2) as watch:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if backward:
                opt.zero_grad()
                loss.backward()
                opt.step()
            if accumulate == "tensor":
                total_loss += loss  # the leak: keeps every step's graph
            elif accumulate == "item":
                total_loss += loss.item()
            else:
                total_loss += loss.detach()
            watch.step()
    return watch.report()


def test_accumulated_loss_is_reported_with_its_line():
    r = train("tensor")
    assert r.leaking and r.graph_holders
    h = r.graph_holders[0]
    assert h.site.endswith(f":{line_of(train, 'total_loss += loss  #')} (train)")
    assert h.grad_fn == "AddBackward0" and h.steps >= 8 and h.shape == ()
    assert "accumulate loss.item() or loss.detach() instead" in str(r)


@pytest.mark.parametrize("fix", ["item", "detach"])
def test_item_and_detach_are_clean(fix):
    r = train(fix)
    assert not r.leaking, str(r)
    assert "no steady growth" in str(r)


def test_without_backward_the_saved_activations_grow():
    """Accumulating losses with grad on and no backward (an evaluation loop without no_grad)
    keeps every step's saved activations: storages grow, and the sites say where."""
    r = train("tensor", backward=False)
    assert r.torch_leaking
    per_step = (r.torch_after[-1] - r.torch_after[0]) / (len(r.torch_after) - 1)
    assert per_step >= 16 * 64 * 4  # at least the hidden activation of each step
    assert any("train" in site for site, _ in r.torch_sites)
    assert "torch storages created after the warm-up and still live" in str(r)


def test_vramkit_pool_leak_and_a_plateauing_cache():
    import vramkit.numpy as vnp

    vnp.install()
    kept, cache = [], {}

    def leaky():
        kept.append(np.ones(1 << 17))  # 1 MiB kept every step

    def caching(i):
        if len(cache) < 3:  # fills during the first steps, then stays
            cache[i] = np.ones(1 << 17)

    with watch_leaks(device="cpu", warmup=1) as w:
        for _ in range(6):
            leaky()
            w.step()
    r = w.report()
    assert r.pool_leaking and not r.torch_leaking
    assert all(b - a == 1 << 20 for a, b in zip(r.pool_after, r.pool_after[1:]))
    assert any(f"test_leaks.py:{line_of(test_vramkit_pool_leak_and_a_plateauing_cache, 'kept.append')}" in s
               for s in r.pool_sites), r.pool_sites
    with watch_leaks(device="cpu", warmup=3) as w:
        for i in range(8):
            caching(i)
            w.step()
    assert not w.report().leaking
    kept.clear()
    cache.clear()


def test_bad_use():
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        watch_leaks(warmup=-1)
    with pytest.raises(ValueError):
        watch_leaks(device="nowhere")
    w = watch_leaks()
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        w.step()
    with pytest.warns(LeakWatchWarning, match="only 1 step was recorded; judging growth needs at least 4"):
        with watch_leaks() as w:
            w.step()
    assert "too few" in str(w.report())


def test_a_large_graph_that_does_not_grow_is_not_a_leak():
    """A loss summed over time steps inside one step builds a long AddBackward0 chain, but the
    chain is rebuilt every step, not extended: no leak."""
    w = torch.ones(8, requires_grad=True)
    kept = []
    with watch_leaks(warmup=1) as watch:
        for _ in range(5):
            loss = 0
            for t in range(12):
                loss = loss + (w * t).sum()
            kept[:] = [loss]  # the latest loss is kept (for logging), its graph replaced each step
            watch.step()
    assert not watch.report().leaking, str(watch.report())
