"""benchmark.task=end2end: what share of the model's speed `vitlab.train` delivers. Two figures, same
model, per-device batch, precision and compile setting, in one process:

- `train`: vitlab.train's own fit (its config, data, callbacks, logger) on the chosen data, timed over a
  window of steady-state training steps. The device is synchronised only at the window's two ends (and
  at epoch boundaries inside it), so the timer adds no wait of its own to a step; steps before the
  window (start-up, compilation, the first batches) are untimed. A window may span epochs: the time
  from one training epoch's last step to the next one's start (validation and its first compilation,
  checkpoints) is left out, the next epoch's first batches (the loader restarting) are counted, and
  reported too (`epoch_starts_s`: from each epoch's start to its first batch, the workers refilling, one batch of
  images in each worker, before a step can run; timm's train.py counts it in its first step of an epoch).
- `bare_step`: `task=models`' training step of the same model on one synthetic batch already on the
  device (forward, backward, AdamW).

The ratio train / bare_step is 1.0 when loading, augmentation, the loop and its callbacks cost nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.measure import sync
from vitlab.training.optim import OptimConfig
from vitlab.training.run import build
from vitlab.training.run.fit import build_fit
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import UserError

PRECISION_OF_TRAINER = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16"}


class Window(L.Callback):
    """Synchronise and read the clock after step `start` and after step `start + steps`, then stop;
    epoch ends inside the window (validation, checkpoints) are left out; epoch starts (until the first batch) are
    counted, and summed apart in `epoch_starts`."""

    def __init__(self, start: int, steps: int):
        self.start, self.steps = start, steps
        self.t0 = self.t1 = self._paused_at = self._epoch_at = None
        self.images, self.paused, self.epoch_starts = 0, 0.0, 0.0

    def _active(self) -> bool:
        return self.t0 is not None and self.t1 is None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.start and self.t0 is None:
            sync(module.device)
            self.t0 = time.perf_counter()
        elif self.start < step <= self.start + self.steps:
            self.images += len(batch[1])
            if step == self.start + self.steps:
                sync(module.device)
                self.t1 = time.perf_counter()
                trainer.should_stop = True

    # Lightning validates after an epoch's last batch and before on_train_epoch_end: the pause starts at
    # whichever comes first and ends when training goes on (the next epoch's start, or its next batch after a
    # validation inside the epoch), so validation, its first compilation and checkpoints stay out of the window.
    def on_validation_start(self, trainer, module) -> None:
        self._pause(module)

    def on_train_epoch_end(self, trainer, module) -> None:
        self._pause(module)

    def on_train_epoch_start(self, trainer, module) -> None:
        if self._active():
            self._epoch_at = self._resume()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self._paused_at is None and self._epoch_at is None:
            return
        now = self._resume()
        if self._epoch_at is not None:  # this epoch's first batch: the time its loader took to hand it over
            self.epoch_starts += now - self._epoch_at
            self._epoch_at = None

    def _pause(self, module) -> None:
        if self._active() and self._paused_at is None:
            sync(module.device)
            self._paused_at = time.perf_counter()

    def _resume(self) -> float:
        """The clock, read once; a pause ends at it."""
        now = time.perf_counter()
        if self._paused_at is not None:
            self.paused += now - self._paused_at
            self._paused_at = None
        return now

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0 - self.paused


def trainer_precision(trainer: Mapping[str, Any]) -> str:
    """The task=models precision of vitlab.train's trainer settings (one device only; `auto` resolved by the plan, as
    the run resolves it)."""
    precision = PRECISION_OF_TRAINER.get(str(trainer.get("precision", "32-true")))
    if precision is None:
        raise UserError(
            f"benchmark.task=end2end compares with task=models, which runs {list(PRECISION_OF_TRAINER)} "
            f"precisions; trainer.precision is {trainer.get('precision')!r}"
        )
    if int(trainer.get("devices", 1) or 1) != 1 or int(trainer.get("num_nodes", 1) or 1) != 1:
        raise UserError(
            "benchmark.task=end2end measures one device: set trainer.devices=1 in benchmark.train_overrides"
        )
    return precision


def train_window(plan: TrainPlan, datamodule, e) -> Window:
    """vitlab.train's fit (its callbacks, logger, data) for warmup_steps + steps, timed over the last steps."""
    L.seed_everything(plan.seed, workers=True, verbose=False)
    window = Window(e.warmup_steps, e.steps)
    steps = {"max_epochs": -1, "max_steps": e.warmup_steps + e.steps, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    with build_fit(plan, [window], datamodule=datamodule, **steps).finished() as fit:
        trainer = fit.trainer
        trainer.fit(fit.module, datamodule=datamodule, weights_only=True)
    if window.t1 is None:  # training stopped early (an interrupt), or Lightning counted steps unlike the window
        raise RuntimeError(f"training stopped after {trainer.global_step} of {e.warmup_steps + e.steps} steps")
    return window


def bench_end2end(plan: TrainPlan, b: BenchmarkConfig, device: torch.device) -> dict[str, Any]:
    from vitlab.benchmark.models import bench_models

    precision = trainer_precision(plan.trainer)
    datamodule = build.build_datamodule(plan.data)
    per_device = datamodule.per_device_batch_size
    # The bare step first, in a fresh process (after a fit, its loader workers and allocations linger).
    bare = dataclasses.replace(
        b, task="models", contenders=("vitlab",), modes=("train",), batch_size=per_device, precision=precision,
        compile=plan.compile,
    )  # fmt: skip
    model_cfg = plan.model
    step = bench_models(model_cfg, bare, OptimConfig.from_dict(plan.optim), device)["results"]["train"]["vitlab"]
    window = train_window(plan, datamodule, b.end2end)
    seconds = window.seconds
    train = {"images_per_s": window.images / seconds, "steps": window.steps, "warmup_steps": window.start}
    return {
        "model": model_cfg.to_dict(),
        "batch_size": per_device,
        "precision": precision,
        "compile": bare.compile,
        "device": str(device),
        "train": {
            **train,
            "seconds": seconds,
            "epoch_ends_left_out_s": window.paused,
            "epoch_starts_s": window.epoch_starts,
        },  # fmt: skip
        "bare_step": {"images_per_s": step["images_per_s"], "median_ms": step["median_ms"]},
        "ratios": {"train/bare_step": train["images_per_s"] / step["images_per_s"]},
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(width=140)
    t, s = report["train"], report["bare_step"]
    console.print(
        f"end to end ({report['device']}, batch {report['batch_size']}, {report['precision']}, compile "
        f"{report['compile']}): vitlab.train {t['images_per_s']:.1f} images/s over {t['steps']} steps; bare step "
        f"{s['images_per_s']:.1f} images/s; train / bare step = {report['ratios']['train/bare_step']:.3f}; "
        f"{t['epoch_starts_s']:.2f} s of the window waited for epochs' first batches"
    )
