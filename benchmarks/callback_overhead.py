"""callback_overhead — what vramkit's Trainer and Lightning callbacks add to a training step.

    PYTHONPATH=python python benchmarks/callback_overhead.py [--steps 1000] [--repeats 3]

The model is a tiny GPT-2 (random weights, 2 layers, 64 wide, 2 heads, vocabulary 256), batches
of 8 sequences of 32 tokens, AdamW, float32, one intra-op thread, on the CPU. Each framework
trains it for `--steps` optimizer steps, logging every 50 steps, in these ways, the settings'
runs interleaved, `--repeats` times:

* plain: the framework alone;
* the callback as shipped (``attach(trainer)`` / ``VramCallback()``): figures at each log, the
  post-mortem armed, the leak watch and the CPU meter over a 5-step window every
  ``check_every`` (1000) steps, the breakdown after the first step;
* figures only (``leak_check=False``: the CPU meter's windows remain);
* every step metered (``check_every=5``): windows back to back, the cost of one metered step.

A timing callback, last in line, stamps the end of every step, and each hook of vramkit's
callback is timed. On this shared 2-core machine a whole run's time varies by several per cent
from one run to the next (other load), more than the effect measured, so "added" is taken within
each run: the callback's own hook time in the steps outside its windows, plus what each window
step (1-5, then 5 every `check_every`; their dispatch modes slow torch's operations, not only
the hooks) took above the same step of the plain run, divided by the plain run's median step.
The whole-run mean step is shown too. Each figure is the median over the repeats; the order of
the settings rotates between repeats. The target: the callback as shipped adds under 3 % to a
step. Nothing here is asserted; docs/benchmarks.md records it.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import use_source_tree  # noqa: E402

use_source_tree()

import torch  # noqa: E402

VOCAB, SEQ, BATCH, LOG_EVERY = 256, 32, 8, 50


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock:
    """Per step: its wall time (between the step-end stamps of a callback that runs last) and
    the time spent inside vramkit's callback during it (its hooks, each wrapped)."""

    HOOKS = ("on_train_begin", "on_step_begin", "on_optimizer_step", "on_step_end", "on_log", "on_train_end",
             "on_fit_start", "on_fit_end", "on_train_batch_start", "on_train_batch_end")

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.inside: list[float] = [0.0]

    def stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        self.inside.append(0.0)

    def wrap(self, callback: Any) -> Any:
        for name in self.HOOKS:
            method = getattr(callback, name, None)
            if method is not None:
                setattr(callback, name, self._timed(method))
        return callback

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.inside[-1] += time.perf_counter() - start
        return timed

    def steps(self) -> tuple[list[float], list[float]]:
        """(durations, time inside the callback) of each step."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])], self.inside[1:len(self.stamps)]


def hf_run(steps: int, options: dict[str, Any] | None, out: str) -> tuple[list[float], list[float]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from vramkit.integrations.transformers import attach

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps,
                             logging_steps=LOG_EVERY, report_to=[], save_strategy="no", disable_tqdm=True,
                             use_cpu=True, dataloader_num_workers=0)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(steps * BATCH))
    trainer.remove_callback(trainer.callback_handler.callbacks[-1])  # the console printer: not what is timed
    clock = Clock()
    if options is not None:
        clock.wrap(attach(trainer, stream=io.StringIO(), **options))

    class Stamp(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            clock.stamp()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.stamp()

    trainer.add_callback(Stamp())
    trainer.train()
    return clock.steps()


def lightning_run(steps: int, options: dict[str, Any] | None, out: str) -> tuple[list[float], list[float]]:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from vramkit.integrations.lightning import VramCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    loader = torch.utils.data.DataLoader(Tokens(steps * BATCH), batch_size=BATCH)
    clock = Clock()

    class Stamp(L.Callback):  # type: ignore[misc]
        def on_train_start(self, *args: Any) -> None:
            clock.stamp()

        def on_train_batch_end(self, *args: Any) -> None:
            clock.stamp()

    callbacks = ([clock.wrap(VramCallback(**options))] if options is not None else []) + [Stamp()]
    trainer = L.Trainer(max_steps=steps, log_every_n_steps=LOG_EVERY, logger=CSVLogger(out), callbacks=callbacks,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(Module(), loader)
    return clock.steps()


SETTINGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "callback as shipped": {},
    "figures only (leak_check=False)": {"leak_check": False},
    "every step metered (check_every=5)": {"check_every": 5},
}


def window_steps(steps: int, options: dict[str, Any] | None) -> set[int]:
    """0-based indexes of the steps the callback meters: 5 from step 1, again every check_every."""
    every = (options or {}).get("check_every", 1000)
    return {i for i in range(steps) if i % every < 5}


def added(run: tuple[list[float], list[float]], plain: list[float], windows: set[int]) -> float:
    """Seconds the callback added per step: its hooks' own time in the steps outside its windows,
    plus, for each window step, what it took above the same step of the plain run (the windows'
    dispatch modes slow torch's operations, not only the hooks)."""
    durations, inside = run
    hooks = sum(t for i, t in enumerate(inside) if i not in windows)
    windows_extra = sum(durations[i] - plain[i] for i in windows if i < min(len(durations), len(plain)))
    return (hooks + windows_extra) / len(durations)


def measure(run: Callable[[int, dict[str, Any] | None, str], tuple[list[float], list[float]]], steps: int,
            repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per setting, medians over the repeats of: the median step, the whole run's mean step, and
    the time added per step (``added``)."""
    per: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SETTINGS}
    run(min(steps, 20), None, tempfile.mkdtemp())  # warm-up: imports, first-call costs
    names = list(SETTINGS)
    for r in range(repeats):
        runs = {}
        for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates between repeats
            with tempfile.TemporaryDirectory() as out:
                runs[name] = run(steps, SETTINGS[name], out)
        plain = runs["plain"][0]
        for name, result in runs.items():
            durations = result[0]
            extra = 0.0 if name == "plain" else added(result, plain, window_steps(steps, SETTINGS[name]))
            per[name].append((statistics.median(durations), statistics.mean(durations), extra))
    return {name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values),
                   statistics.median(v[2] for v in values)) for name, values in per.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "pytorch_lightning", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(f"torch {torch.__version__}, {opts.steps} steps per run, median of {opts.repeats} runs, "
          f"{os.cpu_count()} CPUs, one intra-op thread")
    print("| framework | setting | median step (ms) | mean step (ms) | added per step (ms) | added to a step |")
    print("|---|---|---|---|---|---|")
    for framework, run in (("HF Trainer", hf_run), ("Lightning", lightning_run)):
        result = measure(run, opts.steps, opts.repeats)
        base = result["plain"][0]
        for name, (median, mean, extra) in result.items():
            share = "-" if name == "plain" else f"{extra / base * 100:.1f} %"
            extra_ms = "-" if name == "plain" else f"{extra * 1e3:.3f}"
            print(f"| {framework} | {name} | {median * 1e3:.2f} | {mean * 1e3:.2f} | {extra_ms} | {share} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
