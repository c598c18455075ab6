"""python -m vitlab.train [overrides]: fit, then test the best checkpoint.

The steps, top to bottom: the config is composed, checked (vitlab.cli.schemas: its keys, every node that builds
something, the launch) and the run directory claimed (`@entry_point`, before `train` runs); the data, the module
(our ViT and its objective), the callbacks, loggers and Trainer are built; training starts from scratch, from
pretrained weights or from a checkpoint; fit; test the best checkpoint; the summary: metrics.json, the last lines
naming the run directory and the best checkpoint, and `optimized_metric` returned to sweepers (-m, Optuna).

torch and Lightning are imported when the task runs, not with this module: `--help` and config errors
answer without them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point, save_config
from vitlab.cli.sweep import optimized_value
from vitlab.utils.logs import describe_run, summarize

log = logging.getLogger("vitlab.train")  # not __main__: the name the log lines show


def train(cfg: DictConfig) -> float | None:
    """Plan, build, fit, test, summarise (each decision in training.run.plan); `optimized_metric`'s value for a sweeper.
    (A sweep's job that ended in an earlier run of the sweep is skipped before this: vitlab.cli.entry.)"""
    from vitlab.training.run import auto_batch, build, resume
    from vitlab.training.run import plan as steps

    started, out = time.time(), Path(cfg.paths.output_dir)
    plan = steps.plan(cfg)  # what the config settles: pretrained architecture, seed, a trial's pruning
    callbacks, show_bar = build.build_callbacks(cfg, extra=plan.pruning)
    trainer = build.build_trainer(cfg.trainer, callbacks=callbacks, logger=False, enable_progress_bar=show_bar)
    auto = auto_batch.provisional(cfg, trainer)  # data.batch_size=auto: chosen from the memory estimate
    datamodule = build.build_datamodule(cfg.data, cfg)
    plan.batch_size_auto = auto_batch.choose(cfg, trainer, datamodule) if auto else None  # (before the LR uses it)
    module = build.build_module(cfg, datamodule)
    plan.estimate = steps.check_memory(cfg, trainer, module, datamodule)
    plan.start = resume.starting_point(cfg, module, plan.weights)  # a checkpoint to go on from, or the weights loaded
    trainer.loggers = loggers = build.build_loggers(cfg.get("logger"), resume_from=plan.start)
    _announce(cfg, trainer, module, plan.estimate, out)
    metrics, best = plan.first_metrics(), ""
    with build.loggers_finished(loggers):  # one W&B run per job, also in sweeps
        if cfg.train:
            with steps.stop_on_signal(trainer, loggers):
                trainer.fit(module, datamodule=datamodule, ckpt_path=plan.start, weights_only=True)
            metrics, best = steps.fitted(trainer, plan, metrics)
        if (weights := steps.what_to_test(cfg, plan, datamodule, module, metrics, best)) is not None:
            with steps.stop_while_testing(trainer, metrics, weights, out):
                trainer.test(module, datamodule=datamodule, ckpt_path=weights or None, weights_only=True)
        metrics |= steps.tested(trainer, datamodule, weights)
    metrics |= {"wall_time_s": round(time.time() - started, 2), "run_dir": str(out)}
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        summarize(metrics, best, out)
    return optimized_value(build.optimized_metric(cfg), metrics, warn=trainer.is_global_zero)


def _announce(cfg: DictConfig, trainer, module, estimate, out: Path) -> None:
    """The run's config in its directory, what it trains and where (and its memory estimate) in the log, and its
    hyperparameters to each logger."""
    if trainer.is_global_zero:
        save_config(cfg, out / "config.yaml", show=cfg.print_config)
        log.info("%s; run directory %s (config in config.yaml)", describe_run(cfg, module), out)
        for line in (estimate.line(), *estimate.notes):  # (and what the settings cost)
            log.info(line)
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))


@entry_point("train")
def main(cfg: DictConfig) -> float | None:
    import torch

    from vitlab.training.devices.hardware import use_sdpa_backend

    torch.set_float32_matmul_precision("high")
    use_sdpa_backend(cfg.sdpa_backend)
    return train(cfg)


if __name__ == "__main__":
    main()
