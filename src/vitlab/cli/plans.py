"""A command's config, once composed and checked, becomes its plan here: one frozen value of typed parts
(training.run.plan.TrainPlan for vitlab.train and the benchmarks), the only place below the command file where the
composed config is read. Each decision the config settles is taken once, before anything is built: pretrained weights'
architecture and preprocessing, the trainer's `auto` precision and strategy, the learning rate from optim.lr_base,
the checkpoint to go on from (read once), the best checkpoint's metric following the objective, the metric a sweeper
optimises. What ran is what config.yaml says (`as_ran`).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.model.config import vit_config
from vitlab.training import pretrained
from vitlab.training.callbacks import trial
from vitlab.training.devices import sharding
from vitlab.training.module import OBJECTIVES
from vitlab.training.run import build, resume
from vitlab.training.run.plan import TrainPlan

log = logging.getLogger(__name__)


def train_plan(cfg: DictConfig) -> TrainPlan:
    """The plan of a vitlab.train config (checked: vitlab.cli.entry), every decision in it taken: trainer=fsdp on one
    process says so; model.pretrained=<weights> becomes the model's architecture and the data's preprocessing (on a
    copy: `cfg` stays as composed); the trainer's `auto`, the learning rate, the checkpoint to go on from."""
    if said := sharding.check_request(cfg.trainer, cfg.get("callbacks")):
        logging.getLogger("vitlab.train").info(said)
    planned, weights = _with_pretrained(cfg)
    config = OmegaConf.to_container(planned, resolve=True)
    data = config["data"]
    if weights is not None:
        pretrained.take_preprocessing(data, weights, OmegaConf.to_container(cfg.model, resolve=True))
    trainer = build.settle_trainer(config["trainer"])
    optim = config["optim"] if data.get("batch_size") == "auto" else build.scaled_optim(config["optim"], data, trainer)
    ckpt = resume.planned_checkpoint(
        cfg.ckpt_path, Path(cfg.paths.log_dir) / cfg.task_name / "runs", Path(cfg.paths.output_dir), trainer
    )
    return TrainPlan(
        model=vit_config(config["model"]),
        data=data,
        objective=OmegaConf.to_container(cfg.objective, resolve=True, throw_on_missing=True),  # a `???` named
        optim=optim,
        scheduler=config["scheduler"],
        trainer=trainer,
        callbacks=OmegaConf.to_container(checkpoint_follows_objective(planned), resolve=True).get("callbacks") or {},
        loggers=config.get("logger") or {},
        weights=weights,
        resume=ckpt,
        output_dir=Path(cfg.paths.output_dir),
        seed=cfg.seed,
        train=cfg.train,
        test=cfg.test,
        compile=cfg.compile,
        freeze_backbone=cfg.freeze_backbone,
        memory_check=cfg.memory_check,
        memory_budget_gb=cfg.get("memory_budget_gb"),
        resample_patch=bool(config["model"].get("resample_patch")),
        progress_bar=cfg.progress_bar,
        print_config=bool(cfg.get("print_config")),
        optimized_metric=optimized_metric(cfg),
        pruning=(trial.PruneTrial(cfg.optimized_metric),) if trial.sweep_pruner()[0] else (),
        config=config,
    )


def _with_pretrained(cfg: DictConfig) -> tuple[DictConfig, Any]:
    """A copy of `cfg` whose model group is what model.pretrained makes of it (training.pretrained.pretrained_model),
    so that the data's `${model.img_size}` and `${oc.select:model.patch_size}` follow; the weights (None without)."""
    weights, model = pretrained.pretrained_model(
        OmegaConf.to_container(cfg.model, resolve=True), pretrained.explicit_model_keys()
    )
    if weights is None:
        return cfg, None
    planned = copy.deepcopy(cfg)
    with open_dict(planned):
        planned.model.update(model)
    return planned, weights


def as_ran(plan: TrainPlan) -> dict[str, Any]:
    """The run's resolved config as it ran, for config.yaml and the loggers' hyperparameters: the config as planned with
    the plan's data (the batch auto chose, the weights' preprocessing), optimiser (the scaled lr) and trainer (`auto`
    chosen)."""
    return plan.config | {"data": plan.data, "optim": plan.optim, "trainer": plan.trainer}


def optimized_metric(cfg: DictConfig) -> str | None:
    """`optimized_metric`; in a single run its default (val/acc_best) follows an objective that logs no accuracy
    (val/loss_best), as the best checkpoint does. A sweep keeps what it was given: its direction goes with it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    key, (watched, _) = (
        cfg.get("optimized_metric"),
        OBJECTIVES[(cfg.get("objective") or {}).get("name", "classify")].best,
    )
    single = not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN
    return f"val/{watched}_best" if key == "val/acc_best" and watched != "acc" and single else key


def checkpoint_follows_objective(cfg: DictConfig) -> DictConfig:
    """The default choice of the best checkpoint (val/acc, highest) under an objective that logs no accuracy (MAE,
    DINO without its k-NN callback): that objective's own (val/loss, lowest), said in a line, in a copy of `cfg` (an
    early stop's monitor follows it); a monitor set in a recipe or on the command line is kept."""
    node = (cfg.get("callbacks") or {}).get("model_checkpoint")
    watched, mode = OBJECTIVES[(cfg.get("objective") or {}).get("name", "classify")].best
    if node is None or node.get("monitor") != "val/acc" or watched == "acc":
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.callbacks.model_checkpoint.monitor, cfg.callbacks.model_checkpoint.mode = f"val/{watched}", mode
    if rank_zero_only.rank == 0:
        log.info("objective=%s logs no val/acc: the best checkpoint is the one of the %s val/%s", cfg.objective.name,
                 "lowest" if mode == "min" else "highest", watched)  # fmt: skip
    return cfg
