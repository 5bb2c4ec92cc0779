"""vramkit in Lightning (``vramkit.integrations.lightning``), on the CPU with a tiny GPT-2 of
random weights inside a LightningModule: the figures are columns of CSVLogger's metrics.csv;
the first step's breakdown goes through rank_zero_info; a forced out-of-memory writes the
post-mortem and ``on_exception`` disarms the run's watch; a real leak is warned about with its
line, and a run without one is not; ``scale_batch_size`` against Lightning's own ``Tuner`` in
both its modes, on the same module; bad input.

Expected figures are computed here from the model's and optimizer's tensors, never read back
from vramkit's own code."""

from __future__ import annotations

import csv
import logging
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

import vramkit  # noqa: E402
from vramkit import _C  # noqa: E402
from vramkit.integrations.lightning import VramCallback, scale_batch_size  # noqa: E402
from vramkit.integrations.step_memory import MemoryGrowthWarning  # noqa: E402
from vramkit.report.sites import format_bytes  # noqa: E402
from vramkit.survive import oom  # noqa: E402

MiB = 1 << 20
HERE = os.path.basename(__file__)
VOCAB, SEQ = 128, 16
OOM_ABOVE = 100


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of" not in line)


@pytest.fixture(autouse=True)
def quiet_and_clean(one_torch_thread):
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger).*")
        yield
    watch = oom.active()
    if watch is not None:
        watch.remove()
    _C._drain_oom_queue()


class GPT(L.LightningModule):
    """A tiny GPT-2 whose train_dataloader reads self.batch_size, as Lightning's tuner expects.
    `fails_above`: a deterministic fake device, whose batches above that size raise torch's
    out-of-memory error; `on_forward`: called with the block output at each forward."""

    def __init__(self, fails_above=None, on_forward=None, n=256):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                         bos_token_id=0, eos_token_id=0)
        self.model = transformers.GPT2LMHeadModel(config)
        self.batch_size, self.fails_above, self.on_forward = 8, fails_above, on_forward
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
        self.sizes = []
        if on_forward is not None:
            self.model.transformer.h[0].register_forward_hook(lambda m, a, out: on_forward(out))

    def training_step(self, batch, index):
        self.sizes.append(batch.shape[0])
        if self.fails_above is not None and batch.shape[0] > self.fails_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.ids, batch_size=self.batch_size)


def make_trainer(tmp_path, callbacks=(), **kw):
    defaults = dict(max_steps=6, log_every_n_steps=2, logger=False, enable_progress_bar=False,
                    enable_checkpointing=False, enable_model_summary=False, accelerator="cpu",
                    default_root_dir=str(tmp_path))
    return L.Trainer(callbacks=list(callbacks), **{**defaults, **kw})


def state_bytes(model, optimizer=None, grads=False):
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    total = params * (2 if grads else 1)
    if optimizer is not None:
        total += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    return total


# --- figures in the framework's logs -----------------------------------------------------------


def test_figures_are_columns_of_the_csv_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = GPT()
    trainer = make_trainer(tmp_path, [VramCallback()], logger=CSVLogger(str(tmp_path / "logs")))
    trainer.fit(module)
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("vram/allocated_mib")]
    # Written at each of Lightning's logging steps (steps 2, 4, 6, which its CSV counts from 0).
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    # Grads are live at the end of a Lightning step (it zeroes them at the next one).
    live = state_bytes(module, trainer.optimizers[0], grads=True)
    for r in rows:
        # (Lightning hands the logger float32 values: 7 significant digits.)
        assert live * (1 - 1e-6) <= float(r["vram/allocated_mib"]) * MiB <= live + 64 * 1024
        assert float(r["vram/peak_allocated_mib"]) >= float(r["vram/allocated_mib"])
    assert "vram/reserved_mib" not in rows[0] and "vram/fragmentation" not in rows[0]  # none on the CPU


def test_the_first_step_breakdown_goes_to_lightnings_log(tmp_path, caplog):
    module = GPT()
    trainer = make_trainer(tmp_path, [VramCallback()], max_steps=2)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(module)
    messages = [r.getMessage() for r in caplog.records if "vramkit: memory after the first" in r.getMessage()]
    assert len(messages) == 1
    params = state_bytes(module)
    # After the first step: its gradients and the AdamW state of one step are live.
    opt_state = state_bytes(module, trainer.optimizers[0]) - params
    assert (f"parameters {format_bytes(params)}, gradients {format_bytes(params)}, "
            f"optimizer state {format_bytes(opt_state)}") in messages[0]


# --- the out-of-memory post-mortem -------------------------------------------------------------


def test_a_forced_out_of_memory_writes_the_post_mortem_and_disarms(tmp_path, capfd):
    calls = []

    def grab(output):
        calls.append(1)
        if len(calls) == 3:
            vramkit.empty(64 * MiB, device="cpu")  # from vramkit's cpu pool, under the limit below

    module = GPT(on_forward=grab)
    callback = VramCallback()
    trainer = make_trainer(tmp_path, [callback])
    vramkit.set_memory_limit(16 * MiB, "cpu")
    try:
        with pytest.raises(vramkit.OutOfMemoryError):
            trainer.fit(module)
    finally:
        vramkit.set_memory_limit(None, "cpu")
    assert oom.active() is None  # on_exception handed the report over and disarmed the run's watch
    files = sorted(os.listdir(tmp_path / "vramkit-oom"))
    assert len(files) == 2 and files[0].endswith("-cpu-1.html") and files[1].endswith("-cpu-1.pickle")
    screen = capfd.readouterr().err
    # Third step's forward: Lightning zeroes gradients after the forward, so the second step's are live.
    parts = (f"by what it is: parameters {format_bytes(state_bytes(module))}, gradients "
             f"{format_bytes(state_bytes(module))}, optimizer state ")
    assert "=== vramkit: out of memory on cpu ===" in screen and parts in screen


# --- the leak watch ----------------------------------------------------------------------------


def fit_keeping(tmp_path, keep):
    kept = []

    def on_forward(output):
        if keep:
            kept.append(output[0].detach().clone())  # LEAK-LINE

    trainer = make_trainer(tmp_path, [VramCallback(check_every=5)], max_steps=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(GPT(on_forward=on_forward))
    return [w for w in caught if issubclass(w.category, MemoryGrowthWarning)], kept


def test_a_leak_across_steps_is_warned_about_with_its_line(tmp_path):
    found, kept = fit_keeping(tmp_path, keep=True)
    assert len(found) == 1 and len(kept) == 5
    text = str(found[0].message)
    per_step = kept[0].numel() * kept[0].element_size()
    assert "memory grew across training steps 1-5" in text and f"+{per_step / 1024:.2f} KiB per step" in text
    assert f"{HERE}:{line_of('LEAK-LINE')} (on_forward)" in text


def test_a_run_without_a_leak_gives_no_warning(tmp_path):
    found, _ = fit_keeping(tmp_path, keep=False)
    assert found == []


# --- the batch size ----------------------------------------------------------------------------


def test_the_search_finds_the_largest_and_lightnings_tuner_does_not(tmp_path):
    """The same module, the same fake limit (100): vramkit's search, then Lightning's Tuner in
    both modes (binsearch with its default 5 % margin and without)."""
    from lightning.pytorch.tuner import Tuner

    module = GPT(fails_above=OOM_ABOVE, n=300)  # 3 batches of 100 an epoch
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(tmp_path / "ours")
    result = scale_batch_size(trainer, module)
    assert result.batch_size == OOM_ABOVE == module.batch_size
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # the trials left no trace
    theirs = {}
    for mode, margin in (("power", 0.05), ("binsearch", 0.05), ("binsearch", 0.0)):
        other = GPT(fails_above=OOM_ABOVE)
        tuner = Tuner(make_trainer(tmp_path / f"{mode}{margin}"))
        theirs[mode, margin] = tuner.scale_batch_size(other, mode=mode, margin=margin, max_trials=25)
        assert other.batch_size == theirs[mode, margin]
    assert theirs == {("power", 0.05): 64, ("binsearch", 0.05): 95, ("binsearch", 0.0): OOM_ABOVE}
    assert result.batch_size >= max(theirs.values())
    text = str(result)
    assert text.startswith(f"largest batch size that fits on cpu (torch tensors: no allocator counters, no peak): "
                           f"{OOM_ABOVE}")
    assert "scale_batch_size(mode='power') from 2 would keep 64" in text
    module.sizes.clear()
    trainer.fit(module)
    assert set(module.sizes) == {OOM_ABOVE}


def test_the_search_keeps_the_effective_batch(tmp_path):
    module = GPT(fails_above=OOM_ABOVE, n=480)
    trainer = make_trainer(tmp_path, max_steps=1)
    result = scale_batch_size(trainer, module, effective_batch_size=240)
    assert (result.batch_size, result.accumulation_steps) == (80, 3)
    assert result.knobs == {"batch_size": 80, "accumulate_grad_batches": 3}
    assert trainer.accumulate_grad_batches == 3 and all(240 % a.batch_size == 0 for a in result.attempts)
    module.sizes.clear()
    trainer.fit(module)
    assert module.sizes == [80, 80, 80] and trainer.global_step == 1


def test_bad_input_names_what_is_wrong(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(TypeError, match="expected a Lightning Trainer"):
        scale_batch_size(object(), GPT())
    with pytest.raises(TypeError, match="expected a LightningModule"):
        scale_batch_size(trainer, torch.nn.Linear(2, 2))
    with pytest.raises(AttributeError, match="no 'micro_batch' on the model, in its hparams or on the datamodule"):
        scale_batch_size(trainer, GPT(), batch_arg_name="micro_batch")
    with pytest.raises(ValueError, match="divides effective_batch_size=100 and is a multiple of 16"):
        scale_batch_size(trainer, GPT(), effective_batch_size=100, multiple_of=16, max_batch_size=64)
    with pytest.raises(ValueError, match="margin needs the peak memory"):
        scale_batch_size(trainer, GPT(), margin=0.1)
    with pytest.raises(TypeError, match="leak_check must be True or False"):
        VramCallback(leak_check="yes")


def test_the_default_cap_is_lightnings_own_tuners():
    """A Lightning user's tuner never tries more than its max_val (8192 in Lightning 2.6);
    scale_batch_size's default cap, and what its docstring says, is the same: a Lightning that
    changes its default fails here, so that both are updated together."""
    import inspect

    from lightning.pytorch.tuner import Tuner

    theirs = inspect.signature(Tuner.scale_batch_size).parameters.get("max_val")
    ours = inspect.signature(scale_batch_size).parameters["max_batch_size"].default
    if theirs is None:
        pytest.skip("this Lightning's Tuner.scale_batch_size has no max_val")
    assert ours == theirs.default == 8192
    assert "8192" in (scale_batch_size.__doc__ or "") and "max_val" in (scale_batch_size.__doc__ or "")
