"""The out-of-memory post-mortem (``vramkit.on_oom``): forced OOMs on a simulated device, on the
cpu pool under a limit (through NumPy's handler), and through torch's CUDA observer with its
entry points faked; the files open in torch's own memory_viz code; a directory that cannot be
written gives a warning, never a second exception.

Every figure the tests expect is computed here from what the test allocated, not read back
from the post-mortem's own code."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import numpy as np
import pytest

import torch_snapshots as ts
import vramkit
from vramkit import _C
from vramkit.report.sites import format_bytes
from vramkit.survive import oom
from vramkit.survive.oom_report import PostMortem, model_state_bytes, remedies

MiB = 1 << 20
HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def no_watch_left():
    yield
    watch = oom.active()
    if watch is not None:
        watch.remove()
    _C._drain_oom_queue()


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of" not in line)


def fill_then_fail(device: str, keep_mib: int, ask_mib: int) -> None:
    kept = [vramkit.empty(MiB * keep_mib, device=device) for _ in range(2)]  # KEPT-LINE
    vramkit.empty(MiB * ask_mib, device=device)  # (fails)
    del kept


def test_a_simulated_device_writes_a_post_mortem(tmp_path):
    dev = vramkit.sim.create(64 * MiB)
    out = io.StringIO()
    watch = vramkit.on_oom(tmp_path / "dumps", stream=out, devices=[dev])
    with pytest.raises(vramkit.OutOfMemoryError):
        fill_then_fail(dev, 20, 40)
    _C._drain_oom_queue()
    assert len(watch.dumps) == 1
    pm = watch.dumps[0]
    assert (pm.device, pm.requested, pm.allocated, pm.total) == (dev, 40 * MiB, 40 * MiB, 64 * MiB)
    assert pm.free == 24 * MiB and pm.live_from_history
    # The two live 20 MiB buffers, at the line that made them (freed by now: the history tells).
    assert pm.sites[0] == (f"{HERE}:{line_of('KEPT-LINE')} in <listcomp>", 40 * MiB, 2)
    text = out.getvalue()
    assert f"asked for {format_bytes(40 * MiB)}; {format_bytes(24 * MiB)} free of {format_bytes(64 * MiB)}" in text
    assert f"{HERE}:{line_of('KEPT-LINE')}" in text and "what to try:" in text
    snap_path, html_path = pm.files["snapshot"], pm.files["timeline"]
    assert os.path.dirname(snap_path) == str(tmp_path / "dumps") and snap_path.endswith("-1.pickle")
    assert "<svg" in open(html_path).read()
    assert not vramkit.memory_allocated(dev)  # the post-mortem holds nothing of the device


def test_the_dump_opens_in_torchs_memory_viz(tmp_path):
    _memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    dev = vramkit.sim.create(64 * MiB)
    watch = vramkit.on_oom(tmp_path, stream=io.StringIO(), devices=[dev])
    with pytest.raises(vramkit.OutOfMemoryError):
        fill_then_fail(dev, 20, 40)
    _C._drain_oom_queue()
    with open(watch.dumps[0].files["snapshot"], "rb") as f:
        snapshot = pickle.load(f)
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()
    # Taken while the failed call's frame (and its two 20 MiB buffers) was still alive.
    summary = _memory_viz.segsum(snapshot)
    assert "segments: 2" in summary and "total_allocated: 40.0MiB" in summary, summary


def test_the_cpu_pool_under_a_limit_through_numpys_handler(tmp_path):
    import vramkit.numpy as vnp

    out = io.StringIO()
    vramkit.on_oom(tmp_path, stream=out, devices=["cpu"])
    was = vnp.is_installed()
    vnp.install()
    vramkit.set_memory_limit(64 * MiB, "cpu")
    try:
        keep = [np.ones(8 * MiB, dtype=np.uint8) for _ in range(4)]  # NUMPY-LINE
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # vramkit's note on NumPy's MemoryError
            with pytest.raises(MemoryError):
                np.ones(48 * MiB, dtype=np.uint8)
        for _ in range(3):  # the interpreter hands the queued report over at its next safe point
            pass
    finally:
        vramkit.set_memory_limit(None, "cpu")
        if not was:
            vnp.uninstall()
    watch = oom.active()
    assert watch is not None and len(watch.dumps) == 1
    pm = watch.dumps[0]
    assert pm.device == "cpu" and pm.requested == 48 * MiB and pm.allowed == 64 * MiB
    assert pm.sites[0][0] == f"{HERE}:{line_of('NUMPY-LINE')} in <listcomp>" and pm.sites[0][1] >= 32 * MiB
    assert any("limit set on this device binds" in r for r in pm.remedies)
    assert len(keep) == 4


def test_an_unwritable_directory_is_a_warning_not_a_second_exception(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    dev = vramkit.sim.create(64 * MiB)
    out = io.StringIO()
    watch = vramkit.on_oom(blocker / "dumps", stream=out, devices=[dev])
    with pytest.warns(oom.OomDumpWarning, match="could not write the out-of-memory dump"):
        with pytest.raises(vramkit.OutOfMemoryError):
            fill_then_fail(dev, 20, 40)
        _C._drain_oom_queue()
    pm = watch.dumps[0]
    assert pm.files == {} and pm.problems
    assert "not done: could not write" in out.getvalue() and "asked for" in out.getvalue()


def test_a_full_disk_is_a_warning_and_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno

    import vramkit.report.timeline as timeline

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(timeline, "write_atomically", no_space)  # the snapshot fits, the timeline does not
    dev = vramkit.sim.create(16 * MiB)
    out = io.StringIO()
    watch = vramkit.on_oom(tmp_path, stream=out, devices=[dev])
    with pytest.warns(oom.OomDumpWarning, match="No space left on device"):
        with pytest.raises(vramkit.OutOfMemoryError):
            vramkit.raw_alloc(32 * MiB, dev)
        _C._drain_oom_queue()
    pm = watch.dumps[0]
    assert list(pm.files) == ["snapshot"] and os.listdir(tmp_path) == [os.path.basename(pm.files["snapshot"])]
    assert "No space left on device" in out.getvalue()


def test_max_dumps_then_one_line_each(tmp_path):
    dev = vramkit.sim.create(16 * MiB)
    out = io.StringIO()
    watch = vramkit.on_oom(tmp_path, stream=out, devices=[dev], max_dumps=2)
    for _ in range(4):
        with pytest.raises(vramkit.OutOfMemoryError):
            vramkit.raw_alloc(32 * MiB, dev)
        _C._drain_oom_queue()
    assert watch.failures == 4 and len(watch.dumps) == 2
    assert len(os.listdir(tmp_path)) == 4  # two pickles, two timelines
    assert "out of memory on " + dev + " again (4 so far" in out.getvalue()


def test_rank_in_the_file_name_and_on_the_screen(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    dev = vramkit.sim.create(16 * MiB)
    out = io.StringIO()
    watch = vramkit.on_oom(tmp_path, stream=out, devices=[dev])
    with pytest.raises(vramkit.OutOfMemoryError):
        vramkit.raw_alloc(32 * MiB, dev)
    _C._drain_oom_queue()
    assert "-rank3-" in os.path.basename(watch.dumps[0].files["snapshot"])
    assert f"out of memory on {dev} (rank 3)" in out.getvalue()


def test_expected_ooms_are_not_reported(tmp_path):
    """A batch-size search's OOMs are its answers, and a trace replay's predicted OOM is not an
    event of this process: neither writes a post-mortem."""
    import vramkit.trace as vt

    dev = vramkit.sim.create(64 * MiB)
    watch = vramkit.on_oom(tmp_path, stream=io.StringIO(), devices=[dev])

    def step(bs):
        vramkit.empty(bs * MiB, device=dev)

    found = vramkit.survive.find_batch_size(step, device=dev, max_batch_size=256)
    assert found.batch_size == 64 and any(a.outcome == "oom" for a in found.attempts)  # 64 MiB: the whole device
    trace = vt.Trace.from_columns(kind=[vt.ALLOC], id=[0], size=[128 * MiB])
    assert not vt.replay(trace, 64 * MiB, overheads=vt.NO_OVERHEADS).fits
    _C._drain_oom_queue()
    assert watch.dumps == [] and watch.failures == 0


def test_bad_input_changes_nothing(tmp_path):
    first = vramkit.on_oom(tmp_path, stream=io.StringIO())
    for kwargs, match in (({"top": -1}, "top must be"), ({"max_dumps": 1.5}, "max_dumps must be"),
                          ({"devices": ["gpu:7"]}, "device")):
        with pytest.raises((ValueError, vramkit.VramkitError), match=match):
            vramkit.on_oom(tmp_path, **kwargs)
        assert oom.active() is first
    with pytest.raises(ValueError, match="directory"):
        vramkit.on_oom("")
    first.remove()
    assert oom.active() is None and not first.armed


def test_remove_turns_off_the_history_it_turned_on(tmp_path):
    dev = vramkit.sim.create(16 * MiB)
    assert not _C.history_enabled(dev)
    watch = vramkit.on_oom(tmp_path, devices=[dev])
    assert _C.history_enabled(dev)
    watch.remove()
    assert not _C.history_enabled(dev)
    vramkit.record_memory_history(True, device=dev)  # the user's own history is left alone
    vramkit.on_oom(tmp_path, devices=[dev]).remove()
    assert _C.history_enabled(dev)
    vramkit.record_memory_history(False, device=dev)


# --- torch's CUDA caching allocator, its entry points faked ------------------------------------


def test_torchs_observer_writes_a_post_mortem(tmp_path, monkeypatch):
    """torch calls its out-of-memory observers with (device, requested, the memory fraction's cap
    or the device's total, the device's free bytes) before raising (c10's CUDACachingAllocator);
    the snapshot is torch.cuda.memory._snapshot() with an 'oom' event."""
    torch = pytest.importorskip("torch")
    base = 0x7F00_0000_0000
    frames = [ts.frame("/home/user/train.py", 30, "forward")]
    trace = ts.flatten([ts.segment_alloc(base, 20 * MiB), ts.alloc(base, 12 * MiB, frames=frames),
                        [{"action": "oom", "size": 40 * MiB, "device_free": 10 * MiB}]])
    snapshot = ts.snapshot([trace], [ts.segment(base, [ts.live(12 * MiB, 12 * MiB, frames), ts.block(8 * MiB)])])
    attached = []
    monkeypatch.setattr(oom, "_torch_forwarder_attached", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    history = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: history.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: snapshot)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12 * MiB)

    class Props:
        total_memory = 32 * MiB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    out = io.StringIO()
    watch = vramkit.on_oom(tmp_path, stream=out, devices=[])
    assert len(attached) == 1 and history and history[0]["stacks"] == "python"
    attached[0](0, 40 * MiB, 32 * MiB, 10 * MiB)  # what torch's allocator does at the failure
    pm = watch.dumps[0]
    assert (pm.device, pm.allocator, pm.requested, pm.allocated, pm.reserved, pm.total, pm.allowed) == \
        ("cuda:0", "torch", 40 * MiB, 12 * MiB, 20 * MiB, 32 * MiB, None)
    assert pm.sites == [("train.py:30 in forward", 12 * MiB, 1)]
    with open(pm.files["snapshot"], "rb") as f:
        assert pickle.load(f) == snapshot  # torch's snapshot, as torch gave it
    assert "-cuda0-1" in pm.files["snapshot"]
    attached[0](0, 40 * MiB, 24 * MiB, 10 * MiB)  # under set_per_process_memory_fraction: its cap
    assert watch.dumps[1].allowed == 24 * MiB
    assert any("limit set on this device binds (24.0 MiB" in r for r in watch.dumps[1].remedies)
    watch.remove()
    attached[0](0, 40 * MiB, 32 * MiB, 10 * MiB)  # torch cannot detach it: the forwarder finds no watch
    assert len(watch.dumps) == 2


# --- the remedies and the model-state split ----------------------------------------------------


def post_mortem(**kw):
    base = dict(device="cuda:0", allocator="torch", requested=2 * MiB, free=MiB, total=80 * 1024 * MiB,
                allocated=70 * 1024 * MiB, reserved=70 * 1024 * MiB)
    return PostMortem(**{**base, **kw})


def test_fragmentation_is_named_only_when_a_compacted_cache_would_fit_the_request():
    """Live 70 GiB, 2 MiB asked, 1 MiB free on the device: with 3 MiB cached in pieces, a cache in
    one piece would fit it (70 GiB + 2 MiB <= 70 GiB + 3 MiB + 1 MiB); with 0.5 MiB cached it
    would not, and under a limit of 70 GiB + 1 MiB it would not either."""
    assert not any("expandable_segments" in r for r in remedies(post_mortem()))
    frag = remedies(post_mortem(reserved=70 * 1024 * MiB + 3 * MiB))
    assert any(r.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: 3.0 MiB") for r in frag)
    small = remedies(post_mortem(reserved=70 * 1024 * MiB + MiB // 2))
    assert not any("expandable_segments" in r for r in small)
    capped = remedies(post_mortem(reserved=70 * 1024 * MiB + 3 * MiB, allowed=70 * 1024 * MiB + MiB))
    assert not any("expandable_segments" in r for r in capped)
    vramkit_pool = remedies(post_mortem(device="cpu", allocator="vramkit", reserved=70 * 1024 * MiB + 3 * MiB))
    assert any(r.startswith("VRAMKIT_ALLOC_CONF=expandable_segments:True") for r in vramkit_pool)
    on = remedies(post_mortem(reserved=70 * 1024 * MiB + 3 * MiB, message="... Expandable segments are on: ..."))
    assert not any("expandable_segments" in r for r in on)


def test_other_processes_and_an_oversized_request():
    rs = remedies(post_mortem(other_processes=[(4242, "python", 10 * 1024 * MiB, True)]))
    assert any("other processes hold 10.0 GiB of this GPU: pid 4242 (python, stale)" in r for r in rs)
    huge = remedies(post_mortem(requested=100 * 1024 * MiB))
    assert huge[0].startswith("the one request (100.0 GiB) is larger than the whole device")


def test_the_model_state_split_against_the_tensors_themselves():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    params = sum(p.numel() * 4 for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    split = model_state_bytes("cpu", [model], [opt], allocated=10 * MiB)
    assert split == {"parameters": params, "gradients": params, "optimizer state": state,
                     "activations and other": 10 * MiB - 2 * params - state}
    assert model_state_bytes("cuda:0", [model], [opt], allocated=10 * MiB) == {}  # nothing of it there
    rs = remedies(post_mortem(categories={"parameters": 1, "optimizer state": 5, "activations and other": 2}))
    assert any(r.startswith("the optimizer's state is the largest part") for r in rs)


def test_blocks_recorded_without_a_python_frame_are_named_by_the_nearest_frame_not_before_history():
    """Issue 34: on an H100, 14.0 GiB live at a CUDA OOM were listed as "(allocated before the
    recorded history)", though the history held them: blocks made inside an operator with no
    Python on the stack (autograd's backward thread). They are named by the nearest recorded
    frame; only blocks the history never saw made are "before the history"."""
    from vramkit.report.sites import (BEFORE_HISTORY, NO_PYTHON_FRAME, allocation_sites, live_at_oom, live_sites,
                                      replay)
    from vramkit.survive.oom_report import build

    base = 0x7F00_0000_0000
    forward = [ts.frame("/home/user/train.py", 30, "forward")]
    backward_call = [ts.frame("/home/user/train.py", 52, "step")]
    early, act, grad, grad_in = base, base + 2 * MiB, base + 14 * MiB, base + 34 * MiB
    trace = ts.flatten([
        ts.alloc(act, 12 * MiB, frames=forward),               # the forward's activation
        ts.alloc(base + 60 * MiB, 1 * MiB, frames=backward_call),  # loss.backward()'s first gradient
        ts.alloc(grad, 20 * MiB),                               # made on autograd's thread: no frames
        ts.alloc(grad_in, 6 * MiB),
        [{"action": "oom", "size": 40 * MiB, "device_free": 1 * MiB}],
    ])
    blocks = [ts.live(2 * MiB, 2 * MiB), ts.live(12 * MiB, 12 * MiB, forward), ts.live(20 * MiB, 20 * MiB),
              ts.live(6 * MiB, 6 * MiB), ts.block(20 * MiB), ts.live(1 * MiB, 1 * MiB, backward_call)]
    snapshot = ts.snapshot([trace], [ts.segment(early, blocks)])
    near = f"{NO_PYTHON_FRAME} near train.py:52 in step"

    live, from_history = live_at_oom(snapshot)
    assert from_history
    assert live_sites(live) == [(near, 26 * MiB, 2), ("train.py:30 in forward", 12 * MiB, 1),
                                (BEFORE_HISTORY, 2 * MiB, 1), ("train.py:52 in step", 1 * MiB, 1)]
    pm = build({"device": "cuda:0", "requested": 40 * MiB}, snapshot, allocator="torch")
    assert pm.sites[0] == (near, 26 * MiB, 2) and BEFORE_HISTORY not in pm.sites[0][0]
    assert near in pm.text()
    # the peak's sites and the live blocks say the same
    r = replay(snapshot)
    labels = {a.size: a.label for a in r.live_at_peak}
    assert labels == {20 * MiB: near, 6 * MiB: near, 12 * MiB: "train.py:30 in forward", 2 * MiB: BEFORE_HISTORY,
                      1 * MiB: "train.py:52 in step"}
    sites = {s.label: (s.live_at_peak, s.count) for s in allocation_sites(snapshot, replayed=r)}
    assert sites[near] == (26 * MiB, 2) and sites[BEFORE_HISTORY] == (2 * MiB, 1)
    # at the history's start, the first frame recorded after the block is the nearest
    first = ts.flatten([ts.alloc(grad, 20 * MiB), ts.alloc(act, 12 * MiB, frames=forward)])
    snap2 = ts.snapshot([first], [ts.segment(early, blocks[:3] + [ts.block(58 * MiB)])])
    assert {a.size: a.label for a in replay(snap2).live_at_peak}[20 * MiB] == \
        f"{NO_PYTHON_FRAME} near train.py:30 in forward"
