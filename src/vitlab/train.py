"""python -m vitlab.train [overrides]: fit, then test the best checkpoint.

Saves the resolved config (config.yaml) in the run directory, logs a line per epoch when no progress
bar is shown, writes the final metrics to metrics.json, ends by naming the run directory and the best
checkpoint, and returns `optimized_metric` for sweepers (-m, Optuna).

torch and Lightning are imported when the task runs, not with this module: `--help` and config errors
answer without them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point, save_config
from vitlab.utils.errors import UserError
from vitlab.utils.logs import describe_run

log = logging.getLogger("vitlab.train")  # not __main__: the name the log lines show


def train(cfg: DictConfig) -> float | None:
    import lightning as L
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from vitlab.training import pretrained
    from vitlab.training import resume
    from vitlab.training import build
    from vitlab.convert.weights import load_timm_weights

    started = time.time()
    build.check_settings(cfg)
    build.check_launch(cfg)
    pretrained.apply_pretrained(cfg)  # model.pretrained=<timm name>: timm's architecture and preprocessing
    out = Path(cfg.paths.output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    fit = build.build_fit(cfg)
    trainer, module = fit.trainer, fit.module
    ckpt_path = resume.resolve_ckpt_path(cfg.ckpt_path, Path(cfg.paths.log_dir) / cfg.task_name / "runs")
    if ckpt_path:  # the user's: refused if it had finished (a job that restarts, below, goes on to test)
        resume.check_resumable(ckpt_path, module, cfg.trainer if cfg.train else None)
    elif ckpt_path := resume.earlier_start(out):
        resume.check_resumable(ckpt_path, module)
    elif cfg.model.pretrained:
        load_timm_weights(module.model, cfg.model.pretrained)

    if trainer.is_global_zero:
        save_config(cfg, out / "config.yaml", show=cfg.print_config)
        log.info("%s; run directory %s (config in config.yaml)", describe_run(cfg, module), out)
    for lg in fit.loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    with fit.finished():  # one W&B run per job, also in sweeps
        metrics = build.fit_and_test(cfg, trainer, module, fit.datamodule, ckpt_path)
    metrics["wall_time_s"] = round(time.time() - started, 2)
    metrics["run_dir"] = str(out)
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        report(metrics, trainer, out)

    if cfg.optimized_metric is None:
        return None
    if cfg.optimized_metric not in metrics:
        message = f"optimized_metric {cfg.optimized_metric!r} was not logged; logged: {sorted(metrics)}"
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a sweeper needs the value
            raise UserError(message)
        log.warning(message)  # e.g. training stopped by max_steps before the first validation
        return None
    return metrics[cfg.optimized_metric]


# The results a run's last line shows: a classifier's accuracies, or (objective=mae) its reconstruction losses.
KEYS = ((("val/acc_best", "val"), ("test/acc", "test")), (("val/loss_best", "val"), ("test/loss", "test")))


def report(metrics: dict[str, Any], trainer, out: Path) -> None:
    """The last lines of a run: its results and where they are."""
    splits = metrics.get("splits") or {}
    shown = ", ".join(
        f"{k} {metrics[k]:.4f}" + (f" on {splits[split]}" if split in splits else "")
        for k, split in KEYS["val/acc_best" not in metrics and "val/loss_best" in metrics]
        if k in metrics
    )
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    log.info("done in %.1f s%s", metrics["wall_time_s"], f": {shown}" if shown else "")
    print(f"run directory: {out}", flush=True)
    if best:
        print(f"best checkpoint: {best}", flush=True)


@entry_point("train")
def main(cfg: DictConfig) -> float | None:
    import torch

    torch.set_float32_matmul_precision("high")
    return train(cfg)


if __name__ == "__main__":
    main()
