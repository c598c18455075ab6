"""What a config's nodes must satisfy before anything is built, checked by every command (vitlab.cli.entry.check_config)
and again where the build happens (build.py): each node with a `_target_` (data module, Trainer, callbacks, loggers)
against its target's declared types, Lightning's Trainer also within the ranges its documentation gives
(TrainerRanges), and what a target's values must satisfy besides (BEFORE_BUILD: an image folder's class count); the
devices a trainer asks for, and a sweep's launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypedDict

import lightning as L
import torch
from annotated_types import Ge, Interval
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from vitlab.data.base import DataModule
from vitlab.data.imagefolder import ImageFolderDataModule, check_class_folders
from vitlab.utils.checks import (
    Fraction,
    NonNegativeInt,
    NonNegativeNumber,
    PositiveInt,
    check_arguments,
    check_clipping,
)
from vitlab.utils.errors import UserError


def check_nodes(cfg: DictConfig) -> None:
    """Every node of a command's config that builds something (`_target_`: the data module, the Trainer, each
    callback and logger, at the top or one level down) against its target's types (check_node), and the devices the
    trainer asks for, before any is built."""
    for key, node in _nodes(cfg):
        if "_target_" in node:
            check_node(node, key)
        else:
            for name, inner in _nodes(node):
                if "_target_" in inner:
                    check_node(inner, f"{key}.{name}")
    if isinstance(cfg.get("trainer"), DictConfig):
        check_devices(cfg.trainer)
        check_clipping(cfg.trainer)


def _nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    """The config nodes directly in `cfg` (leaves left unresolved), without Hydra's own."""
    for key in cfg:
        node = OmegaConf.select(cfg, str(key), throw_on_missing=False, throw_on_resolution_failure=False)
        if isinstance(node, DictConfig) and key != "hydra":
            yield str(key), node


def check_launch(cfg: DictConfig) -> None:
    """Lightning's DDP launcher re-runs this command for every rank; under a -m sweep on a launcher that runs
    jobs in this process (the basic one) or as one process each (submitit_local), every child would re-run the
    whole sweep. Stop before anything starts; the Slurm launcher starts one task per device itself."""
    hc = HydraConfig.get()
    launcher = str(hc.launcher.get("_target_", ""))
    if hc.mode != RunMode.MULTIRUN or launcher.endswith("SlurmLauncher"):
        return
    t = cfg.trainer
    devices, nodes = t.get("devices", 1), t.get("num_nodes", 1)
    many = (
        nodes > 1
        or devices in (-1, "auto")
        or (isinstance(devices, int) and devices > 1)
        or (not isinstance(devices, (int, str)) and len(devices) > 1)
    )
    if many:
        how = "as one process (hydra/launcher=submitit_local)" if "submitit" in launcher else "in this process"
        raise UserError(
            f"-m sweeps run each job {how}, but trainer.devices={devices} (num_nodes={nodes}) needs one process "
            "per device, which Lightning starts by re-running the command: sweep with trainer.devices=1, or use "
            "hydra/launcher=slurm (one Slurm job per sweep point, one task per device)"
        )


class TrainerRanges(TypedDict):
    """Lightning's Trainer arguments with the ranges its documentation gives and its constructor leaves unchecked
    (accumulate_grad_batches=0 divides by zero in estimated_stepping_batches, log_every_n_steps=0 at the first
    logging step, once a run directory and processes exist) or checks in a sentence of its own; the types are
    Lightning's. `precision: auto` is vitlab's (training/devices/hardware.py)."""

    precision: Literal["auto"] | _PRECISION_INPUT | None
    num_nodes: PositiveInt
    fast_dev_run: bool | NonNegativeInt
    max_epochs: Annotated[int, Ge(-1)] | None  # -1: no limit
    min_epochs: NonNegativeInt | None
    max_steps: Annotated[int, Ge(-1)]  # -1: no limit
    min_steps: NonNegativeInt | None
    limit_train_batches: NonNegativeInt | Fraction | None  # a count of batches, or a fraction of them
    limit_val_batches: NonNegativeInt | Fraction | None
    limit_test_batches: NonNegativeInt | Fraction | None
    limit_predict_batches: NonNegativeInt | Fraction | None
    overfit_batches: NonNegativeInt | Fraction
    val_check_interval: PositiveInt | Annotated[float, Interval(gt=0, le=1)] | str | dict[str, int] | None
    check_val_every_n_epoch: PositiveInt | None
    num_sanity_val_steps: Annotated[int, Ge(-1)] | None  # -1: every validation batch
    log_every_n_steps: PositiveInt | None
    accumulate_grad_batches: PositiveInt
    gradient_clip_val: NonNegativeNumber | None
    gradient_clip_algorithm: Literal["value", "norm", "agc"] | None  # agc: training.callbacks.health
    reload_dataloaders_every_n_epochs: NonNegativeInt


class DataRanges(TypedDict):
    batch_size: PositiveInt | Literal["auto"]  # auto: vitlab.train chooses it (training.run.auto_batch)


# A target -> the narrower (or wider) types of some of its arguments (check_arguments' `narrower`).
NARROWER: dict[type, Any] = {L.Trainer: TrainerRanges, DataModule: DataRanges}


def _class_folders(values: dict[str, Any]) -> None:
    if isinstance(values.get("num_classes"), int) and isinstance(values.get("data_dir"), str):
        check_class_folders(values["data_dir"], values["num_classes"], bool(values.get("unlabeled")))


# A target -> what else its values must satisfy, checked before it is built (the files they name).
BEFORE_BUILD: dict[type, Any] = {ImageFolderDataModule: _class_folders}


def check_node(node: DictConfig, key: str) -> None:
    """The values of a config node that builds something (`_target_`), and of the nodes in it, have the types
    their target declares (utils.checks.check_arguments), within the ranges NARROWER gives, and satisfy what
    BEFORE_BUILD asks of them: a wrong type or value is one line naming the key before anything is built, not a
    TypeError deep inside (Lightning's Trainer arguments included)."""
    try:
        target = get_object(str(node._target_))
    except Exception:  # an unknown target: instantiate names it
        return
    narrower = next((n for t, n in NARROWER.items() if isinstance(target, type) and issubclass(target, t)), None)
    values = _resolved(node)
    check_arguments(target, values, key, narrower)
    for kind, check in BEFORE_BUILD.items():
        if isinstance(target, type) and issubclass(target, kind):
            check(values)
    for name in node:
        value = OmegaConf.select(node, str(name), throw_on_missing=False, throw_on_resolution_failure=False)
        inner = value if isinstance(value, ListConfig) else [value]
        for i, item in enumerate(inner):
            if isinstance(item, DictConfig) and "_target_" in item:
                check_node(item, f"{key}.{name}" + (f"[{i}]" if isinstance(value, ListConfig) else ""))


def _resolved(node: DictConfig) -> dict[str, Any]:
    """A node's values, resolved; one that refers to a key this config lacks is left to the command, which sets it
    (eval's data.img_size, `${model.img_size}` in training, is the checkpoint model's)."""
    values = {}
    for key in node:
        try:
            value = node[key]
        except InterpolationKeyError:
            continue
        values[str(key)] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return values


def check_devices(t: DictConfig) -> None:
    """Several devices with accelerator=auto on a machine without a GPU would start that many CPU processes, each
    as slow as the machine is small: say so, and how to ask for CPU processes on purpose."""
    devices, accelerator = t.get("devices", 1), t.get("accelerator", "auto")
    if isinstance(devices, bool) or (isinstance(devices, int) and devices < -1 or devices == 0):
        raise UserError(
            f"trainer.devices={devices} must be a number of devices >= 1, -1 (every GPU), auto, or a list of GPU "
            "indices"
        )
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if devices in (-1, "-1") and on_cpu:
        raise UserError(
            "trainer.devices=-1 means every GPU, and this run is on the CPU (no GPU here, or trainer.accelerator=cpu): "
            "give a number of CPU processes (trainer=ddp_cpu trainer.devices=2), or trainer.devices=1"
        )
    many = (isinstance(devices, int) and devices > 1) or (not isinstance(devices, (int, str)) and len(devices) > 1)
    if accelerator == "auto" and many and not torch.cuda.is_available():
        raise UserError(
            f"trainer.devices={devices} asks for {devices} devices and this machine has no GPU: that would train in "
            f"{devices} CPU processes; ask for them with trainer=ddp_cpu trainer.devices={devices}, or train on the "
            "CPU in one process with trainer.devices=1"
        )
