"""python -m vitlab.train [overrides]: fit, then test the best checkpoint.

The steps, top to bottom: the config is composed, checked (vitlab.cli.schemas: its keys, every node that builds
something, the launch) and the run directory claimed (`@entry_point`, before `train` runs); the config becomes the
run's plan, every decision in it taken once (vitlab.cli.plans: the batch, the learning rate, the memory estimate, the
weights to start from, the checkpoint to go on from); the loggers, callbacks, Trainer, data and module (our ViT and its
objective, from the plan's weights) are built from their parts of the plan; fit, from scratch or from the checkpoint;
test the best checkpoint; the summary: metrics.json, the last lines
naming the run directory and the best checkpoint, and `optimized_metric` returned to sweepers (-m, Optuna).

torch and Lightning are imported when the task runs, not with this module: `--help` and config errors
answer without them.
"""

from __future__ import annotations

import json
import logging
import time

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point
from vitlab.cli.sweep import optimized_value
from vitlab.utils.errors import UserError
from vitlab.utils.logs import summarize

log = logging.getLogger("vitlab.train")  # not __main__: the name the log lines show


def train(cfg: DictConfig) -> float | None:
    """Plan, build, fit, test, summarise; `optimized_metric`'s value for a sweeper. The config is read once, into the
    plan (vitlab.cli.plans); each builder takes its part of it. (A sweep's job that ended in an earlier run of the
    sweep is skipped before this: vitlab.cli.entry.)"""
    from lightning import seed_everything

    from vitlab.cli import plans
    from vitlab.training.run import build, loggers, resume, steps

    started = time.time()
    plan = plans.train_plan(cfg)  # weights, trainer, batch, learning rate, memory, the checkpoint to go on from
    if plan.memory_refusal:  # (memory_check: the run would not fit; refused before anything is built)
        raise UserError(plan.memory_refusal)
    seed_everything(plan.seed, workers=True, verbose=False)
    run_loggers = loggers.build_loggers(plan.loggers, resumed=plan.resume)  # (a resumed run's W&B run goes on)
    callbacks, show_bar = build.build_callbacks(plan.callbacks, plan.progress_bar, extra=plan.pruning)
    trainer = build.build_trainer(
        plan.trainer, plan.trainer_args, callbacks=callbacks, logger=run_loggers or False, enable_progress_bar=show_bar
    )
    datamodule = build.fit_datamodule(plan)
    module = build.build_module(plan, datamodule)  # from the plan's weights, if any
    start = resume.starting_point(plan, module)  # the checkpoint to go on from (None: a new run)
    steps.announce(plan, trainer, module)
    metrics, best, out = plan.first_metrics(), "", plan.output_dir
    with loggers.loggers_finished(run_loggers):  # one W&B run per job, also in sweeps
        if plan.train:
            with steps.stop_on_signal(trainer, run_loggers):
                trainer.fit(module, datamodule=datamodule, ckpt_path=start, weights_only=True)
            metrics, best = steps.fitted(trainer, plan, metrics)
        if (weights := steps.what_to_test(plan, start, datamodule, module, metrics, best)) is not None:
            with steps.stop_while_testing(trainer, metrics, weights, out):
                trainer.test(module, datamodule=datamodule, ckpt_path=weights or None, weights_only=True)
        metrics |= steps.tested(trainer, datamodule, weights)
    metrics |= {"wall_time_s": round(time.time() - started, 2), "run_dir": str(out)}
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        summarize(metrics, best, out)
    return optimized_value(plan.optimized_metric, metrics, warn=trainer.is_global_zero)


@entry_point("train")
def main(cfg: DictConfig) -> float | None:
    import torch

    from vitlab.training.devices.hardware import use_sdpa_backend

    torch.set_float32_matmul_precision("high")
    use_sdpa_backend(cfg.sdpa_backend)
    return train(cfg)


if __name__ == "__main__":
    main()
