"""The steps of vitlab/train.py's `train` that read its plan (plan.py's TrainPlan), each decision made in one place:
what the run says as it starts (`announce`), a stop by signal during fit (`stop_on_signal`), what fit leaves
(`fitted`), what to test (`what_to_test`) and what the test gave (`tested`); for a run stopped on a signal, what was
saved and the command that resumes it (`stopped`, `resume_command`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from vitlab.training.callbacks.standard import SaveOnInterrupt
from vitlab.training.run.loggers import finish_loggers
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import Interrupted, is_ctrl_c, stop_name
from vitlab.utils.logs import describe_run, save_config
from vitlab.utils.signals import pass_on

log = logging.getLogger("vitlab.train")  # the command's own lines


def announce(plan: TrainPlan, trainer: L.Trainer, module: Any) -> None:
    """The run's config as it runs in its directory (config.yaml: the plan's), what it trains and where and its memory
    estimate (the plan's) in the log, and its hyperparameters to each logger."""
    out = plan.output_dir
    if trainer.is_global_zero:
        save_config(plan.config, out / "config.yaml", show=plan.print_config)
        log.info("%s; run directory %s (config in config.yaml)", describe_run(module, plan.data, plan.trainer), out)
        for line in (plan.memory.line(), *plan.memory.notes):  # (and what the settings cost)
            log.info(line)
    for logger in trainer.loggers:
        logger.log_hyperparams(plan.config)


@contextlib.contextmanager
def stop_on_signal(trainer: L.Trainer, loggers: list) -> Iterator[None]:
    """Around fit: a stop by signal (SIGTERM, SIGINT, a scheduler's SIGUSR1) ends the loggers, says what was saved and
    how to resume, and exits 128 + the signal."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        yield
    except SIGTERMException:
        finish_loggers(loggers)  # (W&B's closing lines before the one that says how to resume)
        stopped(trainer)


def fitted(trainer: L.Trainer, plan: TrainPlan, metrics: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the metrics once training ended, the best checkpoint's path or "")."""
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    metrics = metrics | {k: v.item() for k, v in trainer.callback_metrics.items()}
    pruned = next((cb.pruned_at for cb in plan.pruning if cb.pruned_at), None)  # (every rank knows: trial.PruneTrial)
    return metrics | {"best_checkpoint": best or None} | ({"pruned": {"epoch": pruned}} if pruned else {}), best


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


def resume_command(ckpt_path: Path) -> str:
    """This run's command line (its own overrides, as typed) with ckpt_path set to `ckpt_path`. A job of a sweep
    resumes as a single run: its overrides are its own values, and hydra.mode=RUN keeps a config that asks for
    a sweep (hparams_search=...) from starting a new one."""
    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith(("ckpt_path=", "hydra.mode="))]
    single = ["hydra.mode=RUN"] if hydra_cfg.mode == RunMode.MULTIRUN else []
    return shlex.join([*launcher(), "-m", "vitlab.train", *overrides, *single, f"ckpt_path={ckpt_path}"])


def launcher() -> list[str]:
    """How this run's processes were started, for its resume line: torchrun's (as this node started them: on several
    nodes, node 0's line, each other node with its own --node-rank), else `python`."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return ["python"]
    nodes, per_node = int(env.get("GROUP_WORLD_SIZE") or 1), env.get("LOCAL_WORLD_SIZE") or "1"
    if nodes == 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={per_node}"]
    where = [f"--master-addr={env.get('MASTER_ADDR', '127.0.0.1')}", f"--master-port={env.get('MASTER_PORT', 29500)}"]
    return [
        "torchrun",
        f"--nnodes={nodes}",
        f"--node-rank={env.get('GROUP_RANK', 0)}",
        f"--nproc-per-node={per_node}",
        *where,
    ]


def stopped(trainer: L.Trainer) -> NoReturn:
    """Training stopped on a signal: say what was saved and the command that resumes it, pass the signal on to the
    handler that was there before (submitit's requeues a Slurm job) and exit with 128 + the signal's number."""
    saved = next((cb.saved for cb in trainer.callbacks if isinstance(cb, SaveOnInterrupt) and cb.saved), None)
    if saved is None:  # callbacks without save_on_interrupt: Lightning's own SIGTERM handling
        if trainer.is_global_zero:
            print("stopped by SIGTERM; no checkpoint saved (callbacks without save_on_interrupt)", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)
    if trainer.is_global_zero:
        name, path, command = signal.Signals(saved["signal"]).name, saved["path"], resume_command(saved["path"])
        said = {"signal": name, "step": saved["step"], "epoch": saved["epoch"] + 1, "checkpoint": str(path)}
        out = Path(HydraConfig.get().runtime.output_dir)  # beside the checkpoint, for a sweep's summary
        (out / "interrupted.json").write_text(json.dumps(said | {"resume": command}, indent=2))
        print(
            f"interrupted by {name} at step {saved['step']} (epoch {saved['epoch'] + 1}): saved {path}; resume with: "
            f"{command}",
            file=sys.stderr,
            flush=True,
        )
    pass_on(saved["signal"])
    raise SystemExit(128 + saved["signal"])
