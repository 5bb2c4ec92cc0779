"""vramkit in Lightning: memory figures through ``LightningModule.log``, the out-of-memory
post-mortem, the leak watch, and a ``Tuner``-style batch-size search.

    from vramkit.integrations.lightning import VramCallback, scale_batch_size

    trainer = L.Trainer(max_epochs=3, callbacks=[VramCallback()], logger=CSVLogger("logs"))
    print(scale_batch_size(trainer, model, datamodule=dm))   # sets model/datamodule.batch_size
    trainer.fit(model, datamodule=dm)

Importing this module imports Lightning (vramkit itself never does): ``lightning.pytorch``, or
the standalone ``pytorch_lightning`` when that is the one already imported (a callback must be
the Trainer's own package's ``Callback``). Everything goes through Lightning's public extension
points: a ``Callback`` and ``log_dict``, so the figures reach whichever loggers the Trainer has
(TensorBoard, CSV, W&B...) at its ``log_every_n_steps``; the breakdown after the first step goes
through ``rank_zero_info``, where Lightning's own messages go.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from .batch_search import TunedBatchSize, doubling_note, run_search, state_on_cpu
from .step_memory import StepMonitor

__all__ = ["VramCallback", "scale_batch_size"]


def _package() -> Any:
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        return sys.modules["pytorch_lightning"]
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        return importlib.import_module("pytorch_lightning")


pl: Any = _package()
_rank_zero_info: Any = pl.utilities.rank_zero_info


class VramCallback(pl.Callback):  # type: ignore[misc]  # Lightning's class, seen as Any
    """Logs ``vram/allocated_mib``, ``vram/reserved_mib``, their peaks and ``vram/fragmentation``
    with ``log_dict`` at the Trainer's logging steps (``vramkit.integrations.step_memory`` says
    where each figure comes from); arms the out-of-memory post-mortem for the fit, from
    ``on_fit_start`` (before the sanity check) to ``on_fit_end`` or ``on_exception`` (files in
    ``<default_root_dir>/vramkit-oom`` unless `oom_dir` says otherwise; a watch the user armed
    is left as it is); runs the leak watch over a window of steps every `check_every` steps
    (``MemoryGrowthWarning``); after the first step, reports the memory by what holds it."""

    def __init__(self, *, check_every: int = 1000, leak_check: bool = True, breakdown: bool = True, oom: bool = True,
                 oom_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.monitor = StepMonitor(check_every=check_every, leak_check=leak_check, breakdown=breakdown, oom=oom,
                                   oom_dir=oom_dir)

    @property
    def oom_watch(self) -> Any:
        """The out-of-memory watch of the current fit (``vramkit.survive.oom.OomWatch``), or None."""
        return self.monitor.watch

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Before the sanity check: an out-of-memory in validation is covered too. The model is on
        # its device and the optimizers exist by now.
        self.monitor.start(pl_module.device, [pl_module], list(trainer.optimizers),
                           os.path.join(trainer.default_root_dir, "vramkit-oom"))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.monitor.begin_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        monitor = self.monitor
        monitor.after_optimizer()  # Lightning zeroes gradients at the next step: they are still live here
        text = monitor.end_step()
        if text is not None:
            _rank_zero_info(text)
        figures = monitor.figures() if _logger_writes(trainer) else {}  # values logged at other steps are never written
        if figures:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False,
                               logger=bool(trainer.loggers))  # without a logger: callback_metrics only

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.monitor.stop()


def _logger_writes(trainer: Any) -> bool:
    """Whether the Trainer writes this step's logged values (its log_every_n_steps rule, counted
    in optimizer steps, which have been taken by the time on_train_batch_end runs)."""
    n = trainer.log_every_n_steps
    return bool(n) and (trainer.global_step % n == 0 or bool(trainer.should_stop))


# ---------------------------------------------------------------------------------- batch size


def scale_batch_size(trainer: Any, model: Any, datamodule: Any = None, *, batch_arg_name: str = "batch_size",
                     effective_batch_size: int | None = None, steps_per_trial: int = 2, start: int = 1,
                     max_batch_size: int = 8192, multiple_of: int = 1, margin: float = 0.0,
                     apply: bool = True) -> TunedBatchSize:
    """The largest batch size that fits, as Lightning's ``Tuner.scale_batch_size`` looks for one,
    but with ``vramkit.survive.find_batch_size`` (doubling, then bisection: the largest that
    fits, not the last power of two). The size lives where Lightning's tuner looks for it: an
    attribute `batch_arg_name` of the model, its ``hparams``, or the datamodule (every one that
    has it is set, with `apply`). With `effective_batch_size`, only sizes dividing it are tried
    and ``trainer.accumulate_grad_batches`` is set to keep it. `multiple_of`: try only multiples
    of it. `start` and `margin` (a GPU's fraction to keep free; 0 on the CPU, where no peak is
    measured) are ``find_batch_size``'s. `max_batch_size`, the largest size tried, is passed on
    as ``find_batch_size``'s cap; its default, 8192, is Lightning's own tuner's
    (``Tuner.scale_batch_size(max_val=8192)``), not ``find_batch_size``'s 65536.
    `datamodule`: the one to fit with (a model without one uses its own ``train_dataloader``).

    Each trial fits a fresh Trainer on `trainer`'s accelerator, devices, strategy, precision and
    gradient clipping for `steps_per_trial` steps, without loggers, checkpoints, callbacks or
    validation; afterwards the model's weights and the random generators are as they were.

    Under DDP (``strategy="ddp"``, each rank launched by torchrun or by Lightning) every rank
    calls it, before ``fit``: the process group is set up first, and the ranks try the same sizes
    with one memory budget, agree on each outcome and all set the same size
    (``find_batch_size``'s distributed search).
    """
    if not isinstance(trainer, pl.Trainer):
        raise TypeError(f"expected a Lightning Trainer ({pl.__name__}.Trainer), got {type(trainer).__name__}")
    if not isinstance(model, pl.LightningModule):
        raise TypeError(f"expected a LightningModule, got {type(model).__name__}")
    if not isinstance(trainer.strategy, (pl.strategies.SingleDeviceStrategy, pl.strategies.DDPStrategy)):
        raise ValueError(f"scale_batch_size runs on one device or under DDP; this Trainer's strategy is "
                         f"{type(trainer.strategy).__name__}: search with a single-device or DDP Trainer first")
    _setup_distributed(trainer)
    if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial must be an integer >= 1, got {steps_per_trial!r}")
    holders = _holders(model, datamodule, batch_arg_name)
    device = trainer.strategy.root_device
    search_device = _search_device(device)

    def trial(batch_size: int) -> None:
        _set(holders, batch_arg_name, batch_size)
        _trial_trainer(trainer, device, steps_per_trial).fit(model, datamodule=datamodule)

    try:
        with state_on_cpu(model, [], device), _quiet():
            result = run_search(trial, device=search_device, start=start, max_batch_size=max_batch_size,
                                margin=margin, effective_batch_size=effective_batch_size,
                            multiple_of=multiple_of)
    finally:
        for obj, value in holders:  # each as it was
            _set([(obj, value)], batch_arg_name, value)
    if result.batch_size:
        result.knobs = {batch_arg_name: result.batch_size}
        if result.accumulation_steps:
            result.knobs["accumulate_grad_batches"] = result.accumulation_steps
        result.applied = apply
        if apply:
            _set(holders, batch_arg_name, result.batch_size)
            if result.accumulation_steps:
                trainer.accumulate_grad_batches = result.accumulation_steps
    result.others = [doubling_note(2, result, max_batch_size)]
    return result


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Each trial Trainer announces its devices and its stop: not worth a screen per trial."""
    log = logging.getLogger(pl.__name__)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _holders(model: Any, datamodule: Any, name: str) -> list[tuple[Any, Any]]:
    """(object, current value) for each place that holds the batch size, as Lightning's tuner
    looks: the model, its hparams, the datamodule."""
    out = []
    if name in model.__dict__ or hasattr(type(model), name):
        out.append((model, getattr(model, name)))
    hparams = getattr(model, "hparams", None)
    if hparams is not None and name in hparams:
        out.append((hparams, hparams[name]))
    if datamodule is not None and hasattr(datamodule, name):
        out.append((datamodule, getattr(datamodule, name)))
    if not out:
        raise AttributeError(f"no {name!r} on the model, in its hparams or on the datamodule: the search sets the "
                             f"batch size there (give the model or datamodule a {name!r} attribute that its "
                             "train_dataloader() reads, or pass batch_arg_name=)")
    for _, value in out:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int where it is set, got {value!r}")
    return out


def _set(holders: list[tuple[Any, Any]], name: str, value: int) -> None:
    for obj, _ in holders:
        if isinstance(obj, dict):
            obj[name] = value
        else:
            setattr(obj, name, value)


def _search_device(device: Any) -> Any:
    if device.type == "cuda":
        from ..torch.allocator import is_installed

        return f"cuda:{device.index or 0}" if is_installed() else device
    return "cpu"


def _setup_distributed(trainer: Any) -> None:
    """Under DDP, the process group, so that the search's ranks can agree before the first trial
    (Lightning itself sets it up only in ``fit``); the trials' Trainers then find it set up."""
    if not isinstance(trainer.strategy, pl.strategies.DDPStrategy):
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        trainer.strategy.setup_distributed()


def _trial_trainer(trainer: Any, device: Any, steps: int) -> Any:
    """A Trainer like `trainer` for `steps` training steps and nothing else."""
    strategy: Any = "auto"
    devices: Any = [device.index or 0] if device.type == "cuda" else 1
    if isinstance(trainer.strategy, pl.strategies.DDPStrategy):  # the same strategy, on the same devices
        strategy = pl.strategies.DDPStrategy(process_group_backend=trainer.strategy.process_group_backend,
                                             **getattr(trainer.strategy, "_ddp_kwargs", {}))
        devices = trainer.num_devices
    return pl.Trainer(accelerator=trainer.accelerator, strategy=strategy, devices=devices,
                      num_nodes=trainer.num_nodes, precision=trainer.precision,
                      gradient_clip_val=trainer.gradient_clip_val,
                      gradient_clip_algorithm=trainer.gradient_clip_algorithm, max_steps=steps, max_epochs=-1,
                      limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[],
                      default_root_dir=trainer.default_root_dir)
