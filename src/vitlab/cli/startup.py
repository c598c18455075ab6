"""Before Hydra starts: the command line to run it with (`prepare`). A secondary process of a launch joins rank 0's
run directory (cli/ranks.py); the primary has its overrides checked (cli/overrides.py), a bad one said in one line
(cli/override_errors.py), the command's config checked as its job will get it, and its run directory claimed
(cli/rundir.py)."""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

from vitlab.cli.config_tree import config_dir, groups_read, refuse_unread_groups, shadowing_note, without_config_dir
from vitlab.cli.override_errors import compose, compose_first_job, explain
from vitlab.cli.overrides import override_value, refuse_repeated, refuse_unread_keys, refuse_wrong_forms
from vitlab.cli.ranks import primary_run_dir, process_rank, torchrun_store
from vitlab.cli.rundir import check_writable, claim_run_dir
from vitlab.cli.sweep import check_sweep_dir
from vitlab.utils.errors import UserError, config_errors, fail, one_line, user_error


def _hydra_quoted(value: str) -> str:
    """`value` as a quoted Hydra override value: a quote is escaped, and so are the backslashes before a quote or
    at the end (Hydra keeps any other backslash as it is)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), value) + "'"


def _check_as_job(cfg, check: Callable[[Any], None]) -> None:
    """`check` on the config a plain run's job will get, before Hydra makes its run directory: `cfg` (composed with
    Hydra's node) less that node, which `${hydra:...}` reads from HydraConfig as in a job; its run directory named,
    not made."""
    from hydra.core.hydra_config import HydraConfig

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(cfg.hydra.run.dir)
    job = copy.deepcopy(cfg)
    with open_dict(job):
        del job["hydra"]
    HydraConfig.instance().set_config(cfg)
    try:
        check(job)
    finally:
        HydraConfig.instance().cfg = None  # the job's own is set by Hydra


def _refuse_bad_overrides(config_name: str, overrides: list[str]) -> None:
    """What is wrong with the overrides themselves, in one line: a group the command does not read, a key given twice,
    a + key no command reads, a group of keys given one value or one value a group (a sweep's swept keys: the first
    job's, compose_first_job)."""
    refuse_unread_groups(config_name, overrides)
    refuse_repeated(overrides)
    refuse_unread_keys(config_name, overrides, groups_read(config_name), lambda o: compose(config_name, o))
    refuse_wrong_forms(overrides, lambda o: compose(config_name, o))


def prepare(config_name: str, argv: list[str], check: Callable[[Any], None] | None = None) -> list[str]:
    """Before Hydra starts: the command line to run it with. A secondary process gets the primary's run
    directory, no .hydra/ of its own and a log file named after its rank. The primary composes once to report a
    bad override in one line, checks the config (`check`: the command's, vitlab.cli.entry.check_config), then makes
    sure its run directory is new and writable (plain runs; sweeps, Hydra's flags and HYDRA_FULL_ERROR=1 are left
    to Hydra and to each job, which report them themselves). A sweep into the directory of another sweep is refused
    before Hydra rewrites anything there (vitlab.cli.sweep.check_sweep_dir)."""
    rank = process_rank()
    if rank > 0:
        own = {
            "hydra.run.dir": lambda: _hydra_quoted(primary_run_dir(rank)),
            "hydra.job.name": lambda: f"{config_name}_rank{rank}",
            "hydra.output_subdir": lambda: "null",
        }
        # Lightning's DDP launcher names the job train_ddp_process_<k>: its log is ours, train_rank<k>.log, as said.
        argv = [a for a in argv if not a.startswith("hydra.job.name=")]
        return [*argv, *(f"{key}={value()}" for key, value in own.items() if override_value(argv, key) is None)]
    typed, argv = argv, without_config_dir(argv)  # (Hydra gets --config-dir as typed: config_tree reads it)
    if (note := shadowing_note()) is not None:
        print(note, file=sys.stderr, flush=True)
    run_dir = override_value(argv, "hydra.run.dir")
    if run_dir is None and int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1 and torchrun_store() is None:
        primary_run_dir(rank)  # srun's task 0: its other tasks cannot follow it anywhere, so none starts
    flags = [a for a in argv if a.startswith("-")]
    if flags and all(f in ("-m", "--multirun") for f in flags):  # HYDRA_FULL_ERROR=1 or not: its data is at stake
        check_sweep_dir(override_value(argv, "hydra.sweep.dir"), argv, f"vitlab.{config_name}")
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(f not in ("-m", "--multirun") for f in flags):
        return typed

    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/")) and not a.startswith("-")]
    _refuse_bad_overrides(config_name, overrides)
    if flags:  # a sweep: what every job would refuse alike (a misspelt key) is said once; the jobs check the rest
        compose_first_job(config_name, overrides)
        return typed
    if override_value(argv, "model") == "_base":
        models = sorted(p.stem for p in (config_dir() / "model").glob("*.yaml") if p.stem != "_base")
        fail(f"model=_base holds the defaults every model builds on, not a model; choose one of {models}")
    try:
        cfg = compose(config_name, overrides, with_hydra=True)
        log_dir = OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False)
    except config_errors() as e:
        fail(explain(e, config_name, overrides))
    if (override_value(argv, "hydra.mode") or getattr(cfg.hydra.mode, "name", None)) == "MULTIRUN":
        check_sweep_dir(override_value(argv, "hydra.sweep.dir"), argv, f"vitlab.{config_name}")  # (hparams_search=...)
    try:
        if check is not None:
            _check_as_job(cfg, check)
    except config_errors() as e:
        cause = user_error(e) or e
        fail(one_line(cause), getattr(cause, "exit_code", 2))
    try:
        if run_dir is not None and "${" not in run_dir:  # one with interpolations: unique by its own making
            claim_run_dir(Path(run_dir))
        elif log_dir:
            check_writable(Path(log_dir))
    except UserError as e:
        fail(one_line(e))
    return typed
