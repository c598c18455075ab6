"""What makes a function a `python -m vitlab.<command>` command line (`@entry_point`): the config tree and its
resolvers (vitlab.cli.config_tree), the run directory (vitlab.cli.rundir), one-line errors for bad input
(vitlab.utils.errors), the log routing (vitlab.utils.logs), a sweep job's failure recorded for the summary
(vitlab.cli.sweep), and the run's config saved in its directory.

It imports no torch, Lightning or timm at module level: `--help` and config errors answer at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from vitlab.cli.config_tree import config_dir, register_resolvers
from vitlab.utils.errors import config_errors, fail, one_line, user_error
from vitlab.utils.logs import quiet


def entry_point(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Turn `task(cfg)` into a Hydra command line: configs from config_dir(), resolvers, a new run
    directory, and input errors reported as one line (the traceback only with HYDRA_FULL_ERROR=1).
    In a -m sweep a job with bad input is reported and recorded, and the sweep goes on (SweepSummary
    lists it and makes the sweep exit 2)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> Any:
            from vitlab.cli.rundir import discard_if_unused, task_started

            quiet()
            task_started()
            try:
                return task(cfg)
            except SystemExit:  # stopped on a signal: the sweep ends here, its summary lists the jobs so far
                _summarize_sweep(cfg)
                raise
            except (*config_errors(), InstantiationException) as e:
                cause = user_error(e)
                if os.environ.get("HYDRA_FULL_ERROR") == "1" or cause is None:
                    raise
                job = _sweep_job_dir()
                if job is None:
                    discard_if_unused(OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False))
                    fail(one_line(cause))
                return _record_failed_job(job, one_line(cause))

        def main() -> Any:
            from vitlab.cli.rundir import prepare

            quiet()
            register_resolvers()
            sys.argv[1:] = prepare(config_name, sys.argv[1:])
            return hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)(guarded)()

        return main

    return decorate


def _sweep_job_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def _summarize_sweep(cfg: DictConfig) -> None:
    """In a -m sweep, what the configured SweepSummary callbacks write as each job ends (Hydra calls them only
    for a job that returned or raised an Exception, not for one that exits)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class

    from vitlab.cli.sweep import SweepSummary

    if _sweep_job_dir() is None:
        return
    hydra_cfg = HydraConfig.get()
    for node in (hydra_cfg.get("callbacks") or {}).values():
        if issubclass(get_class(node._target_), SweepSummary):
            hydra.utils.instantiate(node).write(hydra_cfg, cfg.get("optimized_metric"))


def _record_failed_job(job: Path, message: str) -> float:
    """A sweep job's bad input: said on stderr, kept in the job's error.json for the summary; NaN goes to
    the sweeper (Optuna records a failed trial) so the other jobs still run."""
    print(f"error: sweep job {job.name}: {message}", file=sys.stderr, flush=True)
    (job / "error.json").write_text(json.dumps({"error": message}))
    return float("nan")


def save_config(cfg: DictConfig, path: Path, show: bool = False) -> None:
    """The resolved config as YAML in the run directory; with `show`, also as a tree on the terminal
    (the full tree is ~170 lines: the log says where the file is instead)."""
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if not show:
        return
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key), style="bold")
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)
