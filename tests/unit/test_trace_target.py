"""One target GPU, resolved once (vramkit.trace.target.gpu_profiles.resolve_target).

Every entry point that predicts for a GPU takes it as `gpu` alone and predicts on that GPU's
memory (the bug this replaced: ``fit(build, gpu="H100-80GB")`` replayed on 24 GiB); a missing
GPU is the same ``TargetError`` everywhere; ``vramkit fit`` resolves its flags once and hands
the ``Target`` down; the public names are the implementations, with their real signatures."""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import pytest

import vramkit.trace as vt
from vramkit.trace.target import gpu_profiles
from vramkit.trace.target.gpu_profiles import CLI, NCCL_DEFAULT, PROFILES, Target, TargetError, resolve_target

torch = pytest.importorskip("torch")

GiB, MiB = 1 << 30, 1 << 20
H100 = PROFILES["H100-80GB"]
TESTS = Path(__file__).resolve().parents[1]


def adam_on(gib: float):
    """A builder whose step holds about 5 x `gib` GiB (parameter, gradient, Adam's two states and
    foreach Adam's temporary), on meta: more than 24 GiB and less than an H100 for gib=6."""
    def build(batch_size: int):
        w = torch.nn.Parameter(torch.empty(int(gib * GiB) // 4))
        opt = torch.optim.Adam([w], lr=1e-3)
        x = torch.empty(batch_size, 1024)

        def step():
            (w[:1024] * x).sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def test_fit_with_only_gpu_predicts_on_that_gpus_memory():
    build = adam_on(6)
    on_h100 = vt.fit(build, gpu="H100-80GB", batch_size=1, search=False)
    assert on_h100.capacity == on_h100.target.capacity == H100.capacity
    assert on_h100.target.usable == H100.capacity - H100.cuda_context
    assert on_h100.fits, on_h100.table()  # about 30 GiB: fits 80 GiB ...
    assert not vt.fit(build, "24GiB", batch_size=1, search=False).fits  # ... but not the 24 GiB it used to get
    assert on_h100.trace(1).meta["cuda_choices"]["arch"] == "9.0"  # the captures make Hopper's choices
    a100 = vt.fit(build, gpu="a100-40gb", batch_size=1, search=False)
    assert a100.capacity == PROFILES["A100-40GB"].capacity and a100.trace(1).meta["cuda_choices"]["arch"] == "8.0"


def test_replay_with_only_gpu_uses_the_profile():
    t = vt.capture(adam_on(0.001), 1, steps=2)
    pred = vt.replay(t, gpu="L4")
    assert pred.capacity == PROFILES["L4"].capacity and pred.gpu.name == "L4"
    assert pred.overheads == PROFILES["L4"].overheads()


def test_the_sharded_entry_points_with_only_gpu():
    sys.path.insert(0, str(TESTS / "unit"))
    import sharded_models

    def build(bs):
        return sharded_models.builder("gpt", "fsdp2", batch=bs)()

    report = vt.predict_ranks(build, 2, world_size=2, gpu="A100-40GB", ranks=[0])
    assert report.capacity == PROFILES["A100-40GB"].capacity
    assert report.predictions[0].overheads.nccl == NCCL_DEFAULT  # a distributed job: NCCL's line item
    assert report.predictions[0].usable == PROFILES["A100-40GB"].capacity - 512 * MiB - NCCL_DEFAULT
    answer = vt.smallest_world_size(build, 2, gpu="A100-40GB", limit=2)
    assert answer.capacity == PROFILES["A100-40GB"].capacity and answer.world_size == 1
    assert all(p.capacity == answer.capacity and p.overheads.nccl == NCCL_DEFAULT for p in answer.tried.values())


def test_a_missing_gpu_is_one_error_everywhere():
    t = vt.Trace.from_columns(kind=[0, 1], id=[0, 0], size=[MiB, 0])
    calls = {"replay": lambda: vt.replay(t, None), "fit": lambda: vt.fit(adam_on(0.001), None),
             "predict_ranks": lambda: vt.predict_ranks(adam_on(0.001), 1, world_size=2, gpu=None),
             "smallest_world_size": lambda: vt.smallest_world_size(adam_on(0.001), 1, gpu=None),
             "resolve_target": lambda: resolve_target(None)}
    messages = set()
    for name, call in calls.items():
        with pytest.raises(TargetError) as info:
            call()
        messages.add(str(info.value))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("say which GPU: gpu=NAME (H100-80GB, ") and "gpu=SIZE (e.g. gpu='80GiB')" in message
    assert issubclass(TargetError, ValueError) and issubclass(TargetError, TypeError)  # what callers caught before
    with pytest.raises(TypeError, match="required.*'gpu'"):  # no default: Python's own error for a missing argument
        vt.replay(t)  # type: ignore[call-arg]


def test_errors_are_worded_for_the_caller():
    cli = str(pytest.raises(TargetError, resolve_target, None, spelling=CLI).value)
    assert cli.startswith("say which GPU: --gpu NAME (") and "--device-memory SIZE (e.g. 80GiB)" in cli
    for spelling, memory in ((gpu_profiles.PYTHON, "gpu=SIZE"), (CLI, "--device-memory SIZE")):
        err = pytest.raises(TargetError, resolve_target, "B200", spelling=spelling).value
        assert "unknown GPU 'B200'" in str(err) and f"give its memory with {memory}" in str(err)
    assert "'24 GB' is ambiguous" in str(pytest.raises(TargetError, resolve_target, "24 GB").value)
    err = pytest.raises(TargetError, resolve_target, "H100-80GB", capacity="lots", spelling=CLI).value
    assert str(err).startswith("--device-memory 'lots' is not a size")
    with pytest.raises(TargetError, match="A100-80GB or A100-40GB"):
        resolve_target("a100")
    with pytest.raises(TargetError, match="got list"):
        resolve_target(["H100"])
    with pytest.raises(TargetError, match="leaves nothing once 512.00 MiB"):
        resolve_target("100MiB")


def test_resolve_target_carries_everything_once():
    h100 = resolve_target("h100")
    assert (h100.name, h100.capacity, h100.arch, h100.given) == ("H100-80GB", H100.capacity, (9, 0), frozenset())
    assert h100.overheads == H100.overheads() and h100.cuda_choices().arch == (9, 0) and h100.bf16
    assert resolve_target(h100) is h100  # a Target resolves to itself
    slice_ = resolve_target("H100-80GB", capacity="40GiB", overheads={"cuda_context": 0}, alloc_conf={"a": True})
    assert slice_.capacity == 40 * GiB and slice_.arch == (9, 0) and slice_.alloc_conf == "a:True"
    assert slice_.overheads == H100.overheads(cuda_context=0) and slice_.given == {"cuda_context"}
    ranks = resolve_target(slice_, world_size=8)
    assert ranks.overheads.nccl == NCCL_DEFAULT and resolve_target(ranks, world_size=8) == ranks  # added once
    assert resolve_target("24GiB", overheads={"nccl": 0}, world_size=8).overheads.nccl == 0  # the caller's stays
    bare = resolve_target(24 * GiB)
    assert bare.arch is None and bare.name == "24.00 GiB" and bare.describe() == "24.00 GiB"
    assert bare.overheads == vt.GpuOverheads() and bare.cuda_choices() == vt.CudaChoices()
    assert not resolve_target(vt.GpuProfile("T4", 15 * GiB, (7, 5))).bf16


def test_the_command_resolves_its_flags_once_and_hands_the_target_down(tmp_path, monkeypatch):
    """`vramkit fit --world-size 2`: one resolution of what the flags say; predict_ranks, fit,
    smallest_world_size and replay are each given the Target."""
    from vramkit.commands import main as cli
    from vramkit.trace.fitting import fit_search, sharded_fit
    from vramkit.trace.replaying import replay_sim

    seen: list[str] = []
    real = resolve_target

    def counting(gpu, **kwargs):
        seen.append("target" if isinstance(gpu, Target) else repr(gpu))
        return real(gpu, **kwargs)

    for module in (gpu_profiles, fit_search, sharded_fit, replay_sim):
        monkeypatch.setattr(module, "resolve_target", counting)
    (tmp_path / "sharded.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS / "unit")!r})
        import sharded_models

        def vramkit_step(batch_size):
            return sharded_models.builder("gpt", "fsdp2", batch=batch_size)()
    """))
    status = cli.main(["fit", str(tmp_path / "sharded.py"), "--gpu", "A100-40GB", "--world-size", "2",
                       "--batch-size", "2", "--no-search", "--max-world-size", "2",
                       "--html", str(tmp_path / "out.html")])
    assert status == 0
    assert seen[0] == "'A100-40GB'" and set(seen[1:]) == {"target"} and len(seen) > 3, seen


def test_the_public_names_are_the_implementations():
    for name in vt.__all__:
        obj = getattr(vt, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__.startswith("vramkit."), (name, obj.__module__)
            assert obj.__module__ != "vramkit.trace", f"vramkit.trace.{name} is a wrapper defined in __init__"
    for name in ("fit", "replay", "predict_ranks", "smallest_world_size", "load", "from_torch_snapshot"):
        params = inspect.signature(getattr(vt, name)).parameters.values()  # no **kwargs passed on unseen
        assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params), (name, list(params))
    capture = inspect.signature(vt.capture).parameters  # its *args and **kwargs are the step's own
    assert {"device", "steps", "checkpoint_blocks", "autocast", "cuda", "world_size", "rank"} <= set(capture)
    assert list(inspect.signature(vt.fit).parameters)[:3] == ["build", "gpu", "batch_size"]
    assert "gpu" in inspect.signature(vt.predict_ranks).parameters
    assert inspect.signature(vt.replay).parameters["gpu"].default is inspect.Parameter.empty
