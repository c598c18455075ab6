"""A job of an Optuna search as a trial of its study: the metric it optimises reported at every validation, and
the run stopped where the study's pruner says so (`hydra.sweeper.pruner=median|hyperband|successive_halving`).

The sweeper (vitlab.cli.optuna_sweep) runs trial N in the sweep's job directory N and keeps the study where every
job reaches it (`hydra.sweeper.storage`, by default the sweep directory's optuna.db); the job finds its trial there
by number. Rank 0 talks to the study; its decision is broadcast, so that every process of a DDP or FSDP job stops
at the same validation.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from vitlab.training.callbacks.pruners import make_pruner

log = logging.getLogger(__name__)


def sweep_pruner() -> tuple[str | None, dict[str, Any]]:
    """The pruner this job's sweep asks for, as (name, arguments); (None, {}) outside an Optuna search with one."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None, {}
    sweeper = HydraConfig.get().sweeper
    if "pruner" not in sweeper or sweeper.pruner is None:
        return None, {}
    return str(sweeper.pruner), dict(sweeper.get("pruner_args") or {})


def this_trial():
    """This job's trial in its study (rank 0 only): Optuna's Trial numbered as the job, and the steps it reported
    before (a trial resumed after an interruption)."""
    import optuna

    hydra_cfg = HydraConfig.get()
    sweeper = hydra_cfg.sweeper
    name, args = sweep_pruner()
    study = optuna.load_study(study_name=sweeper.study_name, storage=sweeper.storage, pruner=make_pruner(name, args))
    number = int(hydra_cfg.job.num)
    found = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    if not found:
        raise RuntimeError(f"study {sweeper.study_name!r} in {sweeper.storage} has no trial {number} for this job")
    return optuna.trial.Trial(study, found[0]._trial_id), set(found[0].intermediate_values)


class PruneTrial(L.Callback):
    """Report `metric` to this job's trial after every validation (step: the epoch) and stop training once the
    study's pruner prunes it; `pruned_at` is then the epoch (1-based) the trial reached."""

    def __init__(self, metric: str):
        self.metric = metric
        self.trial, self.reported = None, set()
        self.pruned_at: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.trial, self.reported = this_trial()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero and self.metric in trainer.callback_metrics:
            value = float(trainer.callback_metrics[self.metric])
            if trainer.current_epoch not in self.reported:  # (resumed mid-epoch: this epoch's, once)
                self.trial.report(value, step=trainer.current_epoch)
            prune = self.trial.should_prune()
        if trainer.world_size > 1:
            prune = trainer.strategy.broadcast(prune, src=0)
        if prune:
            self.pruned_at = trainer.current_epoch + 1
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.info(
                    "trial %d pruned at epoch %d (%s %.4g): the study's pruner stops it here",
                    self.trial.number, self.pruned_at, self.metric, value,
                )  # fmt: skip
