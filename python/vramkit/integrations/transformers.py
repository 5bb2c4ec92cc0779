"""vramkit in Hugging Face's ``Trainer``: memory figures in the Trainer's own logs, the
out-of-memory post-mortem, the leak watch, and a batch-size search that sets the Trainer's knobs.

    from vramkit.integrations.transformers import attach, find_trainer_batch_size

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    print(find_trainer_batch_size(trainer, effective_batch_size=256))  # sets the two knobs
    attach(trainer)                                                     # the callback, first in line
    trainer.train()

Importing this module imports transformers (vramkit itself never does); everything goes
through the Trainer's public extension points: a ``TrainerCallback``, the logs its ``on_log``
event carries, and ``TrainingArguments``.

**Why ``attach``.** The Trainer calls callbacks in the order they were added, and the reporters
of ``report_to`` (TensorBoard, W&B, MLflow...) are added before any callback passed to
``Trainer(callbacks=...)``; ``state.log_history`` records a log before any callback sees it.
``VramCallback.on_log`` adds its figures to the ``logs`` dict of each training log (the one with
``"loss"``) and to that entry of ``state.log_history``, so every callback after it sees them:
``attach`` puts it first. Added later, it warns at the start of training when ``report_to``
names reporters that would miss the figures.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any, TextIO

from .batch_search import TunedBatchSize, accelerate_note, run_search, state_on_cpu
from .step_memory import StepMonitor

__all__ = ["VramCallback", "attach", "find_trainer_batch_size"]

_transformers: Any = importlib.import_module("transformers")


class VramCallback(_transformers.TrainerCallback):  # type: ignore[misc]  # transformers' class, seen as Any
    """Per training log: ``vram/allocated_mib``, ``vram/reserved_mib``, their peaks and
    ``vram/fragmentation`` (``vramkit.integrations.step_memory`` says where each comes from); the
    out-of-memory post-mortem armed for the run (files in ``<output_dir>/vramkit-oom`` unless
    `oom_dir` says otherwise; a watch the user armed is left as it is); the leak watch over a
    window of steps every `check_every` steps (``MemoryGrowthWarning``); and, after the first
    step, the memory by what holds it, printed to `stream` (standard error) on the main process.
    Add it with ``attach(trainer)``."""

    def __init__(self, *, check_every: int = 1000, leak_check: bool = True, breakdown: bool = True, oom: bool = True,
                 oom_dir: str | os.PathLike[str] | None = None, stream: TextIO | None = None) -> None:
        self.monitor = StepMonitor(check_every=check_every, leak_check=leak_check, breakdown=breakdown, oom=oom,
                                   oom_dir=oom_dir)
        self.stream = stream
        self.first_in_line = False  # set by attach()

    @property
    def oom_watch(self) -> Any:
        """The out-of-memory watch of the current run (``vramkit.survive.oom.OomWatch``), or None."""
        return self.monitor.watch

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.monitor.start(args.device, [model], [optimizer], os.path.join(args.output_dir, "vramkit-oom"))
        reporters = [r for r in (args.report_to or []) if r not in ("none", None)]
        if reporters and not self.first_in_line:
            warnings.warn(f"vramkit: VramCallback was added after the reporters of report_to ({', '.join(reporters)}), "
                          "which therefore will not see its figures; add it with "
                          "vramkit.integrations.transformers.attach(trainer)", RuntimeWarning, stacklevel=2)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.begin_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.after_optimizer()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        text = self.monitor.end_step()
        if text is not None and state.is_world_process_zero:
            stream = self.stream if self.stream is not None else sys.stderr
            stream.write(text + "\n")
            stream.flush()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs or self.monitor.source is None:
            return  # evaluation and the end-of-training summary carry no step figures
        figures = self.monitor.figures()
        history = state.log_history
        # The Trainer appended {**logs, "step": ...} before calling on_log: that entry is this log.
        if history and history[-1].get("step") == state.global_step and history[-1].get("loss") == logs["loss"]:
            history[-1].update(figures)
        logs.update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.stop()

    def close(self) -> None:
        """End what the callback runs (``on_train_end`` does this; the Trainer calls nothing when
        a step raises, so call it after catching an exception from ``train()``)."""
        self.monitor.stop()


def _check_trainer(trainer: Any) -> None:
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError(f"expected a transformers.Trainer, got {type(trainer).__name__}")
    args = getattr(trainer, "args", None)
    for knob in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if not isinstance(getattr(args, knob, None), int):
            raise TypeError(f"the trainer's args have no integer {knob}: the batch size search sets "
                            "per_device_train_batch_size and gradient_accumulation_steps of TrainingArguments")


def attach(trainer: Any, **options: Any) -> VramCallback:
    """A ``VramCallback(**options)`` put first among the trainer's callbacks (see the module
    docstring), so that every reporter and ``state.log_history`` get its figures. A callback
    attached before is replaced."""
    _check_trainer(trainer)
    callback = VramCallback(**options)
    callback.first_in_line = True
    handler = trainer.callback_handler
    handler.callbacks = [callback] + [cb for cb in handler.callbacks if not isinstance(cb, VramCallback)]
    return callback


# ---------------------------------------------------------------------------------- batch size

# What a trial changes in TrainingArguments: a few steps, nothing saved, evaluated or logged, and
# no automatic batch-size search of the Trainer's own (it would catch the out-of-memory itself).
_TRIAL_ARGS = {"max_steps": None, "gradient_accumulation_steps": 1, "save_strategy": "no", "eval_strategy": "no",
               "logging_strategy": "no", "eval_on_start": False, "load_best_model_at_end": False,
               "push_to_hub": False, "auto_find_batch_size": False}


def find_trainer_batch_size(trainer: Any, *, effective_batch_size: int | None = None, steps_per_trial: int = 2,
                            start: int = 1, max_batch_size: int | None = None, multiple_of: int = 1,
                            margin: float = 0.0, apply: bool = True) -> TunedBatchSize:
    """The largest ``per_device_train_batch_size`` that fits, found by running `steps_per_trial`
    real training steps of `trainer` per size (``vramkit.survive.find_batch_size``: doubling,
    then bisection). With `effective_batch_size`, only sizes dividing it are tried and
    ``gradient_accumulation_steps`` is set to keep it (per device); without, the accumulation is
    left as it is. `multiple_of`: try only multiples of it. `start`, `max_batch_size` (capped at
    the data set's length) and `margin` (a GPU's fraction to keep free; 0 on the CPU, where no
    peak is measured) are ``find_batch_size``'s. `apply`: set the two knobs on ``trainer.args``
    (and the Trainer's training batch size, as its own ``auto_find_batch_size`` does).

    Each trial is ``trainer.train()`` with a few steps and nothing saved, evaluated, logged or
    reported (only ``DefaultFlowCallback`` runs), so the trials use the Trainer's own data
    loading, mixed precision and activation checkpointing. Afterwards the model's weights, a
    given optimizer's and scheduler's state, the random number generators, the callbacks and the
    arguments are as they were; each trial's own optimizer and scheduler are dropped.

    Under torchrun (DDP or FSDP, the Trainer's own) every rank calls it: the ranks try the same
    sizes with one memory budget, agree on each outcome and all set the same size
    (``find_batch_size``'s distributed search). DeepSpeed is refused: its engine cannot be
    prepared again for each trial.
    """
    _check_trainer(trainer)
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("find_trainer_batch_size cannot run DeepSpeed trials (its engine is prepared once per "
                         "Trainer); search without DeepSpeed first, or use DDP or FSDP")
    if args.world_size > 1 and not _distributed_ready():
        raise ValueError(f"this Trainer has world size {args.world_size} but torch.distributed is not initialized: "
                         "launch the script with torchrun so that every rank runs the search")
    if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial must be an integer >= 1, got {steps_per_trial!r}")
    if trainer.train_dataset is None:
        raise ValueError("the trainer has no train_dataset: the search runs real training steps")
    limit = _dataset_cap(trainer, max_batch_size, max(1, args.world_size))
    device = _search_device(args.device)
    was = args.per_device_train_batch_size
    with state_on_cpu(trainer.model, [trainer.optimizer, trainer.lr_scheduler], args.device):
        result = run_search(lambda bs: _trial(trainer, bs, steps_per_trial), device=device, start=start,
                            max_batch_size=limit, margin=margin, effective_batch_size=effective_batch_size,
                            multiple_of=multiple_of)
    if result.batch_size:
        knobs = {"per_device_train_batch_size": result.batch_size,
                 "gradient_accumulation_steps": result.accumulation_steps or args.gradient_accumulation_steps}
        result.knobs = knobs
        result.applied = apply
        if apply:
            for name, value in knobs.items():
                setattr(args, name, value)
            trainer._train_batch_size = args.train_batch_size  # what the Trainer's own auto_find_batch_size sets
    result.others = [accelerate_note(was, result)]
    return result


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _dataset_cap(trainer: Any, max_batch_size: int | None, world_size: int) -> int:
    """No trial larger than a rank's share of the data set: a smaller last batch would pass for
    the size asked."""
    cap = 1 << 16 if max_batch_size is None else max_batch_size
    try:
        n = len(trainer.train_dataset) // world_size
    except TypeError:  # an iterable data set: no length to cap by
        return cap
    return max(1, min(cap, n))


def _search_device(device: Any) -> Any:
    """Where find_batch_size measures: torch's CUDA allocator, vramkit's pool when vramkit is
    torch's allocator, or vramkit's cpu pool on the CPU (no peak: torch's CPU allocator has no counters)."""
    if device.type == "cuda":
        from ..torch.allocator import is_installed

        index = device.index if device.index is not None else 0
        return f"cuda:{index}" if is_installed() else device
    return "cpu"


def _trial(trainer: Any, batch_size: int, steps: int) -> None:
    """`steps` training steps of `trainer` at `batch_size` per device, everything else as configured."""
    args = trainer.args
    saved_args = {name: getattr(args, name) for name in (*_TRIAL_ARGS, "per_device_train_batch_size")}
    saved = {name: getattr(trainer, name, None) for name in ("_train_batch_size", "state", "control", "optimizer",
                                                              "lr_scheduler", "model_wrapped", "is_in_train")}
    handler = trainer.callback_handler
    callbacks = list(handler.callbacks)
    try:
        for name, value in _TRIAL_ARGS.items():
            setattr(args, name, steps if name == "max_steps" else value)
        args.per_device_train_batch_size = batch_size
        trainer._train_batch_size = args.train_batch_size
        handler.callbacks = [cb for cb in callbacks if isinstance(cb, _transformers.DefaultFlowCallback)]
        trainer.train()
    finally:
        for name, value in saved_args.items():
            setattr(args, name, value)
        for name, value in saved.items():
            setattr(trainer, name, value)
        handler.callbacks = callbacks
        for attr in ("model", "optimizer", "lr_scheduler"):  # as the Trainer's own loop leaves them
            setattr(handler, attr, getattr(trainer, attr))
        trainer.accelerator.free_memory()  # the trial's prepared optimizer and model references
