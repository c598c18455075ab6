"""The assembly of a fit: a run's plan (training.run.plan.TrainPlan, made once by vitlab.cli.plans) becomes the
objects a command runs (data module, module, callbacks, Trainer), each builder taking the part of the plan it uses;
a checkpoint becomes a module to test or predict with in inference.py. Every command (`train`, `eval`, `predict`,
`visualize`, `benchmark`) calls these; no command imports another. The loggers' lifecycle is in loggers.py,
Lightning's work-arounds in workarounds.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only

from vitlab.data import naflex, sizes
from vitlab.model.config import ViTConfig
from vitlab.training.callbacks.health import AdaptiveGradientClipping
from vitlab.training.callbacks.standard import NonFiniteLoss, RichBar, TQDMBar
from vitlab.training.devices import float8, sharding
from vitlab.training.devices.hardware import resolve_trainer
from vitlab.training.devices.rank_state import RankState
from vitlab.training.module import OBJECTIVES, ViTModule
from vitlab.training.optim import OptimConfig, scaled_lr
from vitlab.training.run.loggers import RunIds, build_loggers, instantiate_group, loggers_finished
from vitlab.training.run.plan import TrainPlan
from vitlab.training.run.ranges import check_devices
from vitlab.training.run.workarounds import LightningWorkarounds
from vitlab.utils.clipping import check_clipping
from vitlab.utils.errors import UserError
from vitlab.utils.logs import PROGRESS_BARS, route_lightning_logs

log = logging.getLogger(__name__)
route_lightning_logs()

__all__ = [
    "build_datamodule",
    "data_views",
    "fit_datamodule",
    "build_fit",
    "build_module",
    "build_trainer",
    "build_callbacks",
    "settle_trainer",
]


def build_datamodule(data: Mapping[str, Any], **extra: Any) -> L.LightningDataModule:
    """The data module of the data settings `data` (resolved, with their `_target_`), `extra` arguments beside them."""
    return instantiate(data, **extra)


def data_views(data: Mapping[str, Any], objective: Mapping[str, Any], model: ViTConfig) -> dict[str, Any]:
    """The data module's arguments beside its settings `data` that a run of `model` under `objective` adds: the
    objective's views (objective=dino's multi-crop: Objective.data_views) and NaFlex's patches (data/naflex.py)."""
    views = OBJECTIVES[objective.get("name", "classify")].data_views(dict(objective), model)
    return views | naflex.data_views(data, objective, model)


def fit_datamodule(plan: TrainPlan, **extra: Any) -> L.LightningDataModule:
    """The data module a plan trains on: its data settings with the views the plan settled (data_views)."""
    return build_datamodule(plan.data, **plan.views, **extra)


def build_module(plan: TrainPlan, datamodule: L.LightningDataModule | None, probe: bool = False) -> ViTModule:
    """The ViTModule of a plan, training its objective (random weights; `train` loads pretrained ones). `probe`: the
    module memory.estimate reads before the batch size is chosen (auto_batch): laid out on the meta device (nothing
    allocated), no data module yet."""
    # trainer=fsdp: the ViT is laid out on the meta device and each process initialises its shards
    # (training.devices.sharding); pretrained weights are loaded into a whole model, built on the host.
    on_meta = probe or (sharding.requests_fsdp(plan.trainer) and plan.weights is None)
    schedules = {name: kind.schedules for name, kind in OBJECTIVES.items()}
    sizes.check_model(getattr(datamodule, "size_schedule", None), plan.model, plan.objective.get("name"), schedules)
    with sharding.networks_on_meta(on_meta):
        return ViTModule(
            model=plan.model,
            objective=plan.objective,
            optim=plan.optim,
            scheduler=plan.scheduler,
            compile=plan.compile,
            class_names=list(getattr(datamodule, "class_names", []) or []),
            data=plan.data,
            freeze_backbone=plan.freeze_backbone,
            peft=plan.peft,  # peft=: loads its base weights itself (training.adapters.attach)
        )


def scaled_optim(optim: Mapping[str, Any], data: Mapping[str, Any], trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The optimiser settings `optim` with optim.lr_base set: optim.lr becomes lr_base scaled by the global batch
    (timm's, DeiT's and MAE's rule), the batch being data.batch_size (already global: per device x devices x nodes) x
    trainer.accumulate_grad_batches. Both are logged and kept in the settings, so config.yaml and the checkpoints
    say which learning rate ran. Without lr_base, `optim` as it is."""
    given = OptimConfig.from_dict(dict(optim))
    if given.lr_base is None:
        return dict(optim)
    batch, how = global_batch(data, trainer)
    lr = scaled_lr(given, batch)
    log.info(
        "optim.lr %.4g: optim.lr_base %g x %s(global batch %d / optim.lr_base_size %d); global batch %s",
        lr,
        given.lr_base,
        "sqrt" if given.lr_base_scale == "sqrt" else "",
        given.global_batch or batch,
        given.lr_base_size,
        f"{given.global_batch} (optim.global_batch)" if given.global_batch else how,
    )
    return {**optim, "lr": lr, "global_batch": given.global_batch or batch}


def global_batch(data: Mapping[str, Any], trainer: Mapping[str, Any]) -> tuple[int, str]:
    """The images per optimizer step over every process (MAE's eff_batch_size), and how it was counted."""
    t = trainer or {}
    accumulate, devices, nodes = t.get("accumulate_grad_batches", 1) or 1, t.get("devices", 1), t.get("num_nodes", 1)
    batch, how = data["batch_size"], f"= data.batch_size {data['batch_size']}"
    schedule = sizes.SizeSchedule.from_data(data)
    if schedule is not None and schedule.batch_sizes:  # as timm's train.py: the schedule's average batch
        average = schedule.average_batch(batch, t.get("max_epochs"))
        batch, how = round(average), f"= {average:.2f}, data.train_batch_sizes averaged over their schedule,"
    elif isinstance(devices, int) and devices > 0 and isinstance(nodes, int) and nodes > 0:
        per = data["batch_size"] / (devices * nodes)
        how += f" ({per:g} per device x {devices} devices x {nodes} nodes)"
    batch *= accumulate
    return batch, how + f" x trainer.accumulate_grad_batches {accumulate}"


def progress_bar(choice: str) -> tuple[list, bool]:
    """The progress-bar callbacks and Trainer flag of `progress_bar=`; without a bar (a log file, CI)
    the EpochLog callback (conf/callbacks/epoch_log.yaml) writes a line per epoch."""
    if choice not in PROGRESS_BARS:
        raise UserError(f"progress_bar {choice!r} is not one of {list(PROGRESS_BARS)}")
    if choice == "auto":
        choice = "rich" if sys.stdout.isatty() else "none"
    if choice == "none":
        return [], False
    return [RichBar() if choice == "rich" else TQDMBar()], True  # (epochs counted from 1)


def build_callbacks(
    callbacks: Mapping[str, Any] | None, bar: str, extra: Sequence[L.Callback] = ()
) -> tuple[list[L.Callback], bool]:
    """The configured callbacks (conf/callbacks: the plan's nodes), the progress bar's (`bar`: progress_bar=) and
    `extra`; and whether a bar is shown."""
    bars, show_bar = progress_bar(bar)
    return instantiate_group(callbacks) + bars + [RunIds(), *extra], show_bar


@dataclasses.dataclass
class Fit:
    """What the benchmarks fit, assembled as `vitlab.train` assembles it: built by `build_fit`, its loggers ended by
    `finished`."""

    datamodule: L.LightningDataModule
    module: ViTModule
    trainer: L.Trainer
    loggers: list[Any]

    @contextlib.contextmanager
    def finished(self) -> Iterator[Fit]:
        with loggers_finished(self.loggers):
            yield self


def build_fit(
    plan: TrainPlan,
    callbacks: Sequence[L.Callback] = (),
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> Fit:
    """vitlab.train's steps from data to Trainer (a data module built from the plan's data may be given), with
    `callbacks` added and `trainer_kwargs` over the plan's trainer settings."""
    datamodule = fit_datamodule(plan) if datamodule is None else datamodule
    module = build_module(plan, datamodule)
    all_callbacks, show_bar = build_callbacks(plan.callbacks, plan.progress_bar, callbacks)
    loggers = build_loggers(plan.loggers)
    trainer = build_trainer(
        plan.trainer, callbacks=all_callbacks, logger=loggers or False, enable_progress_bar=show_bar, **trainer_kwargs
    )
    return Fit(datamodule, module, trainer, loggers)


def settle_trainer(trainer: Mapping[str, Any], *, said: bool = True) -> dict[str, Any]:
    """The trainer settings checked and settled, once, before anything is built: the devices it asks for
    (ranges.check_devices), `auto` precision and strategy resolved (devices/hardware.py) and the choice said in one
    line (`said` False: only where `auto` changed something), clipping's value there (utils/clipping.py). A command's
    plan takes this; build_trainer finds nothing left to choose."""
    check_devices(trainer)
    settled, chosen = resolve_trainer(trainer)
    if (said or settled != dict(trainer)) and rank_zero_only.rank == 0:  # 'auto' is ours: Lightning's next
        log.info(chosen)
    check_clipping(settled)
    return settled


def build_trainer(trainer: Mapping[str, Any], **kwargs: Any) -> L.Trainer:
    """The Lightning Trainer of the settled trainer settings `trainer` (settle_trainer's, with their `_target_`).
    Lightning's own refusal of a setting becomes one line: a device request this machine cannot serve names what there
    is; any other names the setting."""
    # What every run needs, whatever its callbacks group says: the non-finite-loss stop, each process's state in
    # its checkpoints, and the Lightning workarounds (workarounds.py).
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), NonFiniteLoss(), RankState(), LightningWorkarounds()]
    if trainer.get("gradient_clip_algorithm") == "agc":  # Lightning's Trainer knows value and norm only
        factor = trainer["gradient_clip_val"]
        kwargs["callbacks"].append(AdaptiveGradientClipping(float(factor)))  # after Health: it reads unclipped norms
        kwargs |= {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    try:
        return instantiate(trainer, **kwargs | float8.trainer_arguments(trainer))  # (precision=float8)
    except InstantiationException as e:
        cause = e.__cause__
        if not isinstance(cause, (MisconfigurationException, ValueError)) or isinstance(cause, UserError):
            raise
        text = str(cause).strip().splitlines()[0]
        if isinstance(cause, MisconfigurationException) and _is_device_error(text):
            have = f"{torch.cuda.device_count()} CUDA GPU(s) and {os.cpu_count()} CPU cores"
            raise UserError(
                f"trainer.accelerator={trainer.get('accelerator')!r} trainer.devices="
                f"{trainer.get('devices')!r} cannot run here ({text}); this machine has {have}"
            ) from cause
        raise UserError(f"trainer: {text}") from cause


def _is_device_error(text: str) -> bool:
    return any(word in text.lower() for word in ("device", "accelerator", "gpu", "cuda", "mps", "tpu"))
