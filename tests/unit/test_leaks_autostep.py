"""vramkit.watch_leaks without watch.step(): each step of a torch optimizer is a watch step; a
block that records no step says so at exit; print(watch) shows the report. The tests that do
not name torch run without it."""

from __future__ import annotations

import warnings

import pytest

import vramkit
from vramkit.leaks import LeakWatchWarning, watch_leaks


def model_and_data():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return torch, model, torch.randn(4, 8), torch.randn(4, 1)


def test_optimizer_steps_are_watch_steps():
    """The issue's loop without watch.step(): it used to check nothing."""
    torch, model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = 0
    with watch_leaks(warmup=2) as watch:
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = total + loss  # leaks every step's graph
    r = watch.report()
    assert r.steps == 8 and r.step_source == "optimizer steps"
    assert r.leaking and r.graph_holders, str(r)
    assert "accumulate loss.item() or loss.detach() instead" in str(r)


def test_optimizer_steps_of_a_clean_loop_report_no_growth():
    torch, model, x, y = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # its state fills at the first step, then stays
    total = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeakWatchWarning)
        with watch_leaks(warmup=2) as watch:
            for _ in range(7):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
    r = watch.report()
    assert r.steps == 7 and not r.leaking, str(r)
    assert "no steady growth over 5 steps (optimizer steps) after 2 warm-up steps" in str(r)


def test_two_optimizers_make_one_watch_step_per_iteration():
    """A GAN-style loop steps two optimizers per iteration: the watch follows the first one."""
    torch, model, x, y = model_and_data()
    critic = torch.nn.Linear(1, 1)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    with watch_leaks(warmup=1) as watch:
        for _ in range(5):
            opt_g.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt_g.step()
            opt_c.zero_grad()
            critic(model(x).detach()).sum().backward()
            opt_c.step()
    assert watch.report().steps == 5


def test_explicit_steps_take_over_from_optimizer_steps():
    """A loop that calls both opt.step() and watch.step() counts one step per iteration."""
    torch, model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch_leaks(warmup=1) as watch:
        for i in range(6):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step()
            assert watch.steps == i + 1
    r = watch.report()
    assert r.steps == 6 and r.step_source == "watch.step()"


def test_explicit_steps_only_can_turn_optimizer_steps_off():
    torch, model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(LeakWatchWarning, match="no step was recorded"):
        with watch_leaks(auto_step=False) as watch:
            for _ in range(3):
                model(x).sum().backward()
                opt.step()
    assert watch.report().steps == 0


def test_the_optimizer_hook_is_removed_at_exit():
    torch, model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(LeakWatchWarning, match="only 1 step was recorded"):
        with watch_leaks(warmup=0) as watch:
            opt.step()
    assert watch.steps == 1
    opt.step()
    opt.step()
    assert watch.steps == 1 and watch.report().steps == 1
    with pytest.raises(ZeroDivisionError):  # also when the block ends with an exception
        with watch_leaks(warmup=0) as failed:
            opt.step()
            1 / 0
    opt.step()
    assert failed.steps == 1


def test_a_block_without_steps_warns_at_exit():
    with pytest.warns(LeakWatchWarning, match=r"no step was recorded.*watch\.step\(\)"):
        with watch_leaks() as watch:
            _ = [bytearray(100) for _ in range(3)]
    assert "no step was recorded" in str(watch)


def test_too_few_steps_warn_at_exit():
    with pytest.warns(LeakWatchWarning, match="only 2 steps were recorded; judging growth needs at least 4"):
        with watch_leaks(warmup=2) as watch:
            watch.step()
            watch.step()
    assert "too few" in str(watch)


def test_no_warning_when_the_block_raises():
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeakWatchWarning)
        with pytest.raises(KeyError):
            with watch_leaks():
                raise KeyError("boom")


def test_print_shows_the_report_and_repr_the_state():
    watch = watch_leaks(device="cpu", warmup=1)
    assert "not started" in repr(watch) and "no step was recorded" in str(watch)
    with watch:
        for _ in range(4):
            watch.step()
        assert "active" in repr(watch)
        assert str(watch) == str(watch.report())
    assert str(watch) == str(watch.report())
    assert str(watch).startswith("leak watch on cpu: no steady growth over 3 steps")
    assert repr(watch) == "LeakWatch(device='cpu', warmup=1, steps=4 (watch.step()), finished)"


def test_bad_arguments():
    with pytest.raises(TypeError, match="auto_step must be True or False, got 'yes'"):
        watch_leaks(auto_step="yes")
    with pytest.raises(TypeError, match="collect must be True or False, got 1"):
        watch_leaks(collect=1)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        watch_leaks(warmup=-1)


def test_top_level_name_is_the_same_function():
    assert vramkit.watch_leaks is watch_leaks
