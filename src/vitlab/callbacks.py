"""Lightning pieces that keep runs safe and readable: checkpoints written atomically and verified, a
resumable checkpoint on SIGTERM / SIGUSR1 / Ctrl-C, a stop on a non-finite loss, and a log line per
epoch where no progress bar is shown."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitlab.atomic import atomic_write

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into a temporary file beside the target, fsync, read it back (weights_only) and
    compare its keys, then rename over the target: a crash or a full disk never leaves a truncated
    or half-written checkpoint where a good one was."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        protocols = get_filesystem(path).protocol
        if "file" not in (protocols if isinstance(protocols, tuple) else (protocols,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores: their own semantics

        def verify(tmp: Path) -> None:
            back = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
            if set(back) != set(checkpoint) or set(back.get("state_dict", {})) != set(checkpoint.get("state_dict", {})):
                raise OSError(f"checkpoint {tmp} read back differs from what was written")

        atomic_write(path, lambda f: torch.save(checkpoint, f), verify, what="checkpoint")


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
