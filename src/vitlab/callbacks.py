"""Lightning pieces that keep runs safe, fast and readable: checkpoints written atomically (and the
last one linked to the best when both fall due), a resumable checkpoint on SIGTERM / SIGUSR1 / Ctrl-C,
throughput read without stalling the device, and a log line per epoch where no progress bar is shown."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitlab.atomic import atomic_link, atomic_write

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into a temporary file beside the target, fsync, then rename over the target: a crash or
    a full disk never leaves a truncated or half-written checkpoint where a good one was. A failed write
    raises (torch.save and fsync report it), so the file is not read back: for ViT-B/16 with AdamW that
    would read 1 GB per save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        protocols = get_filesystem(path).protocol
        if "file" not in (protocols if isinstance(protocols, tuple) else (protocols,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores: their own semantics
        atomic_write(path, lambda f: torch.save(checkpoint, f), what="checkpoint")


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
    """On SIGTERM (cluster pre-emption), SIGUSR1 (SLURM's warning signal) or Ctrl-C, save a resumable
    checkpoint of the exact training state (mid-epoch included) and say where. Lightning stops after
    the current batch on SIGTERM; SIGUSR1 is routed to the same path unless Lightning's SLURM
    auto-requeue owns it."""

    def __init__(self, dirpath: str, filename: str = "interrupted.ckpt"):
        self.path = Path(dirpath) / filename
        self._previous_usr1 = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and hasattr(signal, "SIGUSR1") and not _slurm_requeue(trainer):
            self._previous_usr1 = signal.signal(signal.SIGUSR1, _as_sigterm)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_usr1)
            self._previous_usr1 = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)) or trainer.state.fn != TrainerFn.FITTING:
            return
        trainer.save_checkpoint(self.path, weights_only=False)  # the full state, to resume from
        if trainer.is_global_zero:
            what = "SIGTERM/SIGUSR1" if isinstance(exception, SIGTERMException) else "Ctrl-C"
            print(
                f"interrupted by {what} at step {trainer.global_step}: saved a resumable checkpoint to "
                f"{self.path}; resume with ckpt_path={self.path}",
                file=sys.stderr,
                flush=True,
            )


def _as_sigterm(signum, frame) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _slurm_requeue(trainer: L.Trainer) -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = trainer._accelerator_connector.cluster_environment
    return isinstance(env, SLURMEnvironment) and env.auto_requeue


class EpochLog(L.Callback):
    """A log line per training epoch, for runs without a progress bar (log files, CI, `make train` piped):
    the epoch's training and validation metrics, its steps and its time. An epoch's line is written
    when the next one starts (the module logs its training metrics after the callbacks' epoch-end
    hooks have run), and the last one when fit ends."""

    KEYS = ("train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best")

    def __init__(self):
        self._started: float | None = None
        self._step = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started is not None:
            self._write(trainer, trainer.current_epoch - 1)
        self._started, self._step = time.perf_counter(), trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started is not None:
            self._write(trainer, trainer.current_epoch - 1)
            self._started = None

    def _write(self, trainer: L.Trainer, epoch: int) -> None:
        if not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - self._started
        steps = trainer.global_step - self._step
        values = trainer.callback_metrics
        shown = " ".join(f"{k} {values[k].item():.4f}" for k in self.KEYS if k in values)
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        log.info("epoch %d%s (%d steps, %.1f s): %s", epoch + 1, total, steps, seconds, shown)


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
