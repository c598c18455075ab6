"""python -m vitlab.benchmark model=<name> [benchmark.*=...]: how fast, against what.

Two tasks, each writing `benchmark.json` in its run directory:

- `benchmark.task=models` (default): vitlab's ViT and timm's VisionTransformer of the same config
  and weights, in one process, on one fixed synthetic batch. Each mode (`train`: forward, backward,
  AdamW step; `fwd_bwd`: no optimizer; `infer`: forward under inference_mode) is warmed up, then
  timed over `repeats` rounds that interleave the contenders (order alternating per round, so drift
  hits both alike). Reports medians, vitlab/timm throughput ratios (of the medians, and the spread of
  the per-round ratios), analytic FLOPs, achieved FLOP/s, MFU against a large matmul timed on the same
  device in the same dtype, and peak memory. Contenders `vitlab_ckpt` / `timm_ckpt` turn on gradient
  checkpointing.
- `benchmark.task=overhead`: `vitlab.train`'s Lightning loop (its config, callbacks and logger)
  against a plain PyTorch loop with the same model, data, optimizer, schedule and loss, in
  alternating rounds; per-step time over the training batches, and whole epochs (validation and
  checkpoints included) for reference.

Speed goals are checked here, never in timed tests (README: Benchmarks; experiments/throughput).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from vitlab.cli import entry_point, vit_config
from vitlab.convert.timm import create_timm_model, vitlab_to_timm
from vitlab.data.digits import TensorImages
from vitlab.errors import UserError
from vitlab.lit_module import make_optimizer, make_scheduler
from vitlab.model import ViT, ViTConfig

log = logging.getLogger(__name__)

TASKS = ("models", "overhead")
CONTENDERS = ("vitlab", "timm", "vitlab_ckpt", "timm_ckpt")
MODES = ("train", "fwd_bwd", "infer")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMM_OPTIMIZERS = ("timm", "vitlab")
MB = 2**20


# ---- measuring -------------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"benchmark.device {name!r} is not one of auto, cpu, cuda, cuda:<i>")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"benchmark.device {name!r} is not available here: no CUDA GPU; use cpu or auto")
    return device


def sync(device: torch.device) -> None:
    """Wait for queued kernels: a GPU timer that skips this measures the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device, steps: int = 1) -> float:
    """Seconds per call of `fn`, over `steps` back-to-back calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 10) -> dict:
    """The device's attainable FLOP/s (the MFU denominator, measured rather than taken from a
    datasheet): the fastest of `repeats` timed (size x size) @ (size x size) products in `dtype`. The
    fastest, not the median: a peak is what the device can do, and load from elsewhere only slows."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    seconds = min(time_once(lambda: a @ b, device) for _ in range(repeats))
    return {"dtype": str(dtype).removeprefix("torch."), "size": size, "flops_per_s": 2 * size**3 / seconds}


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and shared weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def quiet_kineto():
    """The profiler's C++ backend writes start/stop and GPU-probe lines straight to file descriptor 2;
    hold them back and pass on anything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not KINETO_NOISE.match(line):
                    sys.stderr.write(line)


KINETO_NOISE = re.compile(r"^(USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d \S+ \d+:\d+ \w+\.cpp:\d+\]")


def step_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak of the memory allocated by one call of `fn`, above what was allocated before it. On CUDA from
    the caching allocator's statistics; on CPU from the profiler's allocation events, summed in time
    order (the same quantity: live tensor bytes, allocator slack excluded)."""
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def summarise(times: list[float]) -> dict[str, Any]:
    return {"median_ms": 1e3 * statistics.median(times), "times_ms": [round(1e3 * t, 4) for t in times]}


# ---- task: models ----------------------------------------------------------------------------------


class Contender:
    """One model with its optimizer; `step` runs one step of a mode on a fixed batch."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, autocast):
        self.name, self.model, self.optimizer, self.autocast = name, model, optimizer, autocast

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return F.cross_entropy(self.model(x), y)

    def step(self, mode: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if mode == "infer":
            with torch.inference_mode(), self.autocast():
                self.model(x)
            return
        self.loss(x, y).backward()
        if mode == "train":
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self, mode: str) -> int:
        """What lives between steps: weights and buffers, plus AdamW's moments when training."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if mode != "infer":
            tensors += [t for s in self.optimizer.state.values() for t in s.values()]
        return tensor_bytes(tensors)


def timm_optimizer(model: nn.Module, optim: dict[str, Any], which: str) -> torch.optim.Optimizer:
    """`timm`: what timm's own train.py builds (create_optimizer_v2: AdamW, no decay on norms and
    biases, PyTorch's default implementation for the device). `vitlab`: exactly vitlab's optimizer."""
    if which == "vitlab":
        return make_optimizer(model, optim)
    from timm.optim import create_optimizer_v2

    o = optim
    return create_optimizer_v2(
        model, "adamw", lr=o["lr"], weight_decay=o["weight_decay"], betas=tuple(o["betas"]), eps=o["eps"]
    )


def build_contenders(cfg: ViTConfig, b: DictConfig, optim: dict[str, Any], device: torch.device) -> list[Contender]:
    """The contenders of `b.contenders`, all starting from the same weights (vitlab's init, ported)."""
    base = ViT(cfg)
    dtype = PRECISIONS[b.precision]

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    out = []
    for name in b.contenders:
        if name.startswith("vitlab"):
            model = copy.deepcopy(base).to(device)
            optimizer = make_optimizer(model, optim)
        else:
            model = create_timm_model(cfg)
            model.load_state_dict(vitlab_to_timm(base.state_dict(), cfg))
            model = model.to(device)
            optimizer = timm_optimizer(model, optim, b.timm_optimizer)
        model.set_grad_checkpointing(name.endswith("_ckpt"))
        if b.compile:
            model.compile()  # in place, as vitlab.train compile=true does
        out.append(Contender(name, model, optimizer, autocast))
    return out


def bench_models(cfg: ViTConfig, b: DictConfig, optim: dict[str, Any], device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    contenders = build_contenders(cfg, b, optim, device)
    x = torch.randn(b.batch_size, cfg.in_chans, *cfg.img_hw, device=device)
    y = torch.randint(0, max(cfg.num_classes, 1), (b.batch_size,), device=device)
    batch_bytes = tensor_bytes([x, y])
    flops_fwd = cfg.flops_per_image()
    peak = peak_matmul_flops(device, PRECISIONS[b.precision], b.peak_matmul_size)  # and again at the end
    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, Any]] = {}
    for mode in b.modes:
        for c in contenders:
            c.model.train(mode != "infer")
            for _ in range(b.warmup):
                c.step(mode, x, y)
        times: dict[str, list[float]] = {c.name: [] for c in contenders}
        for r in range(b.repeats):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                times[c.name].append(time_once(functools.partial(c.step, mode, x, y), device, b.steps))
        flops = flops_fwd * (1 if mode == "infer" else 3)  # backward ~ 2x forward
        results[mode] = {}
        for c in contenders:
            row = summarise(times[c.name])
            row["images_per_s"] = b.batch_size / (row["median_ms"] / 1e3)
            row["achieved_flops_per_s"] = flops * row["images_per_s"]
            row["mfu"] = row["achieved_flops_per_s"] / peak["flops_per_s"]
            state = c.state_bytes(mode) + batch_bytes
            step = step_peak_bytes(functools.partial(c.step, mode, x, y), device)
            row.update(state_memory_mb=state / MB, step_memory_mb=step / MB, peak_memory_mb=(state + step) / MB)
            results[mode][c.name] = row
        first = contenders[0].name
        ratios[mode] = {}
        for c in contenders[1:]:
            ours, theirs = results[mode][first], results[mode][c.name]
            paired = [o / f for f, o in zip(times[first], times[c.name], strict=True)]
            ratios[mode][f"{first}/{c.name}"] = {
                "throughput": theirs["median_ms"] / ours["median_ms"],
                "throughput_paired_min": min(paired),
                "throughput_paired_max": max(paired),
                "peak_memory": ours["peak_memory_mb"] / theirs["peak_memory_mb"],
                "step_memory": ours["step_memory_mb"] / max(theirs["step_memory_mb"], 1e-9),
            }
    again = peak_matmul_flops(device, PRECISIONS[b.precision], b.peak_matmul_size)
    if again["flops_per_s"] > peak["flops_per_s"]:
        peak = again
        for rows in results.values():
            for row in rows.values():
                row["mfu"] = row["achieved_flops_per_s"] / peak["flops_per_s"]
    return {
        "flops": {
            "forward_per_image": flops_fwd,
            "forward_gflops_per_image": flops_fwd / 1e9,
            "train_gflops_per_image": 3 * flops_fwd / 1e9,
        },
        "peak": peak,
        "results": results,
        "ratios": ratios,
    }


# ---- task: overhead --------------------------------------------------------------------------------


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
    from vitlab import run

    L.seed_everything(train_cfg.seed, workers=True, verbose=False)
    datamodule = run.build_datamodule(train_cfg.data)
    module = run.build_module(train_cfg, datamodule)
    timer = LoopTimer()
    bars, show_bar = run.progress_bar(train_cfg.progress_bar)
    callbacks = run.instantiate_group(train_cfg.get("callbacks")) + bars + [timer]
    loggers = run.instantiate_group(train_cfg.get("logger"))
    trainer = run.build_trainer(
        train_cfg.trainer, callbacks=callbacks, logger=loggers or False, enable_progress_bar=show_bar, max_epochs=epochs
    )
    trainer.fit(module, datamodule=datamodule, weights_only=True)
    return timer.times


def run_plain(train_cfg: DictConfig, epochs: int) -> LoopTimes:
    """The loop one would write by hand around the same pieces: the same datamodule (and its on-device
    augmentation), model, AdamW groups, per-step schedule and loss; running training loss and accuracy
    kept on the device; a validation pass per epoch."""
    from vitlab import run

    L.seed_everything(train_cfg.seed, workers=True, verbose=False)
    datamodule = run.build_datamodule(train_cfg.data)
    on_cpu = train_cfg.trainer.get("accelerator", "auto") == "cpu"
    device = torch.device("cpu") if on_cpu else pick_device("auto")
    module = run.build_module(train_cfg, datamodule)
    model, smoothing, mixup = module.model.to(device), module.label_smoothing, module.mixup
    if train_cfg.compile:
        model.compile()  # as ViTModule.setup does for fit
    datamodule.setup("fit")
    for ds in (datamodule.train_set, datamodule.val_set):
        if isinstance(ds, TensorImages):  # where vitlab.train keeps them too (DigitsDataModule.setup)
            ds.images, ds.labels = ds.images.to(device), ds.labels.to(device)
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    optimizer = make_optimizer(model, module.optim)
    scheduler = make_scheduler(optimizer, module.optim, epochs * len(train_loader), epochs)
    times = LoopTimes()
    for _ in range(epochs):
        start = last = time.perf_counter()
        times.step_s.append([])
        model.train()
        loss_sum = correct = seen = 0  # running training loss and accuracy, as any loop reports them
        for batch in train_loader:
            x, y = datamodule.device_transform([t.to(device, non_blocking=True) for t in batch], train=True)
            target = y
            if mixup is not None and torch.rand(()) < module.mixup_prob:
                x, target = mixup(x, y)
            logits = model(x)
            loss = F.cross_entropy(logits, target, label_smoothing=smoothing)
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


def bench_overhead(train_cfg: DictConfig, b: DictConfig) -> dict[str, Any]:
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


# ---- entry point -----------------------------------------------------------------------------------


def check(b: DictConfig) -> None:
    def choice(key: str, allowed) -> None:
        if b[key] not in allowed:
            raise UserError(f"benchmark.{key} {b[key]!r} is not one of {list(allowed)}")

    choice("task", TASKS)
    choice("precision", PRECISIONS)
    choice("timm_optimizer", TIMM_OPTIMIZERS)
    for key, allowed in (("contenders", CONTENDERS), ("modes", MODES)):
        bad = [v for v in b[key] if v not in allowed]
        if bad or not b[key] or len(set(b[key])) != len(b[key]):
            raise UserError(f"benchmark.{key} {list(b[key])} must be distinct values from {list(allowed)}")
    for key in ("batch_size", "repeats", "steps"):
        if not isinstance(b[key], int) or b[key] < 1:
            raise UserError(f"benchmark.{key} {b[key]!r} must be an integer >= 1")
    if not isinstance(b.warmup, int) or b.warmup < 0:
        raise UserError(f"benchmark.warmup {b.warmup!r} must be an integer >= 0")
    for key in ("epochs", "rounds"):
        if not isinstance(b.overhead[key], int) or b.overhead[key] < 1:
            raise UserError(f"benchmark.overhead.{key} {b.overhead[key]!r} must be an integer >= 1")


def environment(device: torch.device) -> dict[str, Any]:
    import lightning
    import timm

    env = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    if report["task"] == "overhead":
        table = Table(title="vitlab.train's Lightning loop vs a plain loop (medians)")
        for col in ("loop", "ms / train step", "s / epoch (val + ckpt incl.)", "steps / epoch"):
            table.add_column(col)
        for name, r in report["results"].items():
            step, epoch = r["step"]["median_ms"], r["epoch"]["median_ms"] / 1e3
            table.add_row(name, f"{step:.3f}", f"{epoch:.3f}", str(r["steps_per_epoch"]))
        console.print(table)
        ratio = report["ratios"]["lightning/plain"]
        console.print(f"Lightning / plain time: {ratio['step_time']:.3f} per step, {ratio['epoch_time']:.3f} per epoch")
        return
    b, peak = report["benchmark"], report["peak"]
    table = Table(
        title=f"{report['model']} batch {b['batch_size']} {b['precision']}{' compiled' if b['compile'] else ''} on "
        f"{report['environment'].get('gpu', report['environment']['device'])}: "
        f"{report['flops']['forward_gflops_per_image']:.3f} GFLOPs/img forward, peak {peak['flops_per_s'] / 1e12:.3f} "
        f"TFLOP/s ({peak['dtype']} {peak['size']}^3 matmul)"
    )
    for col in ("mode", "model", "median ms", "img/s", "TFLOP/s", "MFU", "peak MB", "step MB", "ratio"):
        table.add_column(col, justify="right" if col not in ("mode", "model") else "left")
    for mode, rows in report["results"].items():
        first = next(iter(rows))
        for name, r in rows.items():
            ratio = report["ratios"][mode].get(f"{first}/{name}")
            shown = ""
            if ratio:
                low, high = ratio["throughput_paired_min"], ratio["throughput_paired_max"]
                shown = f"{ratio['throughput']:.3f} [{low:.3f}, {high:.3f}]"
            table.add_row(
                mode,
                name,
                f"{r['median_ms']:.2f}",
                f"{r['images_per_s']:.1f}",
                f"{r['achieved_flops_per_s'] / 1e12:.3f}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['peak_memory_mb']:.0f}",
                f"{r['step_memory_mb']:.0f}",
                shown,
            )
    console.print(table)
    console.print(
        f"ratio: {first}'s throughput over each other's (of the medians) [min, max of the per-round ratios]",
        markup=False,
    )


@entry_point("benchmark")
def main(cfg: DictConfig) -> dict[str, Any]:
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    b = cfg.benchmark
    check(b)
    report: dict[str, Any] = {"task": b.task, "benchmark": OmegaConf.to_container(b, resolve=True)}
    if b.task == "overhead":
        chosen = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].lstrip("+~") in ("model", "optim")]
        if chosen:
            raise UserError(
                f"benchmark.task=overhead times vitlab.train's own config; {chosen[0]!r} does not reach it: put "
                "it in benchmark.overhead.train_overrides, e.g. 'benchmark.overhead.train_overrides=[model.depth=2]'"
            )
        train_cfg = compose("train", overrides=list(b.overhead.train_overrides))
        report["train_overrides"] = list(b.overhead.train_overrides)
        report["environment"] = environment(pick_device("auto"))
        report.update(bench_overhead(train_cfg, b))
    else:
        device = pick_device(b.device)
        model_cfg = vit_config(cfg.model)
        report["model"] = HydraConfig.get().runtime.choices.get("model") or cfg.model.get("variant") or "custom"
        report["timm_name"] = cfg.model.get("timm_name")
        report["config"] = model_cfg.to_dict()
        report["environment"] = environment(device)
        report.update(bench_models(model_cfg, b, OmegaConf.to_container(cfg.optim, resolve=True), device))
    print_report(report)
    out = Path(HydraConfig.get().runtime.output_dir) / "benchmark.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")  # as vitlab.train: TF32 matmuls on GPUs that have them
    main()
