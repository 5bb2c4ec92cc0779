"""vramkit's drop-ins installed in torch's place, as users install them to reach the calls a
library makes through torch's names: ``torch.utils.checkpoint.checkpoint`` /
``checkpoint_sequential`` = vramkit's, ``torch.amp.GradScaler`` (and its aliases) = vramkit's.
Code that calls torch's names (a module of its own, a Hugging Face model with activation
checkpointing, a training loop with a GradScaler) then runs vramkit's, and its results are
compared with the same code run on torch's own objects, kept here before anything is installed.
Looking torch's function up at call time made every such call end in RecursionError."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.utils.checkpoint as tuc  # noqa: E402

import vramkit.amp  # noqa: E402
import vramkit.checkpoint  # noqa: E402
from vramkit.checkpoint import function as vk_function  # noqa: E402

# torch's own objects, the reference: kept before any test installs a drop-in.
TORCH_CHECKPOINT = tuc.checkpoint
TORCH_CHECKPOINT_SEQUENTIAL = tuc.checkpoint_sequential
TORCH_GRAD_SCALER = torch.amp.GradScaler
TORCH_CUDA_GRAD_SCALER = torch.cuda.amp.GradScaler


@pytest.fixture(autouse=True)
def torch_own_objects_at_start(one_torch_thread):
    """Each test starts from torch's own objects (another test leaving a drop-in behind would
    make the reference runs vramkit's too)."""
    assert TORCH_CHECKPOINT.__module__ == TORCH_CHECKPOINT_SEQUENTIAL.__module__ == "torch.utils.checkpoint"
    assert TORCH_GRAD_SCALER.__module__ == "torch.amp.grad_scaler"
    assert tuc.checkpoint is TORCH_CHECKPOINT and tuc.checkpoint_sequential is TORCH_CHECKPOINT_SEQUENTIAL
    assert torch.amp.GradScaler is TORCH_GRAD_SCALER


@pytest.fixture
def checkpoint_installed(monkeypatch):
    monkeypatch.setattr(tuc, "checkpoint", vramkit.checkpoint.checkpoint)
    monkeypatch.setattr(tuc, "checkpoint_sequential", vramkit.checkpoint.checkpoint_sequential)


@pytest.fixture
def torch_calls(monkeypatch):
    """How many times vramkit's checkpoint called torch's (through the function it bound): 0 when
    a run never reached vramkit's."""
    calls = []
    bound = vk_function.torch_own_checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return bound(*args, **kwargs)

    monkeypatch.setattr(vk_function, "torch_own_checkpoint", counted)
    return calls


# ---- checkpoint and checkpoint_sequential through torch's names -------------------------------------

class Blocks(torch.nn.Module):
    """User code that checkpoints each block through torch's name, looked up at call time."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 8))
            for _ in range(3))

    def forward(self, x, use_reentrant):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
        return x


def _blocks_grads(use_reentrant: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = Blocks(seed=0)
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    loss = model(x, use_reentrant).square().sum()  # dropout inside: the recomputation must replay its RNG
    loss.backward()
    return loss.detach(), [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_module_calling_torchs_checkpoint_gets_vramkits_and_torchs_gradients(
        use_reentrant, checkpoint_installed, torch_calls):
    loss, grads = _blocks_grads(use_reentrant)
    assert len(torch_calls) == 3  # each block went through vramkit's checkpoint to torch's
    with pytest.MonkeyPatch.context() as mp:  # the same code on torch's own function
        mp.setattr(tuc, "checkpoint", TORCH_CHECKPOINT)
        ref_loss, ref_grads = _blocks_grads(use_reentrant)
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) == 13
    for g, ref in zip(grads, ref_grads):
        assert torch.equal(g, ref)


def test_torchs_name_now_runs_vramkits_checks(checkpoint_installed):
    """What shows the call reached vramkit: torch takes use_reentrant="yes" as true, vramkit refuses it."""
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="use_reentrant must be True, False or None"):
        torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant="yes")
    TORCH_CHECKPOINT(torch.sin, x, use_reentrant="yes").sum().backward()  # torch's own accepts it
    assert torch.equal(x.grad, torch.cos(x.detach()))


def _chain_grads() -> list[torch.Tensor]:
    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(3, 6, requires_grad=True)
    torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_checkpoint_sequential_through_torchs_name_matches_torchs(checkpoint_installed, torch_calls):
    grads = _chain_grads()
    # torch's checkpoint_sequential, which vramkit's runs, calls checkpoint through torch's name:
    # the installed vramkit checkpoint, which calls torch's (once per checkpointed segment)
    assert len(torch_calls) == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuc, "checkpoint", TORCH_CHECKPOINT)
        mp.setattr(tuc, "checkpoint_sequential", TORCH_CHECKPOINT_SEQUENTIAL)
        ref = _chain_grads()
    assert len(grads) == len(ref) == 9
    for g, r in zip(grads, ref):
        assert torch.equal(g, r)


def test_torchs_default_is_read_from_torchs_own_functions(checkpoint_installed):
    """use_reentrant omitted: vramkit runs torch's functions once to learn their default and
    warning. With the drop-ins installed that probe must still reach torch's own."""
    vk_function.torch_default.cache_clear()
    try:
        x = torch.ones(2, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.utils.checkpoint.checkpoint(torch.sin, x).sum().backward()
            torch.utils.checkpoint.checkpoint_sequential([torch.sin, torch.cos], 2, x).sum().backward()
    finally:
        vk_function.torch_default.cache_clear()
    x0 = x.detach()
    assert torch.allclose(x.grad, torch.cos(x0) - torch.sin(torch.sin(x0)) * torch.cos(x0))
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        TORCH_CHECKPOINT(torch.sin, torch.ones(2, requires_grad=True))
    assert {str(w.message) for w in theirs} <= {str(w.message) for w in caught}


def test_importing_vramkits_module_again_with_the_drop_in_installed_binds_torchs_own(checkpoint_installed):
    """A harness that drops vramkit's modules but keeps torch's imports them again with vramkit's
    checkpoint in torch's place: the new module must bind the torch function that drop-in calls,
    not the drop-in (which would recurse). A second copy of the module is loaded from its file."""
    spec = importlib.util.spec_from_file_location("vramkit_function_imported_again", vk_function.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert tuc.checkpoint is vramkit.checkpoint.checkpoint
    assert again.torch_own_checkpoint is TORCH_CHECKPOINT
    assert again.torch_own_checkpoint_sequential is TORCH_CHECKPOINT_SEQUENTIAL
    x = torch.ones(2, requires_grad=True)
    again.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


# ---- a Hugging Face model with activation checkpointing ---------------------------------------------

def _tiny_llama(transformers):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)  # random weights


def _hf_grads(transformers) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _tiny_llama(transformers)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient_checkpointing_enable's deprecation, where it is the alias
        enable()
    model.train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_hugging_face_model_checkpoints_through_vramkit(torch_calls, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as hf_modeling

    # transformers binds torch's checkpoint when it is imported (from torch.utils.checkpoint
    # import checkpoint), so a user installs vramkit's before importing transformers. transformers
    # is imported first here (the session may have imported it already), and the name it bound
    # is set as that import would have set it.
    assert hf_modeling.checkpoint is TORCH_CHECKPOINT
    monkeypatch.setattr(tuc, "checkpoint", vramkit.checkpoint.checkpoint)
    monkeypatch.setattr(tuc, "checkpoint_sequential", vramkit.checkpoint.checkpoint_sequential)
    monkeypatch.setattr(hf_modeling, "checkpoint", tuc.checkpoint)
    loss, grads = _hf_grads(transformers)
    assert len(torch_calls) == 3  # one per decoder layer, through vramkit's checkpoint
    monkeypatch.setattr(hf_modeling, "checkpoint", TORCH_CHECKPOINT)
    ref_loss, ref = _hf_grads(transformers)
    assert len(torch_calls) == 3  # the reference run never reached vramkit
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys() and all(g is not None for g in grads.values())
    for name, g in grads.items():
        assert torch.equal(g, ref[name]), name


# ---- GradScaler in torch's place ---------------------------------------------------------------------

def _train_with_scaler(steps: int = 12, overflow_at: tuple[int, ...] = (3, 4, 9)) -> dict:
    """A training loop as users write it, through torch's name; a gradient is made inf at some
    steps, so the scaler must skip those steps and back off."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    data = torch.randn(steps, 6, 5, generator=torch.Generator().manual_seed(5))
    scales = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(data[step]).square().mean()
        scaler.scale(loss).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"kind": type(scaler), "scales": scales, "params": [p.detach().clone() for p in model.parameters()]}


def test_grad_scaler_in_torchs_place_trains_as_torchs(monkeypatch):
    reference = _train_with_scaler()
    assert reference["kind"] is TORCH_GRAD_SCALER
    monkeypatch.setattr(torch.amp, "GradScaler", vramkit.amp.GradScaler)
    monkeypatch.setattr(torch, "GradScaler", vramkit.amp.GradScaler)
    ours = _train_with_scaler()
    assert ours["kind"] is vramkit.amp.GradScaler
    assert ours["scales"] == reference["scales"]
    assert len(set(reference["scales"])) > 2  # it did back off and grow: the comparison covers both
    for p, r in zip(ours["params"], reference["params"]):
        assert torch.equal(p, r)


def test_the_deprecated_cuda_alias_in_torchs_place_disabled_as_users_write_it(monkeypatch):
    """``torch.cuda.amp.GradScaler(enabled=use_amp)``, with use_amp False on a CPU run: the
    scaler passes everything through, and training is plain SGD, as with torch's."""
    def train(kind: type) -> list[torch.Tensor]:
        torch.manual_seed(6)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.cuda.amp.GradScaler(enabled=False)
        assert type(scaler) is kind
        for step in range(4):
            opt.zero_grad()
            loss = model(torch.full((2, 4), float(step))).sum()
            scaled = scaler.scale(loss)
            assert scaled is loss
            scaled.backward()
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.GradScaler is deprecated
        reference = train(TORCH_CUDA_GRAD_SCALER)
        monkeypatch.setattr(torch.cuda.amp, "GradScaler", vramkit.amp.GradScaler)
        ours = train(vramkit.amp.GradScaler)
    for p, r in zip(ours, reference):
        assert torch.equal(p, r)


def test_the_cuda_alias_called_with_init_scale_first_is_refused_not_misread(monkeypatch):
    """torch.cuda.amp.GradScaler's first parameter is init_scale; vramkit's is the device. Installed
    in its place, GradScaler(2.0 ** 10) must not become a scaler at the default scale."""
    monkeypatch.setattr(torch.cuda.amp, "GradScaler", vramkit.amp.GradScaler)
    with pytest.raises(TypeError, match=r"device must be None, 'cpu', 'cuda' or 'cuda:N'.*got float 1024\.0.*"
                                        r"init_scale= and the others by keyword"):
        torch.cuda.amp.GradScaler(2.0 ** 10)
    assert torch.cuda.amp.GradScaler(init_scale=2.0 ** 10, enabled=False).get_scale() == 1.0  # torch's: 1.0 when off
    assert vramkit.amp.GradScaler(torch.device("cpu"), init_scale=8.0).get_scale() == 8.0
