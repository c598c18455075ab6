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
from vitlab.cli.sweep import earlier_result, optimized_value
from vitlab.utils.logs import describe_run, summarize

log = logging.getLogger("vitlab.train")  # not __main__: the name the log lines show


def train(cfg: DictConfig) -> float | None:
    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from vitlab.training import auto_batch, build, memory, pretrained, resume, sharding, trial

    started, out = time.time(), Path(cfg.paths.output_dir)
    if (before := earlier_result(out)) is not None:  # a sweep run again into its directory: this job had ended
        return optimized_value(cfg.optimized_metric, before)
    if said := sharding.check_request(cfg.trainer, cfg.get("callbacks")):  # trainer=fsdp on one process
        log.info(said)
    pretrained.apply_pretrained(cfg)  # model.pretrained=<timm name>: timm's architecture and preprocessing
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    pruning = [trial.PruneTrial(cfg.optimized_metric)] if trial.sweep_pruner()[0] else []  # an Optuna trial
    callbacks, show_bar = build.build_callbacks(cfg, extra=pruning)
    trainer = build.build_trainer(cfg.trainer, callbacks=callbacks, logger=False, enable_progress_bar=show_bar)
    auto = auto_batch.provisional(cfg, trainer)  # data.batch_size=auto: chosen from the memory estimate
    datamodule = build.build_datamodule(cfg.data, cfg)
    chosen = auto_batch.choose(cfg, trainer, datamodule) if auto else None  # (before the LR is scaled by it)
    module = build.build_module(cfg, datamodule)
    estimate = memory.for_run(module, trainer, cfg.optim.name, cfg.data.batch_size, datamodule.size_schedule)
    if cfg.memory_check:  # (before a checkpoint or pretrained weights are read)
        memory.check_fits(estimate, trainer, module.model.cfg.grad_checkpointing)
    ckpt_path = resume.starting_point(cfg, module)  # a checkpoint to go on from, or pretrained weights loaded
    # Each logger checked first (W&B: a login); W&B goes on with the run the checkpoint names.
    trainer.loggers = loggers = build.build_loggers(cfg.get("logger"), resume_from=ckpt_path)
    _announce(cfg, trainer, module, estimate, out)

    metrics, best = ({"batch_size_auto": chosen} if chosen else {}), ""
    with build.loggers_finished(loggers):  # one W&B run per job, also in sweeps
        if cfg.train:
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
            except SIGTERMException:
                build.finish_loggers(loggers)  # (W&B's closing lines before the one that says how to resume)
                resume.stopped(trainer)  # says what was saved and how to resume; exits 128 + the signal
            metrics.update({k: v.item() for k, v in trainer.callback_metrics.items()})
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            metrics |= {"best_checkpoint": best or None} | trial.pruned(pruning)  # (stopped by the study's pruner)
        datamodule.setup("test")  # (done already when it trained)
        metrics["splits"] = dict(getattr(datamodule, "splits", {}))
        if cfg.test and getattr(datamodule, "test_set", True) is None:
            log.info("not tested: the data has no test split (its val/ chose the checkpoint); the result is %s_best",
                     module.best_key)  # fmt: skip
        elif cfg.test and "pruned" in metrics:
            log.info("not tested: the study's pruner stopped this trial at epoch %d", metrics["pruned"]["epoch"])
        elif cfg.test:
            tested = best or (None if cfg.train else ckpt_path)
            if cfg.train and not best:
                log.warning("no best checkpoint was saved; testing the final weights")
            trainer.test(module, datamodule=datamodule, ckpt_path=tested, weights_only=True if tested else None)
            metrics |= {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
            metrics["tested_checkpoint"] = tested or "final weights"

    metrics |= {"wall_time_s": round(time.time() - started, 2), "run_dir": str(out)}
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        summarize(metrics, best, out)
    return optimized_value(cfg.optimized_metric, metrics, warn=trainer.is_global_zero)


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

    torch.set_float32_matmul_precision("high")
    return train(cfg)


if __name__ == "__main__":
    main()
