"""The steps of vitlab/train.py's `train` that read its plan (plan.py's TrainPlan), each decision made in one place: the
memory check (`check_memory`), a stop by signal during fit (`stop_on_signal`), what fit leaves (`fitted`), and what to
test (`what_to_test`) and what the test gave (`tested`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L

from vitlab.training.callbacks import trial
from vitlab.training.devices import memory
from vitlab.training.run import resume
from vitlab.training.run.loggers import finish_loggers
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import Interrupted, is_ctrl_c, stop_name

log = logging.getLogger("vitlab.train")  # the command's own lines


def check_memory(plan: TrainPlan, trainer: L.Trainer, module: Any, datamodule: Any) -> memory.Estimate:
    """The run's memory estimate per process; with memory_check, a run that would not fit is refused in one line
    (before the checkpoint's state or pretrained weights are loaded)."""
    estimate = memory.for_run(module, trainer, plan.optim["name"], plan.data["batch_size"], datamodule.size_schedule)
    if plan.memory_check:
        memory.check_fits(estimate, trainer, module.model.cfg.grad_checkpointing)
    return estimate


@contextlib.contextmanager
def stop_on_signal(trainer: L.Trainer, loggers: list) -> Iterator[None]:
    """Around fit: a stop by signal (SIGTERM, SIGINT, a scheduler's SIGUSR1) ends the loggers, says what was saved and
    how to resume, and exits 128 + the signal."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        yield
    except SIGTERMException:
        finish_loggers(loggers)  # (W&B's closing lines before the one that says how to resume)
        resume.stopped(trainer)


def fitted(trainer: L.Trainer, plan: TrainPlan, metrics: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the metrics once training ended, the best checkpoint's path or "")."""
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    metrics = metrics | {k: v.item() for k, v in trainer.callback_metrics.items()}
    return metrics | {"best_checkpoint": best or None} | trial.pruned(list(plan.pruning)), best


def what_to_test(
    plan: TrainPlan, start: str | None, datamodule: Any, module: Any, metrics: dict, best: str
) -> str | None:
    """The weights the test split scores, the one place that decides: the best checkpoint; the final weights ("")
    when none was saved; with train=false the checkpoint given (or the weights built). None when nothing is tested,
    and why, in the log: test=false, data without a test split, a trial its study's pruner stopped."""
    datamodule.setup("test")  # (done already when it trained): its splits are known
    if not plan.test:
        return None
    if getattr(datamodule, "test_set", True) is None:
        log.info("not tested: the data has no test split (its val/ chose the checkpoint); the result is %s_best",
                 module.best_key)  # fmt: skip
        return None
    if "pruned" in metrics:
        log.info("not tested: the study's pruner stopped this trial at epoch %d", metrics["pruned"]["epoch"])
        return None
    if plan.train and not best:
        log.warning("no best checkpoint was saved; testing the final weights")
    return best if plan.train else (start or "")


@contextlib.contextmanager
def stop_while_testing(trainer: L.Trainer, metrics: dict[str, Any], weights: str, out: Path) -> Iterator[None]:
    """Around the test after fit: Ctrl-C or SIGTERM there (Lightning answers it with exit 1) keeps the fit's metrics
    in metrics.json and ends in one line naming the vitlab.eval command that tests `weights`, exit 128 + the signal."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as e:
        if not is_ctrl_c(e) or (isinstance(e, SystemExit) and e.code != 1):
            raise
        name, signum = stop_name(e)
        if trainer.is_global_zero:
            (out / "metrics.json").write_text(json.dumps(metrics | {"run_dir": str(out)}, indent=2))
        what = shlex.join(["python", "-m", "vitlab.eval", f"ckpt_path={weights}"]) if weights else None
        then = f"; test it with: {what}" if what else " (the final weights were not saved: nothing to test later)"
        raise Interrupted(
            f"train stopped by {name} while testing {weights or 'the final weights'}: the fit's metrics are in "
            f"{out / 'metrics.json'}{then}",
            signum,
        ) from None


def tested(trainer: L.Trainer, datamodule: Any, weights: str | None) -> dict[str, Any]:
    """The data's splits, and the test split's metrics of `weights` (what_to_test's) where they were tested."""
    out: dict[str, Any] = {"splits": dict(getattr(datamodule, "splits", {}))}
    if counts := getattr(datamodule, "class_counts", None):  # the training list's images of each class (data=list)
        out["class_counts"] = dict(counts)
    for split, limit, counted in (("val", trainer.limit_val_batches, trainer.num_val_batches),
                                  ("test", trainer.limit_test_batches, trainer.num_test_batches)):  # fmt: skip
        if split in out["splits"] and (isinstance(limit, int) or limit < 1.0):  # debug=fdr, limit_*_batches
            n = int(sum(counted or [limit if isinstance(limit, int) else 0]))
            out["splits"][split] = f"{n} batch{'es' if n != 1 else ''} of {out['splits'][split]}"
    if weights is None:
        return out
    out |= {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    out |= {k: v for k, v in getattr(trainer.lightning_module, "class_values", {}).items() if k.startswith("test/")}
    return out | {"tested_checkpoint": weights or "final weights"}
