"""python -m vitlab.train [overrides]: fit, then test the best checkpoint.

Prints the resolved config as a tree and saves it (config.yaml) in the run directory, writes the
final metrics to metrics.json there, and returns `optimized_metric` for sweepers (-m, Optuna).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from vitlab.cli import entry_point, print_config_tree, vit_config
from vitlab.convert.timm import load_timm_weights
from vitlab.lit_module import ViTModule, read_checkpoint

log = logging.getLogger(__name__)

PROGRESS_BARS = ("auto", "rich", "tqdm", "none")


def check_launch(cfg: DictConfig) -> None:
    """Lightning's DDP launcher re-runs this command for every rank; under a -m sweep on the basic
    launcher every child would re-run the whole sweep. Stop before anything starts."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or "submitit" in str(hc.launcher.get("_target_", "")):
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
        raise ValueError(
            f"-m sweeps run each job in this process, but trainer.devices={devices} "
            f"(num_nodes={nodes}) needs one process per device, which Lightning starts by "
            "re-running the command: sweep with trainer.devices=1, or use hydra/launcher=slurm "
            "(one SLURM job per sweep point)"
        )


def progress_bar(choice: str) -> tuple[list, bool]:
    if choice not in PROGRESS_BARS:
        raise ValueError(f"progress_bar {choice!r} is not one of {list(PROGRESS_BARS)}")
    if choice == "auto":
        choice = "rich" if sys.stdout.isatty() else "none"
    return ([RichProgressBar()] if choice == "rich" else []), choice != "none"


def resolve_ckpt_path(ckpt_path: str | None, runs_dir: Path) -> str | None:
    """`last`: the newest last.ckpt or interrupted.ckpt among this task's earlier runs."""
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"ckpt_path {ckpt_path!r} does not exist")
        return ckpt_path
    found = [p for name in ("last.ckpt", "interrupted.ckpt") for p in runs_dir.glob(f"*/checkpoints/{name}")]
    if not found:
        raise FileNotFoundError(f"ckpt_path=last: no last.ckpt or interrupted.ckpt under {runs_dir}/*/checkpoints")
    return str(max(found, key=lambda p: p.stat().st_mtime))


def check_resumable(ckpt_path: str, module: ViTModule) -> None:
    """Refuse, in one line, a checkpoint of another architecture or class count before Lightning
    fails deep inside load_state_dict."""
    theirs = read_checkpoint(ckpt_path)["hyper_parameters"]["model"]
    ours = module.hparams["model"]
    diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k] and k not in RESUME_MAY_DIFFER}
    if diff:
        shown = ", ".join(f"{k}={a!r} (this run: {b!r})" for k, (a, b) in list(diff.items())[:4])
        raise ValueError(f"ckpt_path {ckpt_path!r} was trained with a different model: {shown}")


# Regularisation may change between a run and its resumption; the architecture may not.
RESUME_MAY_DIFFER = {"drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"}


def make_trainer(trainer_cfg: DictConfig, **kwargs: Any) -> L.Trainer:
    """The Lightning Trainer of the config; a request this machine cannot serve (a GPU where there is
    none, more devices than exist) is one line naming what was asked and what there is."""
    from hydra.errors import InstantiationException
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return instantiate(trainer_cfg, **kwargs)
    except InstantiationException as e:
        if not isinstance(e.__cause__, MisconfigurationException):
            raise
        have = f"{torch.cuda.device_count()} CUDA GPU(s) and {os.cpu_count()} CPU cores"
        raise ValueError(
            f"trainer.accelerator={trainer_cfg.get('accelerator')!r} trainer.devices="
            f"{trainer_cfg.get('devices')!r} cannot run here ({e.__cause__}); this machine has {have}"
        ) from None


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Every entry with a _target_ in a callbacks/logger group, in order."""
    if not group:
        return []
    return [instantiate(node) for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


@rank_zero_only
def write_metrics(path: Path, metrics: dict[str, Any]) -> None:
    path.write_text(json.dumps(metrics, indent=2))


def build_module(cfg: DictConfig, datamodule: L.LightningDataModule) -> ViTModule:
    """The ViTModule of a train config (random weights; `train` loads pretrained ones)."""
    return ViTModule(
        model=vit_config(cfg.model).to_dict(),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        label_smoothing=cfg.label_smoothing,
        mixup=OmegaConf.to_container(cfg.mixup, resolve=True),
        compile=cfg.compile,
        class_names=list(getattr(datamodule, "class_names", []) or []),
        data=OmegaConf.to_container(cfg.data, resolve=True),
        freeze_backbone=cfg.freeze_backbone,
    )


def train(cfg: DictConfig) -> float | None:
    started = time.time()
    check_launch(cfg)
    out = Path(cfg.paths.output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    log.info("seed %s", cfg.seed)

    datamodule = instantiate(cfg.data)
    module = build_module(cfg, datamodule)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, Path(cfg.paths.log_dir) / cfg.task_name / "runs")
    if ckpt_path:
        check_resumable(ckpt_path, module)
    elif cfg.model.pretrained:
        load_timm_weights(module.model, cfg.model.pretrained)

    bars, show_bar = progress_bar(cfg.progress_bar)
    callbacks = instantiate_group(cfg.get("callbacks")) + bars
    loggers = instantiate_group(cfg.get("logger"))
    trainer = make_trainer(cfg.trainer, callbacks=callbacks, logger=loggers or False, enable_progress_bar=show_bar)
    if trainer.is_global_zero:
        print_config_tree(cfg, save_to=out / "config.yaml")
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    metrics: dict[str, Any] = {}
    try:
        if cfg.train:
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
            except SIGTERMException:
                raise SystemExit(143) from None  # 128 + SIGTERM; SaveOnInterrupt said where it saved
            metrics.update({k: v.item() for k, v in trainer.callback_metrics.items()})
        if cfg.test:
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            if cfg.train and not best:
                log.warning("no best checkpoint was saved; testing the final weights")
            ckpt = best or (None if cfg.train else ckpt_path)
            trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True if ckpt else None)
            metrics.update({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
            metrics["tested_checkpoint"] = ckpt or "final weights"
    finally:
        if any(isinstance(lg, WandbLogger) for lg in loggers):
            import wandb

            wandb.finish()  # one wandb run per job, also in sweeps
    metrics["wall_time_s"] = round(time.time() - started, 2)
    metrics["run_dir"] = str(out)
    write_metrics(out / "metrics.json", metrics)

    if cfg.optimized_metric is None:
        return None
    if cfg.optimized_metric not in metrics:
        message = f"optimized_metric {cfg.optimized_metric!r} was not logged; logged: {sorted(metrics)}"
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a sweeper needs the value
            raise ValueError(message)
        log.warning(message)  # e.g. training stopped by max_steps before the first validation
        return None
    return metrics[cfg.optimized_metric]


@entry_point("train")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
