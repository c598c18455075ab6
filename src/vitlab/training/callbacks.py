"""Lightning callbacks that keep runs safe, fast and readable, and the weights' moving average (EMA) as timm
validates it: checkpoints (the best carried into a resumed run's
directory, the last one linked to the best when both fall due), a resumable checkpoint when a
signal stops the run (vitlab.utils.signals), throughput read without stalling the device, and a log line per epoch
where no progress bar is shown."""

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
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitlab.utils.atomic import atomic_link
from vitlab.utils.checks import check_range
from vitlab.utils.signals import StopSignals

log = logging.getLogger(__name__)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (the best checkpoints by a metric), which also carries its ranking into a run
    resumed in a new directory: the earlier run's top-k files are hard-linked there (the same bytes, no copy) and
    keep their scores, so the resumed run keeps or replaces them exactly as the uninterrupted run would have, and
    tests the same checkpoint. (Lightning's own drops the scores when the directory changes, and the resumed run
    then calls its first new checkpoint the best.)"""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._writes = trainer.is_global_zero

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        earlier = state_dict.get("dirpath")
        if not earlier or not self.dirpath or Path(earlier) == Path(self.dirpath):
            return super().load_state_dict(state_dict)
        here = {
            p: str(Path(self.dirpath) / Path(p).name) for p in state_dict.get("best_k_models", {}) if Path(p).is_file()
        }
        if state_dict.get("best_model_path") not in here:
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

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        connector = trainer._signal_connector
        # Only where the optimizer has stepped: a gradient being accumulated is in no checkpoint.
        if not isinstance(connector, StopSignals) or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        first = connector.stop is None
        if connector.agree() is not None and first and trainer.is_global_zero:
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


class EpochLog(L.Callback):
    """A log line per training epoch, for runs without a progress bar (log files, CI, `make train` piped; silent
    under one): the epoch's training and validation metrics, its steps and its time. An epoch's line is written
    when the next one starts (the module logs its training metrics after the callbacks' epoch-end
    hooks have run), and the last one when fit ends."""

    KEYS = (
        "train/loss",
        "train/acc",
        "val/loss",
        "val/acc",
        "val/acc_best",
        "val/loss_best",
        "knn/top1",
        "fewshot/10shot",
    )

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
        if not trainer.is_global_zero or trainer.progress_bar_callback is not None:
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


class EMA(EMAWeightAveraging):
    """Lightning's EMA of the weights, validated as timm's train.py validates it: the raw weights give `val/acc`
    and `val/loss`, the average `val/acc_ema` and `val/loss_ema`, every validation. The best checkpoint is chosen
    by the metric `model_checkpoint.monitor` names, and every checkpoint holds those weights as its weights (tested
    after training, evaluated, exported): the average's when it is an `_ema` metric, else the raw ones; the other
    set travels along for resuming. `warmup`: timm's EMA warm-up, decay min(decay, 1 - (1 + step / gamma) ** -power)
    from optimizer step `step`, so the average follows the fast-moving early weights instead of keeping the initial
    ones for thousands of steps."""

    def __init__(
        self,
        decay: float = 0.999,
        warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        **kwargs: Any,
    ):
        check_range("callbacks.ema.decay", decay, 0, 1)
        for key, value in (("warmup_gamma", warmup_gamma), ("warmup_power", warmup_power)):
            check_range(f"callbacks.ema.{key}", value, 0, math.inf, low_open=True, high_open=True)
        self.decay, self.warmup, self.warmup_gamma, self.warmup_power = decay, warmup, warmup_gamma, warmup_power
        # EMAWeightAveraging's schedule of updates, with an average of our own (the warm-up's decay)
        WeightAveraging.__init__(self, use_buffers=True, multi_avg_fn=self._lerp, **kwargs)
        self.update_every_n_steps, self.update_starting_at_step = update_every_n_steps, update_starting_at_step
        self.update_starting_at_epoch = None
        self._step, self.keep_average = 0, True

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step `step` (1, 2, ...), as timm's ModelEmaV3.get_decay: the first
        update copies the weights, warm-up counts from the second."""
        if not self.warmup:
            return self.decay
        since = step - 1
        if since <= 0:
            return 0.0
        return min(self.decay, max(0.0, 1 - (1 + since / self.warmup_gamma) ** -self.warmup_power))

    def _lerp(self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged) -> None:
        weight = 1.0 - self.decay_at(self._step)  # a Python number: no device read per step
        floats = [(a, c) for a, c in zip(averaged, current, strict=True) if a.is_floating_point()]
        if floats:
            torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], weight)
        for a, c in zip(averaged, current, strict=True):
            if not a.is_floating_point():
                a.copy_(c)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        best = [c for c in trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint)]
        self.keep_average = not best or str(best[0].monitor).endswith("_ema")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._step = trainer.global_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.keep_average:  # the module ends with the weights the checkpoints hold
            super().on_train_end(trainer, pl_module)

    # Validation: both weights, side by side (Lightning's callback would swap the average in instead).
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is not None:
            self._average_model.module.eval()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._average_model is None:
            return
        x, y = batch
        average = self._average_model.module
        with trainer.precision_plugin.forward_context():  # the autocast validation_step runs in (bf16-mixed)
            logits = average.model(x)
            average._update("val", F.cross_entropy(logits, y), logits, y)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is None:
            return
        average = self._average_model.module
        values = {}
        for name in ("loss", "acc", "acc_top5"):
            metric = average.val_metrics[name]
            values[f"val/{name}_ema"] = metric.compute()
            metric.reset()
        pl_module.log_dict(values, prog_bar=False, sync_dist=True)
        average.train()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.keep_average or self._average_model is None:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)
            return
        state = self._average_model.state_dict()
        checkpoint["average_model_state"] = {k[7:]: v for k, v in state.items() if k.startswith("module.")}
        checkpoint["averaging_state"] = {k: v for k, v in state.items() if not k.startswith("module.")}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._average_model is not None and "average_model_state" in checkpoint:  # saved with the raw weights kept
            state = {"module." + k: v for k, v in checkpoint["average_model_state"].items()}
            self._average_model.load_state_dict(state | checkpoint["averaging_state"])
            return
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
