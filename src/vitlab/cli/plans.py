"""A command's config, once composed and checked, becomes its plan here: one frozen value of typed parts
(training.run.plan.TrainPlan for vitlab.train and the benchmarks), the only place below the command file where the
composed config is read. Each decision the config settles is taken once, before anything is built: pretrained weights'
architecture and preprocessing, the trainer's settings checked and its `auto` precision and strategy chosen, the data
module's views, the learning rate from optim.lr_base, the checkpoint to go on from (read once; an average's weights
resolved), the best checkpoint's metric following the objective, the metric a sweeper optimises. The config is made
plain data first; nothing here writes into it. What runs is what config.yaml says (the plan's `config`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitlab.model.config import vit_config
from vitlab.training import adapters, pretrained
from vitlab.training.batch_lr import scaled_optim
from vitlab.training.callbacks import trial
from vitlab.training.devices import sharding
from vitlab.training.module import OBJECTIVES
from vitlab.training.objectives.objective import reads_no_labels
from vitlab.training.run import auto_batch, build, resume
from vitlab.training.run.plan import TrainPlan

log = logging.getLogger(__name__)


def train_plan(cfg: DictConfig) -> TrainPlan:
    """The plan of a vitlab.train config (checked: vitlab.cli.entry), every decision in it taken: trainer=fsdp on one
    process says so; model.pretrained=<weights> becomes the model's architecture and the data's preprocessing; the
    trainer's `auto`, the data module's views, the learning rate, the checkpoint to go on from. The config becomes
    plain data first (`cfg` stays as composed), its interpolations resolved once the model group is final
    (_resolved)."""
    composed = OmegaConf.to_container(cfg)  # interpolations kept: the data's ${model.img_size} follows the weights
    # As composed, before the plan's decisions: what model.pretrained reads, and what trainer=fsdp checks.
    requested = OmegaConf.to_container(cfg.model, resolve=True)
    asked = OmegaConf.to_container(cfg.trainer, resolve=True)
    callbacks = OmegaConf.to_container(cfg.callbacks, resolve=True) if cfg.get("callbacks") else None
    if said := sharding.check_request(asked, callbacks):
        logging.getLogger("vitlab.train").info(said)
    weights, model = pretrained.pretrained_model(requested, pretrained.explicit_model_keys())
    config = _resolved(composed, model)
    data = config["data"]
    if weights is not None:
        pretrained.take_preprocessing(data, weights, requested)
    trainer = build.settle_trainer(config["trainer"])
    optim = config["optim"] if data.get("batch_size") == "auto" else scaled_optim(config["optim"], data, trainer)
    paths = config["paths"]
    ckpt = resume.planned_checkpoint(
        config["ckpt_path"], Path(paths["log_dir"]) / config["task_name"] / "runs", Path(paths["output_dir"]), trainer
    )
    ckpt, weights = resume.weights_to_start_from(ckpt, weights)  # (an average's: a new run from its weights)
    model_cfg = vit_config(config["model"])
    objective = OmegaConf.to_container(cfg.objective, resolve=True, throw_on_missing=True)  # a `???` named
    peft = _peft(config, weights, ckpt)
    plan = TrainPlan(
        model=model_cfg,
        data=data,
        views=build.data_views(data, objective, model_cfg),
        objective=objective,
        optim=optim,
        scheduler=config["scheduler"],
        trainer=trainer,
        trainer_args=build.trainer_arguments(trainer),
        on_meta=sharding.requests_fsdp(trainer) and weights is None,  # (weights are loaded into a whole model)
        callbacks=config.get("callbacks") or {},
        loggers=config.get("logger") or {},
        weights=weights if ckpt is None or peft else None,  # (a resumed run's checkpoint holds its state, but peft's)
        resume=ckpt,
        output_dir=Path(paths["output_dir"]),
        seed=config["seed"],
        train=config["train"],
        test=config["test"],
        compile=config["compile"],
        freeze_backbone=config["freeze_backbone"],
        memory_check=config["memory_check"],
        memory_budget_gb=config.get("memory_budget_gb"),
        resample_patch=bool(config["model"].get("resample_patch")),
        progress_bar=config["progress_bar"],
        print_config=bool(config.get("print_config")),
        optimized_metric=optimized_metric(config),
        pruning=(trial.PruneTrial(config["optimized_metric"]),) if trial.sweep_pruner()[0] else (),
        config=config | {"data": data, "optim": optim, "trainer": trainer},  # as it runs: config.yaml's
        peft=peft,
    )
    return auto_batch.planned(plan)  # data.batch_size=auto: the batch that fits, the learning rate scaled from it


def _peft(config: Mapping[str, Any], weights: Any, ckpt: Any) -> dict | None:
    """peft='s plan: its settings and the base weights they adapt, named by sha256 (training.adapters.plan_peft)."""
    resumed = ckpt.hparams if ckpt else None
    return adapters.plan_peft(config.get("peft"), weights, resumed, bool(config["model"].get("resample_patch")))


def _resolved(composed: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The config `composed` (plain, interpolations kept) resolved once the plan has made its two changes that other
    values follow: the model group model.pretrained makes (training.pretrained.pretrained_model; the data's
    `${model.img_size}` and `${oc.select:model.patch_size}` follow) and the best checkpoint's metric following the
    objective (checkpoint_follows_objective; an early stop's monitor follows)."""
    planned = OmegaConf.create(checkpoint_follows_objective(composed))
    planned.model.update(model)
    return OmegaConf.to_container(planned, resolve=True)


def optimized_metric(config: Mapping[str, Any]) -> str | None:
    """`optimized_metric`; its default (val/acc_best) follows an objective that logs no accuracy, as the best
    checkpoint does: val/map_best of several labels an image (higher is better, as accuracy: in a sweep too), and in
    a single run val/loss_best (a sweep keeps val/acc_best there: its sweeper's direction, maximize, goes with it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    key, (watched, mode) = config.get("optimized_metric"), _best(config)
    if key != "val/acc_best" or watched == "acc":
        return key
    single = not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN
    return f"val/{watched}_best" if single or mode == "max" else key


def checkpoint_follows_objective(config: Mapping[str, Any]) -> dict[str, Any]:
    """The default choice of the best checkpoint (val/acc, highest) under an objective that logs no accuracy (MAE,
    DINO without its k-NN callback): that objective's own (val/loss, lowest), said in a line, in a copy of the plain
    `config` (an early stop's monitor, `${callbacks.model_checkpoint.monitor}`, follows it once resolved); a monitor
    set in a recipe or on the command line is kept."""
    node = (config.get("callbacks") or {}).get("model_checkpoint")
    watched, mode = _best(config)
    given = node.get("monitor") if node is not None else None
    if given not in ("val/acc", "val/acc_ema") or watched == "acc":  # (callbacks=ema's: the averaged weights')
        return dict(config)
    watched += given.removeprefix("val/acc")
    config = copy.deepcopy(dict(config))
    config["callbacks"]["model_checkpoint"] |= {"monitor": f"val/{watched}", "mode": mode}
    if rank_zero_only.rank == 0:
        log.info("objective=%s logs no %s: the best checkpoint is the one of the %s val/%s",
                 _objective_name(config), given, "lowest" if mode == "min" else "highest", watched)  # fmt: skip
    return config


def _best(config: Mapping[str, Any]) -> tuple[str, str]:
    """(metric, min|max) choosing the best checkpoint: the objective's, on data with or without labels."""
    options = config.get("objective") or {}
    return OBJECTIVES[_objective_name(config)].best_of(options, reads_no_labels(config.get("data")))


def _objective_name(config: Mapping[str, Any]) -> str:
    return (config.get("objective") or {}).get("name", "classify")
