"""benchmark.task=overhead: `vitlab.train`'s Lightning loop (its config, callbacks and logger) against a
plain PyTorch loop with the same model, data, optimizer, schedule and loss (`ViTModule.loss`), and against
Lightning's own floor, a bare LightningModule with those and nothing else (no metrics, logging, callbacks or
checkpoints), in alternating rounds; per-step time over the training batches, and whole epochs (validation and
checkpoints included) for reference."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.measure import pick_device, summarise, sync
from vitlab.training.module import ViTModule
from vitlab.training.optim import make_optimizer, make_scheduler
from vitlab.training.run import build
from vitlab.training.run.fit import build_fit
from vitlab.training.run.plan import TrainPlan

log = logging.getLogger(__name__)


@dataclass
class LoopTimes:
    """Per epoch, the seconds of each training step, end to end (from the previous step's end, or the
    epoch's start: data loading and every hook included), and of the whole epoch (validation and
    checkpoints included). Beside the wall clock, the CPU seconds this process spent on each step
    (time.process_time, every thread of it): what load from other processes on a shared machine moves
    far less than the wall clock (loader workers, other processes, are not in it)."""

    step_s: list[list[float]] = field(default_factory=list)
    epoch_s: list[float] = field(default_factory=list)
    step_cpu_s: list[list[float]] = field(default_factory=list)

    def epoch_started(self) -> None:
        self.step_s.append([])
        self.step_cpu_s.append([])
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def step_ended(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.step_s[-1].append(now - self._last)
        self.step_cpu_s[-1].append(cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu


class LoopTimer(L.Callback):
    def __init__(self) -> None:
        self.times = LoopTimes()

    def on_train_epoch_start(self, trainer, module) -> None:
        sync(module.device)
        self._start = time.perf_counter()
        self.times.epoch_started()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        sync(module.device)
        self.times.step_ended()

    def on_train_epoch_end(self, trainer, module) -> None:
        sync(module.device)
        self.times.epoch_s.append(time.perf_counter() - self._start)


def run_lightning(plan: TrainPlan, epochs: int) -> LoopTimes:
    """`vitlab.train`'s fit, as it builds it, for `epochs` epochs; progress bar as configured there."""
    L.seed_everything(plan.seed, workers=True, verbose=False)
    timer = LoopTimer()
    with build_fit(plan, [timer], max_epochs=epochs).finished() as fit:
        fit.trainer.fit(fit.module, datamodule=fit.datamodule, weights_only=True)
    return timer.times


class BareModule(L.LightningModule):
    """Lightning's floor for a run: its network, its objective's training loss, its optimizer groups and per-step
    schedule in a LightningModule with nothing else: no metrics, no logging, no callbacks but the timer."""

    def __init__(self, module: ViTModule):
        super().__init__()
        self.model, self.objective, self.optim, self.scheduler_cfg = (
            module.model, module.objective, module.optim, module.scheduler_cfg,
        )  # fmt: skip

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.objective.training_loss(self.model, x, y, self.current_epoch)[0]

    def configure_optimizers(self):
        optimizer = make_optimizer(self.objective.optimized(self.model), self.optim)
        total, epochs = max(1, int(self.trainer.estimated_stepping_batches)), self.trainer.max_epochs
        scheduler = make_scheduler(optimizer, self.scheduler_cfg, total, epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run_bare_lightning(plan: TrainPlan, epochs: int) -> LoopTimes:
    """The same data module, network, loss, optimizer and schedule as `vitlab.train`, fitted by a Trainer of the same
    accelerator and precision that has nothing else to do: the cost of Lightning itself."""
    L.seed_everything(plan.seed, workers=True, verbose=False)
    datamodule = build.fit_datamodule(plan)
    module = build.build_module(plan, datamodule)
    if module.compile_mode:
        module.model.compile(mode=module.compile_mode)
    timer = LoopTimer()
    t = plan.trainer  # (precision=auto: resolved by the plan, as vitlab.train's)
    trainer = L.Trainer(
        accelerator=t["accelerator"], devices=1, precision=t["precision"], deterministic=t["deterministic"],
        benchmark=t["benchmark"], max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer], limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(BareModule(module), datamodule=datamodule)
    return timer.times


def run_plain(plan: TrainPlan, epochs: int) -> LoopTimes:
    """The loop one would write by hand around the same pieces: the same datamodule (and its on-device
    augmentation), model, AdamW groups, per-step schedule and loss; running training loss and accuracy
    kept on the device; a validation pass per epoch."""
    L.seed_everything(plan.seed, workers=True, verbose=False)
    datamodule = build.build_datamodule(plan.data)
    on_cpu = plan.trainer.get("accelerator", "auto") == "cpu"
    device = torch.device("cpu") if on_cpu else pick_device("auto")
    module = build.build_module(plan, datamodule)
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
        start = time.perf_counter()
        times.epoch_started()
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
            times.step_ended()
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


def bench_overhead(plan: TrainPlan, b: BenchmarkConfig) -> dict[str, Any]:
    """Alternating rounds of Lightning and plain runs (order swapped each round); each run's first
    epoch is warm-up and dropped. The step figure is the median over every measured step, which a
    burst of load from elsewhere moves less than a per-epoch mean."""
    epochs = b.overhead.epochs + 1
    runners = {"lightning": run_lightning, "bare_lightning": run_bare_lightning, "plain": run_plain}
    per_step: dict[str, list[float]] = {name: [] for name in runners}
    per_epoch: dict[str, list[float]] = {name: [] for name in runners}
    per_step_cpu: dict[str, list[float]] = {name: [] for name in runners}
    steps: dict[str, list[int]] = {}
    for r in range(b.overhead.rounds):
        for name in list(runners) if r % 2 == 0 else list(runners)[::-1]:
            times = runners[name](plan, epochs)
            per_step[name] += [t for epoch in times.step_s[1:] for t in epoch]
            per_epoch[name] += times.epoch_s[1:]
            per_step_cpu[name] += [t for epoch in times.step_cpu_s[1:] for t in epoch]
            steps[name] = [len(epoch) for epoch in times.step_s[1:]]
            log.info("round %d %s: %s s per epoch", r, name, [round(t, 3) for t in times.epoch_s])
    results = {
        name: {
            "step": summarise(per_step[name]),
            "step_cpu": summarise(per_step_cpu[name]),
            "epoch": summarise(per_epoch[name]),
            "steps_per_epoch": statistics.median(steps[name]),
        }
        for name in per_step
    }
    light = results["lightning"]
    ratios = {
        f"lightning/{floor}": {
            "step_time": light["step"]["median_ms"] / results[floor]["step"]["median_ms"],
            "step_cpu_time": light["step_cpu"]["median_ms"] / results[floor]["step_cpu"]["median_ms"],
            "epoch_time": light["epoch"]["median_ms"] / results[floor]["epoch"]["median_ms"],
        }
        for floor in ("plain", "bare_lightning")
    }
    return {"results": results, "ratios": ratios}


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title="vitlab.train's Lightning loop vs a bare LightningModule and a plain loop (medians)")
    for col in ("loop", "ms / train step", "CPU ms / train step", "s / epoch (val + ckpt incl.)", "steps / epoch"):
        table.add_column(col)
    for name, r in report["results"].items():
        step, epoch = r["step"]["median_ms"], r["epoch"]["median_ms"] / 1e3
        cpu = r["step_cpu"]["median_ms"]
        table.add_row(name, f"{step:.3f}", f"{cpu:.3f}", f"{epoch:.3f}", str(r["steps_per_epoch"]))
    console.print(table)
    for name, ratio in report["ratios"].items():
        console.print(
            f"{name} time: {ratio['step_time']:.3f} per step ({ratio['step_cpu_time']:.3f} in CPU time), "
            f"{ratio['epoch_time']:.3f} per epoch"
        )
    console.print("(the bare LightningModule validates nothing and saves no checkpoint: its epochs are train only)")
