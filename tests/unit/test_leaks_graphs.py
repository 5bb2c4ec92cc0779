"""vramkit.watch_leaks follows the growth of autograd graphs, not tensor identity: the
accumulated loss is found whether it is spelled `total += loss` (one tensor, updated in place)
or `total = total + loss` (a new tensor every step, the old one dropped), and a list of losses
(one more graph every step) is found too; `total += loss.item()` is clean."""

from __future__ import annotations

import inspect

import pytest

from vramkit.leaks import watch_leaks

torch = pytest.importorskip("torch")


def line_of(func, text: str) -> int:
    source, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(source) if text in line)


def train(spelling: str, steps: int = 8, warmup: int = 2):
    """A small training loop that keeps its losses as `spelling` says; returns the report."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    total, losses = 0, []
    with watch_leaks(warmup=warmup) as watch:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if spelling == "in place":
                total += loss  # one tensor whose graph grows
            elif spelling == "rebinding":
                total = total + loss  # a new tensor each step, holding every older graph
            elif spelling == "list":
                losses.append(loss)  # one more graph each step
            elif spelling == "item":
                total += loss.item()
            watch.step()
    return watch.report()


def test_in_place_accumulation_is_reported_with_its_line():
    r = train("in place")
    assert r.leaking and r.graph_holders, str(r)
    h = r.graph_holders[0]
    assert h.site.endswith(f":{line_of(train, 'total += loss  #')} (train)"), h.site
    assert h.grad_fn == "AddBackward0" and h.steps >= 8 and h.shape == () and h.count == 1
    assert "accumulate loss.item() or loss.detach() instead" in str(r)


def test_rebinding_accumulation_is_reported_with_its_line():
    """The tensor alive at the end of the warm-up is gone; a new one holds every step's graph."""
    r = train("rebinding")
    assert r.leaking and r.graph_holders, str(r)
    h = r.graph_holders[0]
    assert h.site.endswith(f":{line_of(train, 'total = total + loss')} (train)"), h.site
    assert h.grad_fn == "AddBackward0" and h.steps >= 8 and h.shape == () and h.count == 1
    # each step adds the loss's graph to the chain: the holder's node count is several per step
    assert h.nodes >= 8 * 3
    text = str(r)
    assert "accumulate loss.item() or loss.detach() instead" in text
    assert "autograd graphs kept alive across steps" in text


def test_a_list_of_losses_is_reported_with_its_line():
    """Each graph keeps its size, but there is one more of them every step."""
    r = train("list")
    assert r.leaking, str(r)
    holders = [h for h in r.graph_holders if h.count > 1]
    assert holders, str(r)
    h = holders[0]
    assert h.site.endswith(f":{line_of(train, 'loss = torch.nn.functional.mse_loss')} (train)"), h.site
    assert h.count == 8  # every step's loss is still alive
    assert h.grad_fn == "MseLossBackward0" and h.shape == ()
    text = str(r)
    assert "8 tensors" in text and "one more every step" in text
    assert "keep loss.item() or loss.detach() instead" in text


def test_accumulating_item_is_not_reported():
    r = train("item")
    assert not r.leaking, str(r)
    assert not r.graph_holders
    assert "no steady growth" in str(r)


def test_graph_growth_is_measured_over_the_steps_after_the_warm_up():
    r = train("rebinding", steps=7, warmup=3)
    assert len(r.graph_after) == 4  # one figure per measured step
    assert all(b > a for a, b in zip(r.graph_after, r.graph_after[1:])), r.graph_after
    clean = train("item", steps=7, warmup=3)
    assert len(set(clean.graph_after)) == 1, clean.graph_after  # the same graph size every step


def test_a_hidden_state_carried_across_steps_is_reported_with_the_detach_fix():
    """An RNN-style state that is never detached: the graph deepens every step through a
    non-additive node; the advice is to detach the state, not to call .item()."""
    w = torch.randn(4, 4, requires_grad=True)
    hidden = torch.zeros(1, 4)
    with watch_leaks(warmup=1) as watch:
        for _ in range(6):
            hidden = torch.tanh(hidden @ w)
            loss = hidden.sum()
            loss.backward(retain_graph=True)  # what silences "backward through the graph a second time"
            watch.step()
    r = watch.report()
    assert r.graph_holders, str(r)
    h = r.graph_holders[0]
    assert h.grad_fn == "TanhBackward0"
    this = test_a_hidden_state_carried_across_steps_is_reported_with_the_detach_fix
    assert h.site.endswith(f":{line_of(this, 'hidden = torch.tanh')} ({this.__name__})"), h.site  # not the loss's line
    assert "detach()" in str(r) and "loss.item()" not in str(r)


def test_each_step_walks_only_the_new_part_of_a_growing_graph():
    """Measuring the graphs at every step must not cost more the longer a chain gets: each step
    walks the nodes created since the last one and stops at the graph it measured then (a walk
    of the whole chain would visit 3 more nodes at every step here)."""
    w = torch.ones(4, requires_grad=True)
    total = 0
    with watch_leaks(warmup=0, collect=False) as watch:
        for _ in range(40):
            total = total + (w * 2).sum()
            watch.step()
    assert watch.report().graph_holders
    walked = watch.graph_nodes_walked
    assert len(walked) == 40
    assert max(walked[-10:]) <= max(walked[1:11]), walked
