"""What makes a function a `python -m vitlab.<command>` command line (`@entry_point`): the config tree and its
resolvers (vitlab.cli.config_tree), the command's config checked against its schema before any work
(`check_config`), the run directory (vitlab.cli.startup, vitlab.cli.rundir), one-line errors for bad input
(vitlab.utils.errors), the log routing (vitlab.utils.logs), a sweep job's failure recorded for the summary
(vitlab.cli.sweep), and the run's config saved in its directory.

It imports no torch, Lightning or timm at module level: `--help` and config errors answer at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import sys
import traceback
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from vitlab.cli.config_tree import config_dir, read_user_config_dir, register_resolvers
from vitlab.cli.schemas import SCHEMAS
from vitlab.utils.arguments import check_arguments
from vitlab.utils.errors import (
    CtrlC,
    Interrupted,
    TrainingFailed,
    UserError,
    config_errors,
    ctrl_c_as_ours,
    fail,
    finishing,
    is_ctrl_c,
    one_line,
    stop_name,
    user_error,
)
from vitlab.utils.logs import quiet

Check = Callable[[DictConfig], None]


def entry_point(
    config_name: str, check: Check | None = None
) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Turn `task(cfg)` into a Hydra command line: configs from config_dir(), resolvers, the config checked before
    any work (`check_config` with the command's schema and checks, vitlab.cli.schemas.SCHEMAS), a new run
    directory, and input errors reported as one line (the traceback only with HYDRA_FULL_ERROR=1). A plain run is
    checked before Hydra makes its run directory (startup.prepare), every job again as it starts. In a -m sweep a job
    with bad input is reported and recorded, a job that fails on a bug keeps its traceback and is recorded too, and
    the sweep goes on (SweepSummary lists every job at the end and makes the sweep exit 2, or 1 after a bug); a job
    whose directory holds another job's run stops the sweep in one line, writing nothing (sweep.refuse_other_job).
    `check`: the command's own further checks, where they need its package (cli/ imports no command)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        schema, schemas_check = SCHEMAS[config_name]

        def checked(cfg: DictConfig) -> None:
            check_config(cfg, schema, schemas_check)
            if check is not None:
                check(cfg)

        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> Any:
            return _run_task(config_name, cfg, checked, task)

        def main() -> Any:
            return _run_command(config_name, checked, guarded)

        return main

    return decorate


def _run_task(config_name: str, cfg: DictConfig, checked: Check, task: Callable[[DictConfig], Any]) -> Any:
    """The task of a run or a sweep's job, its config checked first; bad input, a bug or a stop reported as
    entry_point says."""
    from vitlab.cli.ranks import task_started
    from vitlab.cli.sweep import earlier_result, optimized_value

    global _began
    quiet()
    task_started()
    _began = True
    try:
        if (job := _sweep_job_dir()) and (before := earlier_result(job)) is not None:  # the sweep run again into
            return optimized_value(cfg.get("optimized_metric"), before)  # its directory: this job had ended (at once)
        checked(cfg)
        if "trainer" in cfg:  # (a command that may start processes through Lightning)
            from vitlab.utils.signals import when_children_stop

            when_children_stop(lambda signum: _stop_line(cfg, config_name, CtrlC(signum).name)[0])
        return task(cfg)
    except SystemExit as e:  # stopped on a signal: the sweep ends here, its summary lists the jobs so far
        if e.code == 1 and is_ctrl_c(e):  # Lightning's answer to Ctrl-C or SIGTERM outside fit's steps
            _interrupted(cfg, config_name, e)
        _summarize_sweep(cfg)
        raise
    except (KeyboardInterrupt, Exception) as e:
        from vitlab.cli.sweep import OtherJobsRun

        if is_ctrl_c(e):  # Ctrl-C or SIGTERM outside training's own handling (utils/signals.py)
            _interrupted(cfg, config_name, e)
        if isinstance(e, OtherJobsRun):  # nothing of this sweep goes there: no error.json, no summary
            fail(one_line(e))
        cause = user_error(e) if isinstance(e, (*config_errors(), InstantiationException)) else None
        job = _sweep_job_dir()
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or (cause is None and job is None):
            raise  # a bug (or the traceback asked for)
        if cause is None:
            return _record_bug(job, e)
        if job is None or isinstance(cause, Interrupted):
            _stop(cfg, cause)
        return _record_failed_job(job, one_line(cause))


_began = False  # whether a task (a run, a sweep's job) has begun in this process


def _stopped_in_hydra(config_name: str, e: KeyboardInterrupt) -> None:
    """Ctrl-C or SIGTERM while Hydra composes the config or makes the run directory, before the task began: exit
    128 + the signal. The first process of a launch says so in one line, having removed the run directory it claimed
    (which holds nothing yet), so that the same command runs again; any other (Lightning's second process, composing
    its own config as the group's signal reaches it) ends without a word: the first one reports the stop
    (utils.signals.when_children_stop, or its own handling)."""
    from vitlab.cli import ranks, rundir

    name, signum = stop_name(e)
    if ranks.process_rank() > 0:
        raise SystemExit(128 + signum)
    if rundir.CLAIMED:
        rundir.discard_if_unused(None, rundir.CLAIMED[-1])
    fail(f"{config_name} stopped by {name} before it started: nothing was written", 128 + signum)


def _run_command(config_name: str, checked: Check, guarded: Callable[[DictConfig], Any]) -> Any:
    """The command line: checked before Hydra starts (startup.prepare), then Hydra's main with `guarded` as its
    task; Ctrl-C and SIGTERM raise CtrlC throughout, and are quiet once the work is done."""
    from vitlab.cli.startup import prepare

    quiet()
    register_resolvers()
    try:
        conf = config_dir()  # vitlab's tree, and the user's --config-dir searched before it
        read_user_config_dir(sys.argv[1:])
    except UserError as e:
        fail(one_line(e))
    try:
        with ctrl_c_as_ours():  # (so that a Ctrl-C caught here exits 128 + 2, whatever line it interrupted)
            try:
                sys.argv[1:] = prepare(config_name, sys.argv[1:], checked)
            except KeyboardInterrupt as e:
                name, signum = stop_name(e)
                fail(f"{config_name} stopped by {name} before it started: nothing was written", 128 + signum)
            hydra_main = hydra.main(version_base="1.3", config_path=str(conf), config_name=config_name)
            try:
                returned = hydra_main(guarded)()
            except KeyboardInterrupt as e:
                if _began:
                    raise
                _stopped_in_hydra(config_name, e)
        _stopped_after_sweep()
        return returned
    finally:
        finishing()  # a Ctrl-C while Python exits: no traceback from its exit handlers


def check_config(cfg: DictConfig, schema: Any = None, check: Check | None = None) -> None:
    """A command's config before any work: its top-level keys against `schema` (a TypedDict: types and ranges, its
    groups key by key: utils.arguments.check_arguments), the command's own `check` (what needs several keys or the file
    system), then every node that builds something against its target (cli.node_checks.check_nodes: the data
    module, the Trainer within Lightning's ranges, callbacks, loggers)."""
    if schema is not None:
        values = {k: _plain(cfg[k]) for k in typing.get_type_hints(schema) if k in cfg}
        check_arguments(schema, values, "")
    _check_data_dir(cfg)
    _check_logger_packages(cfg)
    if check is not None:  # (the checks that need no Lightning first: their refusals come within a second)
        check(cfg)
    if "_target_:" in OmegaConf.to_yaml(cfg):
        from vitlab.cli.node_checks import check_nodes  # (Lightning: only for a config that builds something)

        with _set_by_the_experiment():
            check_nodes(cfg)


def _check_data_dir(cfg: DictConfig) -> None:
    """A data.data_dir that is not there (and is not to be downloaded into), said before the data module's package
    (torch, Lightning) is imported to count its classes or read it."""
    from vitlab.utils.errors import MissingFileError

    data = cfg.get("data")
    if not OmegaConf.is_dict(data) or data.get("download") is True:
        return
    data_dir = OmegaConf.select(data, "data_dir", default=None, throw_on_resolution_failure=False)
    remote = "://" in str(data_dir)  # an object store's or a server's (s3://, gs://, https://): its reader says
    if data_dir is not None and not remote and not Path(str(data_dir)).expanduser().exists():
        raise MissingFileError(f"data.data_dir {str(data_dir)!r} does not exist")


# Lightning's loggers and the package each imports as it is built (one of them): without it, Lightning's
# ModuleNotFoundError came from Hydra's instantiate after the run directory was made.
LOGGER_PACKAGES = {"MLFlowLogger": ("mlflow",), "WandbLogger": ("wandb",), "CometLogger": ("comet_ml",),
                   "NeptuneLogger": ("neptune",), "TensorBoardLogger": ("tensorboard", "tensorboardX")}  # fmt: skip


def _check_logger_packages(cfg: DictConfig) -> None:
    """A logger (logger=mlflow from a user's --config-dir) whose package is not installed, said in one line before
    Lightning is imported and before the run directory is made."""
    import importlib.util

    loggers = cfg.get("logger")
    for name, node in loggers.items() if OmegaConf.is_dict(loggers) else ():
        target = str(node.get("_target_", "")) if OmegaConf.is_dict(node) else ""
        packages = LOGGER_PACKAGES.get(target.rpartition(".")[2]) if ".loggers" in target else None
        if packages and not any(importlib.util.find_spec(p) for p in packages):
            raise UserError(
                f"logger.{name}: {target} needs the {packages[0]} package, which is not installed here: pip install "
                f"{packages[0]} (or choose a logger without it: logger=csv)"
            )


@contextlib.contextmanager
def _set_by_the_experiment() -> Iterator[None]:
    """A key the chosen experiment sets for its own data (or trainer, ...) that the group chosen on the command line
    lacks (experiment=dino_pretrain_digits's data.shift under data=imagefolder): said as such, not as a typo."""
    try:
        yield
    except UserError as e:
        from hydra.core.hydra_config import HydraConfig

        choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
        bad = re.match(r"(\w+)\.(\w+) is not an argument of", str(e))
        if not (experiment := choices.get("experiment")) or bad is None:
            raise
        key = bad[1]
        node = OmegaConf.load(config_dir() / "experiment" / f"{experiment}.yaml").get(key) or {}
        if bad[2] not in node:
            raise
        raise UserError(
            f"{key}.{bad[2]} is set by experiment={experiment}, a recipe for its own {key}, and {key}="
            f"{choices.get(key)} has no such key: use a recipe made for it (docs/training/configs.md lists them); DINO "
            "on your photos: objective=dino data=imagefolder data.data_dir=<photos> data.unlabeled=true model=vit_s16 "
            "model.num_classes=0 model.dynamic_img_size=true (docs/training/objectives.md)"
            if key == "data"
            else f"{e}; it is set by experiment={experiment}"
        ) from None


def _plain(value: Any) -> Any:
    """A config value as plain data for its schema; a node that builds something (eval's data=<name>) only as such:
    check_nodes holds it to its target, and the command may fill in what it refers to (data.img_size)."""
    if OmegaConf.is_dict(value) and "_target_" in value:
        return {"_target_": value._target_}
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _sweep_job_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def _summarize_sweep(cfg: DictConfig) -> None:
    """In a -m sweep that a signal ends in one of its jobs, the configured SweepSummary callbacks' summary.json and
    table (Hydra calls them only for a job that returned or raised an Exception, not for one that exits)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class

    from vitlab.cli.sweep import SweepSummary

    if _sweep_job_dir() is None:
        return
    hydra_cfg = HydraConfig.get()
    for node in (hydra_cfg.get("callbacks") or {}).values():
        if issubclass(get_class(node._target_), SweepSummary):
            hydra.utils.instantiate(node).show(hydra_cfg, cfg.get("optimized_metric"))
    if os.environ.get("SUBMITIT_EXECUTOR"):  # a Slurm job: its sweep's command is not this process's
        return
    # The whole sweep goes on with its own command and directory: ended jobs are kept, the stopped one resumes.
    typed = [a for a in sys.argv[1:] if not a.startswith("hydra.sweep.dir=")]
    again = ["python", "-m", f"vitlab.{hydra_cfg.job.name}", *typed, f"hydra.sweep.dir={hydra_cfg.sweep.dir}"]
    print(f"continue this sweep with: {shlex.join(again)}", flush=True)


def _record_failed_job(job: Path, message: str, bug: bool = False) -> float:
    """A sweep job's bad input: said on stderr, kept in the job's error.json for the summary; NaN goes to
    the sweeper (Optuna records a failed trial) so the other jobs still run."""
    print(f"error: sweep job {job.name}: {message}", file=sys.stderr, flush=True)
    (job / "error.json").write_text(json.dumps({"error": message} | ({"bug": True} if bug else {})))
    return float("nan")


def _record_bug(job: Path, e: BaseException) -> float:
    """A sweep job that failed on a bug (not the user's input): its traceback on stderr, as a single run shows it,
    and recorded as failed, so that the other jobs still run and the sweep ends with its table (exit 1)."""
    traceback.print_exception(e, file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0]
    return _record_failed_job(job, f"{type(e).__name__}: {first}".rstrip(": "), bug=True)


def _stop(cfg: DictConfig, cause: BaseException) -> None:
    """The command ends on the user's input: in a sweep, the summary of the jobs so far; a run directory that holds
    no result yet removed (not where training itself failed: its log says why); the one line, with the exit code of
    its kind (2)."""
    from vitlab.cli.rundir import discard_if_unused

    _summarize_sweep(cfg)
    if _sweep_job_dir() is None and not isinstance(cause, TrainingFailed):
        discard_if_unused(OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False))
    fail(one_line(cause), getattr(cause, "exit_code", 2))


def _interrupted(cfg: DictConfig, command: str, e: BaseException) -> None:
    """A stop by Ctrl-C or SIGTERM outside training's own handling (start-up, a test after fit, an evaluation): one
    line (`_stop_line`), exit 128 + the signal."""
    name, signum = stop_name(e)
    line, said = _stop_line(cfg, command, name)
    if said:
        fail(line, 128 + signum)
    raise SystemExit(128 + signum)


def _stop_line(cfg: DictConfig, command: str, name: str) -> tuple[str, bool]:
    """(the line that says what a stop kept and what to run next, whether this process says it: rank 0): in a sweep,
    the summary so far; a run directory that holds no result yet removed, so that the same command runs again."""
    from hydra.core.hydra_config import HydraConfig

    from vitlab.cli.ranks import process_rank
    from vitlab.cli.rundir import discard_if_unused

    _summarize_sweep(cfg)
    job, says = _sweep_job_dir(), process_rank() == 0
    log_dir = OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False)
    if job is not None:
        return f"{command} stopped by {name}: sweep job {job.name} did not end", says
    if discard_if_unused(log_dir):
        began = " before training began" if command == "train" else ""
        return (
            f"{command} stopped by {name}{began}: nothing was saved (its run directory held only what a start "
            "writes, and is removed); run the same command again"
        ), says
    out = Path(HydraConfig.get().runtime.output_dir)
    last = out / "checkpoints" / "last.ckpt"
    if command == "train" and last.is_file():
        from vitlab.training.run.steps import resume_command

        return f"{command} stopped by {name}: {out} keeps what it wrote; go on with: {resume_command(last)}", says
    return f"{command} stopped by {name}: {out} keeps what it wrote", says


def _stopped_after_sweep() -> None:
    """A -m sweep whose last part (the study's plots, the grid's plot) Ctrl-C or SIGTERM stopped: after the table,
    one line saying what is kept, exit 128 + the signal."""
    from vitlab.cli import sweep_plots

    if sweep_plots.stopped is not None:
        stop, sweep_dir = sweep_plots.stopped
        name, signum = stop_name(stop)
        fail(f"stopped by {name} while drawing the sweep's plots: every job's result is kept in {sweep_dir} (the "
             "table above: summary.json); the plots were not drawn", 128 + signum)  # fmt: skip
