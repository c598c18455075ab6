"""The assembly of a fit: a run's plan (training.run.plan.TrainPlan, made once by vitlab.cli.plans) becomes the
objects a command runs (data module, module, callbacks, Trainer), each builder taking the part of the plan it uses;
a checkpoint becomes a module to test or predict with in inference.py. Every command (`train`, `eval`, `predict`,
`visualize`, `benchmark`) calls these; no command imports another. Every Hydra node with a `_target_` a run builds
(data, callbacks, loggers, Trainer) is instantiated here; the loggers' lifecycle is in loggers.py, the benchmarks'
one-call assembly in fit.py, Lightning's work-arounds in workarounds.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
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
from vitlab.training.callbacks.standard import NonFiniteLoss, RichBar, RunIds, TQDMBar
from vitlab.training.devices import float8, sharding
from vitlab.training.devices.hardware import resolve_trainer
from vitlab.training.devices.rank_state import RankState
from vitlab.training.module import OBJECTIVES, ViTModule
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
    "build_module",
    "build_trainer",
    "build_callbacks",
    "settle_trainer",
    "instantiate_group",
    "trainer_arguments",
]


def instantiate_group(group: Mapping[str, Any] | None, extra: Any = None) -> list[Any]:
    """Every entry with a _target_ in a callbacks/logger group (plain nodes), in order (`extra(its node)`: further
    arguments). The one place a run's callbacks and loggers (a user's own classes too) are instantiated."""
    nodes = [node for node in (group or {}).values() if isinstance(node, Mapping) and "_target_" in node]
    return [instantiate(node, **(extra(node) if extra else {})) for node in nodes]


def build_datamodule(data: Mapping[str, Any], **extra: Any) -> L.LightningDataModule:
    """The data module of the data settings `data` (resolved, with their `_target_`), `extra` arguments beside them."""
    return instantiate(data, **extra)


def data_views(data: Mapping[str, Any], objective: Mapping[str, Any], model: ViTConfig) -> dict[str, Any]:
    """The data module's arguments beside its settings `data` that a run of `model` under `objective` adds: the
    objective's views (objective=dino's multi-crop: Objective.data_views) and NaFlex's patches (data/naflex.py). A
    schedule of training sizes is checked against the model and the objective here, as the run is planned."""
    name = objective.get("name", "classify")
    views = OBJECTIVES[name].data_views(dict(objective), model) | naflex.data_views(data, objective, model)
    schedules = {name: kind.schedules for name, kind in OBJECTIVES.items()}
    sizes.check_model(naflex.training_schedule({**data, **views}), model, name, schedules)
    return views


def fit_datamodule(plan: TrainPlan, **extra: Any) -> L.LightningDataModule:
    """The data module a plan trains on: its data settings with the views the plan settled (data_views)."""
    return build_datamodule(plan.data, **plan.views, **extra)


def build_module(plan: TrainPlan, datamodule: L.LightningDataModule | None, probe: bool = False) -> ViTModule:
    """The ViTModule of a plan, training its objective, from the plan's weights (random ones without). `probe`: the
    module the memory estimate and data.batch_size=auto read as the run is planned (auto_batch): laid out on the meta
    device (nothing allocated, nothing loaded), no data module yet."""
    # trainer=fsdp: the ViT is laid out on the meta device and each process initialises its shards
    # (training.devices.sharding); pretrained weights are loaded into a whole model, built on the host (plan.on_meta).
    with sharding.networks_on_meta() if probe or plan.on_meta else contextlib.nullcontext():
        return ViTModule(
            model=plan.model,
            objective=plan.objective,
            optim=plan.optim,
            scheduler=plan.scheduler,
            compile=plan.compile,
            class_names=list(getattr(datamodule, "class_names", []) or []),
            data=plan.data,
            freeze_backbone=plan.freeze_backbone,
            peft=plan.peft,  # peft=: the adapters on the base weights (training.adapters)
            weights=plan.weights,  # what it starts from (the plan's: a resumed run's checkpoint state goes over them)
            resample_patch=plan.resample_patch,
        )


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


def trainer_arguments(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's arguments that the settled settings `trainer` translate to beyond Lightning's own, decided when
    the run is planned: `gradient_clip_algorithm=agc` (Lightning knows value and norm only) as the
    AdaptiveGradientClipping callback, `precision=float8` as its plugin (devices/float8.py); none otherwise."""
    args: dict[str, Any] = {"callbacks": []}
    if trainer.get("gradient_clip_algorithm") == "agc":
        args["callbacks"] = [AdaptiveGradientClipping(float(trainer["gradient_clip_val"]))]
        args |= {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    return args | float8.trainer_arguments(trainer)


def build_trainer(trainer: Mapping[str, Any], args: Mapping[str, Any], **kwargs: Any) -> L.Trainer:
    """The Lightning Trainer of the settled trainer settings `trainer` (settle_trainer's, with their `_target_`) and
    the arguments they translate to (`args`: trainer_arguments', made with the plan), `kwargs` beside them.
    Lightning's own refusal of a setting becomes one line: a device request this machine cannot serve names what there
    is; any other names the setting."""
    args = dict(args)
    # What every run needs, whatever its callbacks group says: the non-finite-loss stop, each process's state in
    # its checkpoints, and the Lightning workarounds (workarounds.py); AGC after Health: it reads unclipped norms.
    standard = [NonFiniteLoss(), RankState(), LightningWorkarounds()]
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), *standard, *args.pop("callbacks", [])]
    try:
        return instantiate(trainer, **kwargs | args)
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
