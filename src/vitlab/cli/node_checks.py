"""What a config's nodes must satisfy before anything is built, checked by every command (vitlab.cli.entry.check_config)
before a plan is made of it (cli/plans.py): each node with a `_target_` (data module, Trainer, callbacks,
loggers) against its target's declared types, Lightning's Trainer also within the ranges its documentation gives
(TrainerRanges), and what a target's values must satisfy besides (BEFORE_BUILD: an image folder's class count); the
devices a trainer asks for, and a sweep's launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

import vitlab.data
from vitlab.data.base import DataModule, refuse_indivisible_batch
from vitlab.data.folds import check_folds
from vitlab.data.formats import FORMATS
from vitlab.data.image_module import ImageDataModule
from vitlab.training.run.ranges import DataRanges, TrainerValues, check_devices  # (check_devices: torch-free)
from vitlab.utils.arguments import check_arguments
from vitlab.utils.clipping import check_clipping
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


def check_global_batch(cfg: DictConfig) -> None:
    """Training's processes (trainer.devices as a count or a list, times num_nodes) divide its global data.batch_size,
    said once before any starts rather than by every process as it starts (a resume on 5 processes of a run of 96 a
    step). A size schedule (data.train_batch_sizes) is timm's to check, data.batch_size=auto the search's. (vitlab.eval
    reads data.batch_size per process.)"""
    get = lambda key: OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)  # noqa: E731
    devices, nodes, batch = get("trainer.devices"), get("trainer.num_nodes") or 1, get("data.batch_size")
    devices = len(devices) if isinstance(devices, ListConfig) else devices
    counts = (batch, devices, nodes)
    if get("data.train_batch_sizes") is None and all(type(v) is int and v > 0 for v in counts):
        refuse_indivisible_batch(batch, devices * nodes)


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


class TrainerRanges(TrainerValues):
    """TrainerValues, and `precision` as Lightning types it (`auto` is vitlab's: training/devices/hardware.py; float8
    and float8-rowwise too: training/devices/float8.py)."""

    precision: Literal["auto", "float8", "float8-rowwise"] | _PRECISION_INPUT | None


# A target -> the narrower (or wider) types of some of its arguments (check_arguments' `narrower`).
NARROWER: dict[type, Any] = {L.Trainer: TrainerRanges, DataModule: DataRanges}


def _folds(values: dict[str, Any]) -> None:
    """data.fold one of data.folds' folds (a -m sweep's job: before its directory holds anything)."""
    folds, fold = values.get("folds", 0), values.get("fold", 0)
    if isinstance(folds, int) and isinstance(fold, int):
        check_folds(folds, fold)


# A target -> what else its values must satisfy, checked before it is built (the files they name).
BEFORE_BUILD: dict[type, Any] = {
    getattr(vitlab.data, f.cls): f.before_build for f in FORMATS.values() if f.before_build is not None
} | {ImageDataModule: _folds}


def check_node(node: DictConfig, key: str) -> None:
    """The values of a config node that builds something (`_target_`), and of the nodes in it, have the types
    their target declares (utils.arguments.check_arguments), within the ranges NARROWER gives, and satisfy what
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
