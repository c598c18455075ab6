"""benchmark.task=overhead: `vitlab.train`'s Lightning loop (its config, callbacks and logger) against a
plain PyTorch loop with the same model, data, optimizer, schedule and loss (`ViTModule.loss`), in
alternating rounds; per-step time over the training batches, and whole epochs (validation and
checkpoints included) for reference."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig

from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.measure import pick_device, summarise, sync
from vitlab.training.optim import make_optimizer, make_scheduler
from vitlab.training.run import build

log = logging.getLogger(__name__)


@dataclass
class LoopTimes:
    """Per epoch, the seconds of each training step, end to end (from the previous step's end, or the
    epoch's start: data loading and every hook included), and of the whole epoch (validation and
    checkpoints included)."""

    step_s: list[list[float]] = field(default_factory=list)
    epoch_s: list[float] = field(default_factory=list)


class LoopTimer(L.Callback):
    def __init__(self) -> None:
        self.times = LoopTimes()

    def on_train_epoch_start(self, trainer, module) -> None:
        sync(module.device)
        self._start = self._last = time.perf_counter()
        self.times.step_s.append([])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        sync(module.device)
        now = time.perf_counter()
        self.times.step_s[-1].append(now - self._last)
        self._last = now

    def on_train_epoch_end(self, trainer, module) -> None:
        sync(module.device)
        self.times.epoch_s.append(time.perf_counter() - self._start)


def run_lightning(train_cfg: DictConfig, epochs: int) -> LoopTimes:
    """`vitlab.train`'s fit, as it builds it, for `epochs` epochs; progress bar as configured there."""
    L.seed_everything(train_cfg.seed, workers=True, verbose=False)
    timer = LoopTimer()
    with build.build_fit(train_cfg, [timer], max_epochs=epochs).finished() as fit:
        fit.trainer.fit(fit.module, datamodule=fit.datamodule, weights_only=True)
    return timer.times


def run_plain(train_cfg: DictConfig, epochs: int) -> LoopTimes:
    """The loop one would write by hand around the same pieces: the same datamodule (and its on-device
    augmentation), model, AdamW groups, per-step schedule and loss; running training loss and accuracy
    kept on the device; a validation pass per epoch."""
    L.seed_everything(train_cfg.seed, workers=True, verbose=False)
    datamodule = build.build_datamodule(train_cfg.data)
    on_cpu = train_cfg.trainer.get("accelerator", "auto") == "cpu"
    device = torch.device("cpu") if on_cpu else pick_device("auto")
    module = build.build_module(train_cfg, datamodule)
    module.to(device)
    model = module.model
    if module.compile_mode:
        model.compile(mode=module.compile_mode)  # as ViTModule.setup does for fit
    datamodule.setup("fit")
    datamodule.placement = device  # where vitlab.train holds data that fits (data.on_device), without a Trainer
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    optimizer = make_optimizer(model, module.optim)
    scheduler = make_scheduler(optimizer, module.scheduler_cfg, epochs * len(train_loader), epochs)
    times = LoopTimes()
    for _ in range(epochs):
        start = last = time.perf_counter()
        times.step_s.append([])
        model.train()
        loss_sum = correct = seen = 0  # running training loss and accuracy, as any loop reports them
        for batch in train_loader:
            x, y = datamodule.device_transform([t.to(device, non_blocking=True) for t in batch], train=True)
            loss, logits = module.loss(x, y)  # the objective training_step optimises
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(-1) == y).sum()
            seen += len(y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sync(device)
            now = time.perf_counter()
            times.step_s[-1].append(now - last)
            last = now
        model.eval()
        train_correct, correct, total = correct, 0, 0
        with torch.no_grad():
            for batch in val_loader:
                x, y = datamodule.device_transform([t.to(device, non_blocking=True) for t in batch], train=False)
                correct += (model(x).argmax(-1) == y).sum()
                total += len(y)
        log.info(
            "plain loop: train loss %.4f acc %.4f, val acc %.4f",
            (loss_sum / max(seen, 1)).item(),
            (train_correct / max(seen, 1)).item(),
            (correct / max(total, 1)).item(),
        )
        times.epoch_s.append(time.perf_counter() - start)
    return times


def bench_overhead(train_cfg: DictConfig, b: BenchmarkConfig) -> dict[str, Any]:
    """Alternating rounds of Lightning and plain runs (order swapped each round); each run's first
    epoch is warm-up and dropped. The step figure is the median over every measured step, which a
    burst of load from elsewhere moves less than a per-epoch mean."""
    epochs = b.overhead.epochs + 1
    per_step: dict[str, list[float]] = {"lightning": [], "plain": []}
    per_epoch: dict[str, list[float]] = {"lightning": [], "plain": []}
    steps: dict[str, list[int]] = {}
    runners = {"lightning": run_lightning, "plain": run_plain}
    for r in range(b.overhead.rounds):
        for name in ("lightning", "plain") if r % 2 == 0 else ("plain", "lightning"):
            times = runners[name](train_cfg, epochs)
            per_step[name] += [t for epoch in times.step_s[1:] for t in epoch]
            per_epoch[name] += times.epoch_s[1:]
            steps[name] = [len(epoch) for epoch in times.step_s[1:]]
            log.info("round %d %s: %s s per epoch", r, name, [round(t, 3) for t in times.epoch_s])
    results = {
        name: {
            "step": summarise(per_step[name]),
            "epoch": summarise(per_epoch[name]),
            "steps_per_epoch": statistics.median(steps[name]),
        }
        for name in per_step
    }
    light, plain = results["lightning"], results["plain"]
    return {
        "results": results,
        "ratios": {
            "lightning/plain": {
                "step_time": light["step"]["median_ms"] / plain["step"]["median_ms"],
                "epoch_time": light["epoch"]["median_ms"] / plain["epoch"]["median_ms"],
            }
        },
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title="vitlab.train's Lightning loop vs a plain loop (medians)")
    for col in ("loop", "ms / train step", "s / epoch (val + ckpt incl.)", "steps / epoch"):
        table.add_column(col)
    for name, r in report["results"].items():
        step, epoch = r["step"]["median_ms"], r["epoch"]["median_ms"] / 1e3
        table.add_row(name, f"{step:.3f}", f"{epoch:.3f}", str(r["steps_per_epoch"]))
    console.print(table)
    ratio = report["ratios"]["lightning/plain"]
    console.print(f"Lightning / plain time: {ratio['step_time']:.3f} per step, {ratio['epoch_time']:.3f} per epoch")
