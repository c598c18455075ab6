"""vitlab.eval's frozen-feature tasks (task=knn|linear|fewshot), in the processes the trainer config asks for:
Lightning Fabric starts them as the Trainer does (a DDP launch re-runs the command once per further device) and
sets up torch.distributed's group; each process then extracts its share of every split (vitlab.evaluation.features) and
rank 0 gathers, caches and scores. The weights are a checkpoint's, or timm's pretrained weights ported into our
ViT (`model.pretrained=<timm name>` and no ckpt_path), whose own head task=test scores as timm's validate.py does
(vitlab.evaluation.classifier)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.convert.weights import is_weights_file, load_timm_weights
from vitlab.evaluation import classifier
from vitlab.evaluation.features import probe, source_id
from vitlab.model import ViT
from vitlab.model.config import vit_config
from vitlab.training import build
from vitlab.training.node_checks import check_devices
from vitlab.training.pretrained import apply_pretrained
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

# Data settings that change how images are loaded, not which: left out of what identifies cached features.
LOADER_KEYS = ("batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def launch(trainer_cfg: DictConfig) -> torch.device:
    """Start the processes of trainer.accelerator / devices / num_nodes / strategy (this one becomes rank 0);
    this process's device."""
    from lightning.fabric import Fabric

    check_devices(trainer_cfg)
    strategy = trainer_cfg.get("strategy", "auto")
    if not isinstance(strategy, str):
        raise UserError(
            "frozen features are extracted with trainer.strategy=auto or ddp (each process a share of the images, "
            "the whole model in each); this config gives an object (trainer=fsdp?): use trainer=ddp or trainer=ddp_cpu"
        )
    t = trainer_cfg
    fabric = Fabric(accelerator=t.get("accelerator", "auto"), strategy=strategy, devices=t.get("devices", 1),
                    num_nodes=t.get("num_nodes", 1))  # fmt: skip
    fabric.launch()
    return fabric.device


def probe_checkpoint(cfg: DictConfig, model: torch.nn.Module, datamodule) -> dict | None:
    """The task on a checkpoint's model, its features cached beside its run (<run>/features/<checkpoint name>/)."""
    ckpt = Path(cfg.ckpt_path)
    cache = Path(cfg.features_dir) if cfg.features_dir else ckpt.resolve().parent.parent / "features" / ckpt.stem
    return probe(cfg, model, datamodule, source_id(cfg.ckpt_path), cache, launch(cfg.trainer))


def probe_pretrained(cfg: DictConfig) -> dict | None:
    """The task on `model.pretrained`'s weights (a timm name, or a weights file) at the model config's size, on
    `data=<name>`; its features cached in <log_dir>/features/<name>/, identified by the name (a file: its path,
    size and time), our model config and the data config. task=test scores the weights' own head instead
    (`score_pretrained`)."""
    source = OmegaConf.select(cfg, "model.pretrained")
    if not source:
        raise UserError(
            "ckpt_path must be given: ckpt_path=<file.ckpt>, or timm's weights with model.pretrained=<timm name | "
            "local-dir:<folder> | hf-hub:<repo>> data=<name> (task=test: their own head; task=knn|linear|fewshot: "
            "their features, with model=<name>)"
        )
    if "_target_" not in cfg.data:
        raise UserError(f"model.pretrained={source} needs the data to evaluate on: data=<name>")
    if cfg.task == "test":
        return score_pretrained(cfg, source)
    if OmegaConf.select(cfg, "model.img_size") is None:
        raise UserError(f"task={cfg.task} on model.pretrained={source} needs the model's size: model=<name>")
    with open_dict(cfg):  # the model takes the data's channels (its classes: a head the features never reach)
        cfg.model.in_chans, cfg.model.num_classes = cfg.data.get("channels", 3), cfg.data.num_classes
    apply_pretrained(cfg)  # timm's architecture, and the data's mean/std/crop left null become the weights'
    datamodule = build.build_datamodule(cfg.data)
    datamodule.setup("test")
    model = ViT(vit_config(cfg.model))
    load_timm_weights(model, source, reset_head=True)
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in LOADER_KEYS}
    weights = source_id(source) if is_weights_file(source) else {"pretrained": source}
    ident = weights | {"model": OmegaConf.to_container(cfg.model, resolve=True), "data": data}
    name = Path(source).stem if is_weights_file(source) else source.replace("/", "_").replace(":", "_")
    cache = Path(cfg.features_dir) if cfg.features_dir else Path(cfg.paths.log_dir) / "features" / name
    return probe(cfg, model, datamodule, ident, cache, launch(cfg.trainer))


def score_pretrained(cfg: DictConfig, source: str) -> dict:
    """task=test on timm's weights: their own head on the data's images, in this one process, as timm's validate.py
    scores them (evaluation.classifier)."""
    if is_weights_file(source):
        raise UserError(
            f"task=test on model.pretrained={source}: a weights file carries no preprocessing to score it with; give "
            "a timm name or a timm folder (local-dir:<folder>, with its config.json)"
        )
    t = cfg.trainer
    if t.get("num_nodes", 1) != 1 or t.get("devices", 1) not in (1, "1"):
        raise UserError("task=test on model.pretrained runs in one process: set trainer.devices=1")
    metrics, images = classifier.score(cfg, source, launch(cfg.trainer))
    log.info("model.pretrained=%s on %s: %s", source, images, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
