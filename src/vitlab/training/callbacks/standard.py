"""Lightning callbacks that keep runs safe, fast and readable: checkpoints (the best carried into a resumed run's
directory, the last one linked to the best when both fall due), a resumable checkpoint when a signal stops the run
(vitlab.utils.signals), throughput read without stalling the device, a log line per epoch where no progress bar is
shown, and the stop on a non-finite loss. The weights' moving average is training/callbacks/ema.py."""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitlab.utils.atomic import atomic_link
from vitlab.utils.errors import NonFiniteLossError
from vitlab.utils.logs import shown
from vitlab.utils.signals import StopSignals

log = logging.getLogger(__name__)

LOGGER_IDS = "logger_run_ids"  # a checkpoint's key for its loggers' run ids (RunIds)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (the best checkpoints by a metric), which also carries its ranking into a run
    resumed in a new directory: the earlier run's top-k files (or directories of shards) are hard-linked there (the
    same bytes, no copy) and keep their scores, so the resumed run keeps or replaces them exactly as the
    uninterrupted run would have, and tests the same checkpoint. (Lightning's own drops the scores when the directory
    changes, and the resumed run then calls its first new checkpoint the best.)"""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._writes = trainer.is_global_zero

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        earlier = state_dict.get("dirpath")
        if not earlier or not self.dirpath or Path(earlier) == Path(self.dirpath):
            return super().load_state_dict(state_dict)
        here = {
            p: str(Path(self.dirpath) / Path(p).name) for p in state_dict.get("best_k_models", {}) if Path(p).exists()
        }
        if not state_dict.get("best_model_path"):  # stopped before its first best: nothing to carry
            return
        if state_dict["best_model_path"] not in here:
            log.info("the earlier run's best checkpoint is gone (%s): the ranking starts anew", earlier)
            return
        if getattr(self, "_writes", True):
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            for theirs, ours in here.items():
                atomic_link(theirs, ours)
        self.best_k_models = {here[p]: score for p, score in state_dict["best_k_models"].items() if p in here}
        self.best_model_score = state_dict["best_model_score"]
        self.best_model_path = here[state_dict["best_model_path"]]
        self.kth_best_model_path = here.get(state_dict.get("kth_best_model_path"), self.best_model_path)
        self.kth_value = self.best_k_models[self.kth_best_model_path]


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt`, written at every save point (Lightning's own `save_last` moves only when a top-k
    checkpoint is saved, and its `link` mode would point at an old best). When another ModelCheckpoint
    has just written this very training state (the best improved this epoch), last.ckpt becomes a hard
    link to that file instead of serialising and writing the same state a second time. The linked file
    holds this callback's bookkeeping from just before (its own path, unchanged from epoch 2 on)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("filename", "last")
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(monitor=None, save_top_k=1, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # nothing to carry over: last.ckpt is written anew at the next save point

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        twin = next(
            (
                cb._last_checkpoint_saved
                for cb in trainer.checkpoint_callbacks
                if cb is not self
                and isinstance(cb, ModelCheckpoint)
                and cb._last_global_step_saved == trainer.global_step
                and cb.save_weights_only == self.save_weights_only
                and cb._last_checkpoint_saved
            ),
            None,
        )
        # Rank 0 wrote the twin (a single file, unless a sharded strategy wrote a directory); all ranks follow its word.
        if not trainer.strategy.broadcast(twin is not None and trainer.is_global_zero and Path(twin).is_file()):
            return super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            atomic_link(twin, filepath)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


class SaveOnInterrupt(L.Callback):
    """Ctrl-C, SIGTERM, SIGUSR1 or SIGUSR2, to one process, to any rank or to the whole process group: every rank
    stops after the same optimizer step (and the validation due after it), one resumable checkpoint of the exact
    training state is written, and the run exits non-zero (`run.fit_and_test` says where it saved). The handling
    is `signals.StopSignals`, which this callback puts in place of Lightning's for fit."""

    def __init__(self, dirpath: str, filename: str = "interrupted.ckpt"):
        self.path = Path(dirpath) / filename
        self.saved: dict[str, Any] | None = None  # what was saved, for the run's last line

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and not isinstance(trainer._signal_connector, StopSignals):
            trainer._signal_connector = StopSignals(trainer)
        for logger in trainer.loggers if stage == "fit" else []:
            if isinstance(logger, WandbLogger):
                _lose_only_the_log(logger, trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        connector = trainer._signal_connector
        # Only where the optimizer has stepped: a gradient being accumulated is in no checkpoint.
        if not isinstance(connector, StopSignals) or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        first = connector.stop is None
        if connector.agree(trainer.global_step) is not None and first and trainer.is_global_zero:
            log.info("%s: stopping after step %d", signal.Signals(connector.stop).name, trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        connector = trainer._signal_connector
        if not isinstance(exception, SIGTERMException) or not isinstance(connector, StopSignals) or not connector.stop:
            return  # a bug, or a second Ctrl-C: nothing consistent to save
        trainer.save_checkpoint(self.path, weights_only=False)  # every rank: the per-rank states are gathered
        self.saved = {
            "signal": connector.stop,
            "path": self.path,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }


def _lose_only_the_log(logger: WandbLogger, trainer: L.Trainer) -> None:
    """A W&B logger whose service went with the stop signal (Slurm signals every process of a job, W&B's own
    included) fails the steps logged until the checkpoint: that loses those steps' W&B records (the resumed run
    continues the W&B run after them), not the checkpoint. Any other failure of W&B is raised as before."""
    log_metrics = logger.log_metrics

    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            log_metrics(*args, **kwargs)
        except Exception as e:
            connector = trainer._signal_connector
            if not isinstance(connector, StopSignals) or not (connector.stop or connector.received):
                raise
            trainer.loggers = [other for other in trainer.loggers if other is not logger]
            log.warning("W&B stopped with the signal (%s: %s): its records end here; saving the checkpoint",
                        type(e).__name__, e)  # fmt: skip

    logger.log_metrics = guarded


class EpochLog(L.Callback):
    """A log line per training epoch, for runs without a progress bar (log files, CI, `make train` piped; silent
    under one): the epoch's training and validation metrics, its steps and its time. An epoch's line is written
    when the next one starts (the module logs its training metrics after the callbacks' epoch-end
    hooks have run), and the last one when fit ends. A run resumed mid-epoch gets no epoch start from Lightning for
    the epoch it goes on with: its line counts from the resumed step."""

    KEYS = (
        "train/loss",
        "train/acc",
        "val/loss",
        "val/acc",
        "val/acc_best",
        "val/loss_best",
        "val/map",
        "val/map_best",
        "knn/top1",
        "fewshot/10shot",
    )

    def __init__(self):
        self._started: float | None = None
        self._step = self._epoch = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started, self._step, self._epoch = time.perf_counter(), trainer.global_step, trainer.current_epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started is not None and trainer.current_epoch > self._epoch:
            self._write(trainer, self._epoch)
        self._started, self._step, self._epoch = time.perf_counter(), trainer.global_step, trainer.current_epoch

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started is not None and trainer.global_step > self._step:
            self._write(trainer, self._epoch)
        self._started = None

    def _write(self, trainer: L.Trainer, epoch: int) -> None:
        if not trainer.is_global_zero or trainer.progress_bar_callback is not None:
            return
        seconds = time.perf_counter() - self._started
        steps = trainer.global_step - self._step
        values = trainer.callback_metrics
        line = " ".join(f"{k} {shown(values[k].item())}" for k in self.KEYS if k in values)
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        log.info("epoch %d%s (%d steps, %.1f s): %s", epoch + 1, total, steps, seconds, line)


class Throughput(L.Callback):
    """Training images/s (and FLOP/s when the module knows its training FLOPs per image), logged every
    `trainer.log_every_n_steps` steps as `train/samples_per_sec` (all processes), and per device
    `train/device/samples_per_sec`, `train/device/flops_per_sec`.

    Unlike Lightning's ThroughputMonitor, which waits for the device after every step (the CPU can then
    never queue the next step while the GPU works), the device is synchronised only when a figure is
    read, once per logging interval; validation time inside a window is left out."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._images = 0
        self._paused = 0.0
        self._val_start: float | None = None
        self._read_at = -1

    def _now(self, module: L.LightningModule) -> float:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        return time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is None:
            self._start, self._images, self._paused = self._now(pl_module), 0, 0.0
            self._read_at = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._images += len(batch[1])  # a shape, known on the host
        step = trainer.global_step  # optimizer steps: the same for every micro-batch of an accumulation
        if step % trainer.log_every_n_steps or step == self._read_at or self._start is None:
            return
        self._read_at = step
        now = self._now(pl_module)
        seconds = now - self._start - self._paused
        if seconds > 0:
            per_device = self._images / seconds
            values = {
                "train/device/samples_per_sec": per_device,
                "train/samples_per_sec": per_device * trainer.world_size,
            }
            flops = getattr(pl_module, "train_flops_per_image", None)
            if flops:
                values["train/device/flops_per_sec"] = flops * per_device
            # host tensors: a Python number would be copied to the module's device by Lightning
            values = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
            pl_module.log_dict(values, on_step=True, on_epoch=False)
        self._start, self._images, self._paused = now, 0, 0.0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._start is not None:
            self._val_start = self._now(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is not None:
            self._paused += self._now(pl_module) - self._val_start
            self._val_start = None


class NonFiniteLoss(L.Callback):
    """A non-finite training loss stops the run, and no checkpoint ever holds the weights it produced. On the CPU the
    loss is read every step and the run stops before the update. On a GPU reading it would make the host wait for
    every step: the first bad step is recorded on the device and read at logging steps, at the end of each epoch and
    before every checkpoint is written. Every fit has it (training.run.build)."""

    def __init__(self) -> None:
        self._bad: torch.Tensor | None = None  # (first bad step, its loss) on the device; -1 while none
        self._read_at = -1
        self.every_step: bool | None = (
            None  # read the loss every step; None: on the CPU (where a read waits for nothing)
        )

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.every_step if self.every_step is not None else loss.device.type == "cpu":
            if not math.isfinite(loss.item()):  # (a plain read: no kernel for one number)
                raise NonFiniteLossError(
                    _message(trainer, loss.item(), trainer.global_step, "stopped before the update")
                )
            return
        if self._bad is None or self._bad.device != loss.device:
            self._bad = torch.full((2,), -1.0, device=loss.device)
        first = ~torch.isfinite(loss.detach()) & (self._bad[0] < 0)
        step = torch.full((), float(trainer.global_step), device=loss.device)  # a fill on the device, not a copy
        self._bad.copy_(torch.where(first, torch.stack([step, loss.detach().float()]), self._bad))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % trainer.log_every_n_steps == 0 and step != self._read_at:  # a step Lightning writes logs at
            self._read_at = step
            self.check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check(trainer)  # before anything is written

    def check(self, trainer: L.Trainer) -> None:
        if self._bad is not None and self._bad[0].item() >= 0:
            step, value = int(self._bad[0].item()), self._bad[1].item()
            stopped = f"the weights from then on (step {trainer.global_step}) were not saved"
            raise NonFiniteLossError(_message(trainer, value, step, stopped))


def _message(trainer: L.Trainer, value: float, step: int, stopped: str) -> str:
    return f"training loss became {value} at step {step} (epoch {trainer.current_epoch}); {stopped}; " + (
        last_good_checkpoint(trainer)
    )


def last_good_checkpoint(trainer: L.Trainer) -> str:
    """Where a stopped run's last checkpoint is, in words."""
    saved = [Path(p) for cb in trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path)]
    saved = [p for p in saved if str(p) not in ("", ".") and p.is_file()]
    # the newest; of one file under two names (last.ckpt linked to the best), the one saved later
    last = max(reversed(saved), key=lambda p: p.stat().st_mtime_ns) if saved else None
    if last:
        return f"the last good checkpoint is {last}"
    return f"no checkpoint was saved yet (the run directory {trainer.default_root_dir} keeps its log)"


class RichBar(RichProgressBar):
    """Lightning's rich bar with epochs counted from 1 (`Epoch 1/3`), as the epoch log and the line of a stopped run
    count them."""

    def _get_train_description(self, current_epoch: int) -> str:
        shown = f"Epoch {current_epoch + 1}" + (f"/{self.trainer.max_epochs}" if self.trainer.max_epochs else "")
        return f"{shown:{len(self.validation_description)}}"  # (padded: no flicker beside "Validation")


class TQDMBar(TQDMProgressBar):
    """Lightning's tqdm bar with epochs counted from 1, as RichBar."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:  # Lightning's, but the description
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=convert_inf(self.total_train_batches))
        self.train_progress_bar.initial = 0
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch + 1}")


class RunIds(L.Callback):
    """The run ids of this run's loggers (W&B's), saved in every checkpoint: a run resumed from it continues them."""

    key = LOGGER_IDS

    def __init__(self):
        self.ids: dict[str, str] = {}  # kept once seen: a logger dropped on the way to a stop's checkpoint is in it

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        wandb = [lg.version for lg in trainer.loggers if isinstance(lg, WandbLogger) and lg.version]
        self.ids |= {"wandb": wandb[0]} if wandb else {}
        if self.ids:
            checkpoint[self.key] = dict(self.ids)
