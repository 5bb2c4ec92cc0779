"""vramkit in Hugging Face's Trainer (``vramkit.integrations.transformers``), on the CPU with a
tiny GPT-2 of random weights (nothing downloaded): the figures reach ``state.log_history``, a
real TensorBoard event file and the console; the first step's breakdown; a forced out-of-memory
writes the post-mortem; a real leak is warned about with its line, and a run without one is not;
the batch-size search against the Trainer's own ``auto_find_batch_size`` (accelerate's
``find_executable_batch_size``) on the same model; bad input.

Expected figures are computed here from the model's and optimizer's tensors, never read back
from vramkit's own code."""

from __future__ import annotations

import glob
import io
import os
import struct
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import vramkit  # noqa: E402
from vramkit import _C  # noqa: E402
from vramkit.integrations import transformers as vhf  # noqa: E402
from vramkit.integrations.step_memory import MemoryGrowthWarning  # noqa: E402
from vramkit.report.sites import format_bytes  # noqa: E402
from vramkit.survive import oom  # noqa: E402

MiB = 1 << 20
HERE = os.path.basename(__file__)
VOCAB, SEQ = 128, 16
OOM_ABOVE = 100  # the fake device fits batches of up to 100 sequences: not a power of two


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of" not in line)


@pytest.fixture(autouse=True)
def quiet_and_clean(one_torch_thread):
    transformers.logging.set_verbosity_error()
    yield
    watch = oom.active()
    if watch is not None:
        watch.remove()
    _C._drain_oom_queue()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def make_trainer(tmp_path, model=None, n=256, **args):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=6, logging_steps=2,
                    report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    targs = transformers.TrainingArguments(**{**defaults, **args})
    return transformers.Trainer(model=model or tiny_gpt2(), args=targs, train_dataset=Tokens(n))


def state_bytes(model, optimizer=None, grads=False):
    """Parameters (tied ones once), their gradients and the optimizer's state, from the tensors."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    total = sum(params.values()) * (2 if grads else 1)
    if optimizer is not None:
        total += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    return total


def scalars_in_event_file(directory):
    """{tag: [values]} from TensorBoard event files, read record by record (TFRecord framing:
    length, its CRC, the Event protobuf, its CRC) with tensorboardX's own Event message."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True):
        data = open(path, "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(value.simple_value)
    return out


# --- figures in the framework's logs -----------------------------------------------------------


def test_figures_reach_log_history_tensorboard_and_the_console(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # read by HF's TensorBoardCallback
    trainer = make_trainer(tmp_path, report_to=["tensorboard"])
    vhf.attach(trainer, stream=io.StringIO())
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4, 6]
    live_state = state_bytes(trainer.model, trainer.optimizer)  # after zero_grad: no gradients
    for entry in logged:
        assert set(entry) >= {"vram/allocated_mib", "vram/peak_allocated_mib"}
        # On the CPU there is no cache, hence no reserved memory and no fragmentation to report.
        assert not {"vram/reserved_mib", "vram/fragmentation"} & set(entry)
        # At the end of a step: parameters and optimizer state, and little else (a loss scalar...).
        assert live_state <= entry["vram/allocated_mib"] * MiB <= live_state + 64 * 1024
        # The peak holds a batch's activations and the gradients besides.
        assert entry["vram/peak_allocated_mib"] * MiB > state_bytes(trainer.model, trainer.optimizer, grads=True)
    # A real TensorBoard file (HF's TensorBoardCallback prefixes "train/"), at each logging step.
    scalars = scalars_in_event_file(str(tmp_path / "tb"))
    assert scalars["train/vram/allocated_mib"] == pytest.approx([e["vram/allocated_mib"] for e in logged])
    assert scalars["train/vram/peak_allocated_mib"] == pytest.approx([e["vram/peak_allocated_mib"] for e in logged])
    # The console printer (disable_tqdm=True) prints each log dict.
    assert capsys.readouterr().out.count("'vram/allocated_mib'") == 3
    summary = trainer.state.log_history[-1]  # the end-of-training summary carries no step figures
    assert "train_runtime" in summary and "vram/allocated_mib" not in summary


def test_a_callback_added_after_the_reporters_says_how_to_add_it(tmp_path, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer = make_trainer(tmp_path, report_to=["tensorboard"], max_steps=1)
    trainer.add_callback(vhf.VramCallback(stream=io.StringIO()))
    with pytest.warns(RuntimeWarning, match=r"report_to \(tensorboard\).*attach\(trainer\)"):
        trainer.train()


def test_gpu_figures_come_from_torch_cuda_counters(tmp_path, monkeypatch):
    """On a CUDA device the figures are torch.cuda's counters (faked here: no GPU)."""
    counters = {"memory_allocated": 300 * MiB, "memory_reserved": 400 * MiB, "max_memory_allocated": 350 * MiB,
                "max_memory_reserved": 420 * MiB}
    for name, value in counters.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    callback = vhf.VramCallback(leak_check=False, breakdown=False, oom=False)

    class Args:
        device = torch.device("cuda:0")
        output_dir = str(tmp_path)
        report_to: list[str] = []

    callback.on_train_begin(Args, None, None, model=torch.nn.Linear(2, 2), optimizer=None)
    logs = {"loss": 1.0}

    class State:
        log_history = [{"loss": 1.0, "step": 3}]
        global_step = 3

    callback.on_log(Args, State, None, logs=logs)
    assert logs == {"loss": 1.0, "vram/allocated_mib": 300.0, "vram/reserved_mib": 400.0,
                    "vram/peak_allocated_mib": 350.0, "vram/peak_reserved_mib": 420.0,
                    "vram/fragmentation": 0.25}
    assert State.log_history[-1] == {**logs, "step": 3}
    callback.on_train_end(Args, State, None)


# --- the first step's breakdown ----------------------------------------------------------------


def test_the_first_step_breakdown_names_each_part(tmp_path):
    out = io.StringIO()
    trainer = make_trainer(tmp_path, max_steps=2)
    vhf.attach(trainer, stream=out)
    seen = {}

    class Look(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 0:  # the first step, gradients still there
                seen["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
                seen["state"] = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())

    trainer.add_callback(Look())
    trainer.train()
    text = out.getvalue()
    params = state_bytes(trainer.model)
    assert text.count("vramkit: memory after the first training step (cpu, live tensors") == 1
    assert (f"parameters {format_bytes(params)}, gradients {format_bytes(seen['grads'])}, "
            f"optimizer state {format_bytes(seen['state'])}") in text
    assert seen["grads"] == params and "activations and temporaries" in text


# --- the out-of-memory post-mortem -------------------------------------------------------------


def test_a_forced_out_of_memory_writes_the_post_mortem(tmp_path, capfd):
    """The OOM comes from vramkit's cpu pool under a limit, inside the third step's forward (the
    post-mortem sees vramkit's pools; torch's CPU allocator has no hook). The model lives on the
    same device, so the screen splits by model state."""
    model = tiny_gpt2()
    calls = []

    def grab(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            vramkit.empty(64 * MiB, device="cpu")  # OOM-LINE

    model.transformer.h[0].register_forward_hook(grab)
    trainer = make_trainer(tmp_path, model=model)
    callback = vhf.attach(trainer)
    vramkit.set_memory_limit(16 * MiB, "cpu")
    try:
        with pytest.raises(vramkit.OutOfMemoryError):
            trainer.train()
        _C._drain_oom_queue()
    finally:
        vramkit.set_memory_limit(None, "cpu")
    watch = callback.oom_watch
    assert watch is not None and len(watch.dumps) == 1
    pm = watch.dumps[0]
    directory = str(tmp_path / "out" / "vramkit-oom")
    assert os.path.dirname(pm.files["snapshot"]) == directory and os.path.exists(pm.files["timeline"])
    assert pm.requested == 64 * MiB and pm.allowed == 16 * MiB
    # Third step, before its backward: parameters and the AdamW state of two steps, no gradients.
    assert pm.categories["parameters"] == state_bytes(model)
    assert pm.categories["optimizer state"] == state_bytes(model, trainer.optimizer) - state_bytes(model)
    screen = capfd.readouterr().err
    assert "=== vramkit: out of memory on cpu ===" in screen
    assert f"by what it is: parameters {format_bytes(state_bytes(model))}" in screen
    callback.close()  # the Trainer calls no callback after an exception: the run's watch goes here
    assert oom.active() is None


def test_a_watch_the_user_armed_is_left_armed(tmp_path):
    mine = vramkit.on_oom(tmp_path / "mine", stream=io.StringIO())
    trainer = make_trainer(tmp_path, max_steps=1)
    vhf.attach(trainer, stream=io.StringIO())
    trainer.train()
    assert oom.active() is mine and mine.armed
    assert trainer.model in set(mine._models)  # it learned the model, for the split


# --- the leak watch ----------------------------------------------------------------------------


def run_with_hook(tmp_path, keep):
    model = tiny_gpt2()
    kept = []

    def hook(module, args, output):
        if keep:
            kept.append(output[0].detach().clone())  # LEAK-LINE

    model.transformer.h[0].register_forward_hook(hook)
    trainer = make_trainer(tmp_path, model=model, max_steps=5)
    vhf.attach(trainer, check_every=5, stream=io.StringIO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [w for w in caught if issubclass(w.category, MemoryGrowthWarning)], kept


def test_a_leak_across_steps_is_warned_about_with_its_line(tmp_path):
    found, kept = run_with_hook(tmp_path, keep=True)
    assert len(found) == 1 and len(kept) == 5
    text = str(found[0].message)
    assert "memory grew across training steps 1-5" in text
    per_step = kept[0].numel() * kept[0].element_size()  # 8 x 16 x 32 floats
    assert f"+{per_step / 1024:.2f} KiB per step" in text
    assert f"{HERE}:{line_of('LEAK-LINE')} (hook)" in text


def test_a_run_without_a_leak_gives_no_warning(tmp_path):
    found, _ = run_with_hook(tmp_path, keep=False)
    assert found == []


# --- the batch size ----------------------------------------------------------------------------


def fails_above(model, limit=OOM_ABOVE):
    """A deterministic fake device: a batch above `limit` raises torch's out-of-memory error."""
    def check(module, args, kwargs):
        if kwargs["input_ids"].shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake: batch above "
                                         f"{limit})")
    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def test_the_search_finds_the_largest_and_the_trainers_own_does_not(tmp_path):
    """On the same model: vramkit finds 100; the Trainer's auto_find_batch_size (accelerate's
    find_executable_batch_size, from per_device_train_batch_size=128) trains at what it finds."""
    ours = make_trainer(tmp_path / "a", model=fails_above(tiny_gpt2()), per_device_train_batch_size=128)
    before = {k: v.clone() for k, v in ours.model.state_dict().items()}
    result = vhf.find_trainer_batch_size(ours)
    assert result.batch_size == OOM_ABOVE and ours.args.per_device_train_batch_size == OOM_ABOVE
    assert ours.args.gradient_accumulation_steps == 1
    assert all(torch.equal(before[k], v) for k, v in ours.model.state_dict().items())  # trials left no trace

    theirs = make_trainer(tmp_path / "b", model=fails_above(tiny_gpt2()), per_device_train_batch_size=128,
                          auto_find_batch_size=True, max_steps=1)
    theirs.train()
    found = theirs.state.train_batch_size
    # accelerate 1.15: 128 -> 115 -> 103 -> 92 (x0.9 a failure); older releases halved (64).
    assert found < OOM_ABOVE
    text = str(result)
    assert text.startswith(f"largest batch size that fits on cpu (torch tensors: no allocator counters, no peak): "
                           f"{OOM_ABOVE}")
    assert f"auto_find_batch_size) would run at {found}" in text
    ours.train()  # the real run uses what was set
    assert ours.state.train_batch_size == OOM_ABOVE


def test_the_search_keeps_the_effective_batch(tmp_path):
    """effective 240: only divisors of 240 are tried; 80 (x3) is the largest under the fake limit."""
    model = fails_above(tiny_gpt2())
    sizes = []
    model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    trainer = make_trainer(tmp_path, model=model, n=480, max_steps=1)
    result = vhf.find_trainer_batch_size(trainer, effective_batch_size=240)
    assert (result.batch_size, result.accumulation_steps) == (80, 3)
    assert all(240 % a.batch_size == 0 for a in result.attempts)
    assert result.knobs == {"per_device_train_batch_size": 80, "gradient_accumulation_steps": 3}
    sizes.clear()
    trainer.train()
    assert sizes == [80, 80, 80] and trainer.state.global_step == 1  # one optimizer step of 3 micro-batches


def test_bad_input_names_what_is_wrong(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(TypeError, match="expected a transformers.Trainer"):
        vhf.find_trainer_batch_size(object())
    with pytest.raises(ValueError, match="no batch size up to .* divides effective_batch_size=100 and is a multiple "
                                         "of 16"):
        vhf.find_trainer_batch_size(trainer, effective_batch_size=100, multiple_of=16, max_batch_size=64)
    with pytest.raises(ValueError, match="margin needs the peak memory"):
        vhf.find_trainer_batch_size(trainer, margin=0.1)
    with pytest.raises(ValueError, match="steps_per_trial must be an integer >= 1"):
        vhf.find_trainer_batch_size(trainer, steps_per_trial=0)
    with pytest.raises(ValueError, match="check_every must be an integer >= 5"):
        vhf.VramCallback(check_every=2)
    trainer.args.gradient_accumulation_steps = "2"
    with pytest.raises(TypeError, match="no integer gradient_accumulation_steps"):
        vhf.find_trainer_batch_size(trainer)
