"""Which process of a launch this is, and which run directory it writes to, settled before Hydra starts.

One process owns a run's directory (rank 0): a plain command claims a new one, or the explicit hydra.run.dir it
was given. Every other process of the launch writes into the same directory and claims nothing:

- Lightning's DDP children (LOCAL_RANK > 0; NODE_RANK > 0 on other nodes) are started with rank 0's
  hydra.run.dir on their command line;
- torchrun's other processes (RANK > 0, on this node or another) read it from torchrun's own key-value store,
  where rank 0 puts it as soon as Hydra has made it (`task_started`);
- processes that Slurm's srun started together (SLURM_PROCID > 0) are given it on the command line; without
  one the whole step is refused in one line, since the tasks have no way to agree (vitlab's Slurm launcher,
  hydra/launcher=slurm, gives every task of a job its directory).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict

from vitlab.cli.config_tree import config_dir, groups_read, refuse_unread_groups, shadowing_note, without_config_dir
from vitlab.cli.overrides import quoting_hint, refuse_repeated, refuse_unread_keys
from vitlab.cli.sweep import check_sweep_dir
from vitlab.utils.errors import UserError, config_errors, fail, one_line, user_error

# Written into every run directory the moment a command claims it (see claim_run_dir).
CLAIM_FILE = ".vitlab-run"
CLAIMED: list[Path] = []  # the run directory this process claimed (claim_run_dir), once it has
# The log of another process of the same launch (`<command>_rank<k>.log`): started with the same hydra.run.dir by
# torchrun or srun, it may write this before rank 0 has claimed the directory (issue 53).
SECONDARY_LOG = re.compile(r"\w+_rank[1-9]\d*\.log")
# How long a torchrun process waits for rank 0 to make the run directory.
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def process_rank() -> int:
    """0 for the process that owns the run directory; this process's rank among those of its launch otherwise."""
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK"):  # torchrun; Lightning's DDP children, here and on other nodes
        if int(os.environ.get(key) or 0) > 0:
            return int(os.environ["RANK"]) if os.environ.get("RANK") else int(os.environ[key])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1:  # one of several tasks srun started
        return int(os.environ.get("SLURM_PROCID") or 0)
    return 0


def _torchrun_store():
    """torchrun's own key-value store (its agent's), which every process of the launch reaches, or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=RENDEZVOUS_TIMEOUT
    )


def _run_dir_key() -> str:
    return f"vitlab/run_dir/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def task_started() -> None:
    """In the task, once Hydra has made the run directory. Rank 0 under torchrun puts it where the other processes
    wait for it. A secondary task of a Slurm job (vitlab's launcher runs each task as the same Hydra job) logs to a
    file of its own, as Lightning's DDP children do, not into the primary's."""
    from hydra.core.hydra_config import HydraConfig

    rank = process_rank()
    if rank == 0 and int(os.environ.get("WORLD_SIZE") or 1) > 1 and (store := _torchrun_store()) is not None:
        store.set(_run_dir_key(), HydraConfig.get().runtime.output_dir)
    if rank > 0 and os.environ.get("SUBMITIT_EXECUTOR"):
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            path = Path(handler.baseFilename)
            own = logging.FileHandler(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
            own.setFormatter(handler.formatter)
            own.setLevel(handler.level)
            root.removeHandler(handler)
            handler.close()
            root.addHandler(own)


# What a run directory holds before any result: Hydra's, the claim, the logs, config.yaml and the loggers' first files.
START_FILES = (".hydra", CLAIM_FILE, "config.yaml", "csv", "tensorboard", "wandb", "checkpoints")


def _holds_results(out: Path) -> bool:
    unknown = [p for p in out.iterdir() if p.name not in START_FILES and p.suffix != ".log"]
    return bool(unknown) or any((out / "checkpoints").glob("*")) or (out / "csv" / "metrics.csv").exists()


def discard_if_unused(log_dir: str | None, out: Path | None = None) -> bool:
    """A run stopped by bad input or a signal before it had any result (no checkpoint, no metric, no output file)
    leaves no directory, and no folder above it up to `log_dir` that it left empty. (The error is on stderr.)
    Whether it was removed. `out`: that directory, where Hydra's job has none yet (CLAIMED, before the task)."""
    from hydra.core.hydra_config import HydraConfig

    out = out or Path(HydraConfig.get().runtime.output_dir)
    if process_rank() > 0 or not out.is_dir() or _holds_results(out):
        return False
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        if Path(handler.baseFilename).parent == out:
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(out, ignore_errors=True)
    _remove_empty_parents(out, log_dir)
    return True


def discard_unused_sweep(sweep_dir: Path, log_dir: str | None) -> None:
    """A sweep whose launcher stopped before any job ran (sbatch refused them) leaves no directory: one that holds
    only Hydra's multirun.yaml and submitit's .submitit/ is removed, with the folders above it it leaves empty."""
    if not sweep_dir.is_dir() or any(p.name not in ("multirun.yaml", ".submitit") for p in sweep_dir.iterdir()):
        return
    shutil.rmtree(sweep_dir, ignore_errors=True)
    _remove_empty_parents(sweep_dir, log_dir)


def _remove_empty_parents(out: Path, log_dir: str | None) -> None:
    """The folders above `out`, up to `log_dir`, that are empty now."""
    stop = Path(log_dir).resolve().parent if log_dir else out.parent
    for parent in out.parents:
        if parent == stop or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


def _primary_run_dir(rank: int) -> str:
    """The run directory of rank 0, as torchrun's store has it; refused in one line where there is no way to know."""
    store = _torchrun_store()
    if store is not None:
        try:
            return store.get(_run_dir_key()).decode()
        except (RuntimeError, OSError) as e:  # the store went away: rank 0 stopped (its output says why)
            fail(f"process {rank} of torchrun got no run directory from rank 0, which stopped before making one ({e})")
    fail(
        f"this is process {rank} of several started together, which have no way to agree on one run directory: "
        "give them all the same hydra.run.dir (e.g. hydra.run.dir=outputs/train/runs/$SLURM_JOB_ID), start them "
        "with torchrun, or on Slurm use vitlab's launcher (python -m vitlab.train -m hydra/launcher=slurm ...)"
    )
    raise AssertionError  # fail() has exited


def _hydra_quoted(value: str) -> str:
    """`value` as a quoted Hydra override value: a quote is escaped, and so are the backslashes before a quote or
    at the end (Hydra keeps any other backslash as it is)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), value) + "'"


def _override_value(argv: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as `key=`, `+key=` or `++key=`), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except HydraException:
        return None  # Hydra reports the malformed override itself
    found = [o for o in overrides if o.key_or_group == key and not o.is_delete()]
    return str(found[-1].value()) if found else None


def _unwritable(path: Path, what: str, err: OSError) -> UserError:
    fix = {
        "output": "choose another output",
        "out": "choose another out=<folder>",
        "run directory": "choose a writable hydra.run.dir or paths.log_dir",
    }.get(what, "choose a writable hydra.run.dir or paths.log_dir, or start the command in a writable directory")
    return UserError(f"{what} {str(path)!r} cannot be written ({err.strerror or type(err).__name__}); {fix}")


def claim_run_dir(path: Path) -> None:
    """Make `path` this run's directory, or refuse: Hydra writes into hydra.run.dir before any task code
    runs, so an earlier run's files are protected here. The claim is an exclusive create, so two
    commands started at once with the same new directory cannot both get it."""
    if path.exists() and not path.is_dir():
        raise UserError(f"hydra.run.dir {str(path)!r} is a file, not a directory; give a new directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / CLAIM_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        fd = None
    except OSError as e:
        raise _unwritable(path, "run directory", e) from e
    reused = UserError(
        f"run directory {str(path)!r} already holds files; vitlab never reuses a run directory: "
        "give a new hydra.run.dir or leave it to the default"
    )
    if fd is None:
        raise reused
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {' '.join(sys.argv)}\n")
    CLAIMED.append(path)
    # An earlier run from before claim files; the other processes' logs of this launch are not one.
    if any(p.name != CLAIM_FILE and not SECONDARY_LOG.fullmatch(p.name) for p in path.iterdir()):
        (path / CLAIM_FILE).unlink()
        raise reused


def check_writable(directory: Path, what: str = "output directory", named: Path | None = None) -> None:
    """Create `directory` and a file in it, or say in one line why not (naming `named`, what will be written
    there, when given)."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise _unwritable(named or directory, what, e) from e


def _compose(config_name: str, overrides: list[str], with_hydra: bool = False):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(config_name, overrides=overrides, return_hydra_config=with_hydra)
    finally:
        GlobalHydra.instance().clear()


def _compose_first_job(config_name: str, overrides: list[str]) -> None:
    """A sweep's first job's overrides (each swept key at its first value) composed, a bad override refused in one
    line as a single run's is (Hydra's own report is several lines and exit 1)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports a malformed override itself
    first = []
    for o in parsed:
        try:
            value = next(o.sweep_string_iterator()) if o.is_sweep_override() else None
        except (HydraException, StopIteration, TypeError):
            continue  # a search space (Optuna's interval(...)): the sweeper draws its values
        first.append(o.input_line if value is None else f"{o.get_key_element()}={value}")
    try:
        _compose(config_name, first)
    except config_errors() as e:
        fail(_explain(e, config_name, first))


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


def _explain(e: Exception, config_name: str, overrides: list[str]) -> str:
    """Hydra's report of a bad override in one line, in other words where its own would mislead: an unknown key
    (Hydra's hint, `+key=...`, only leads to a second error) names the keys there are; a value with characters
    the override grammar does not take unquoted says how to quote it."""
    text = str(e)
    if (hint := quoting_hint(overrides)) is not None:
        return hint
    unknown = re.match(r"Could not override '([^']+)'", text)
    if unknown and "not in struct" in str(e.__cause__):
        key = unknown[1]
        parent = key.rpartition(".")[0]
        rest = [o for o in overrides if _override_value([o], key) is None]
        try:
            node = _compose(config_name, rest)
            there = OmegaConf.select(node, parent) if parent else node
        except config_errors():
            there = None
        if (elsewhere := _objective_option(key, config_name, rest)) is not None:
            return elsewhere
        if config_name == "eval" and key.startswith("model.") and (ckpt := _override_value(rest, "ckpt_path")):
            return (
                f"{key}: the model of ckpt_path {ckpt!r} is taken from the checkpoint (the one it stores), not set "
                "here; drop it, or evaluate timm's weights instead: model.pretrained=<timm name> data=<name> without "
                "ckpt_path"
            )
        if there is not None:
            keys = sorted(k for k in there if not str(k).startswith("_"))
            more = f"; add another argument of its {there._target_} with +{key}=..." if "_target_" in there else ""
            return f"{key} is not a key of {parent or 'the config'}; its keys: {keys}{more}"
    return one_line(user_error(e) or e)


def _objective_option(key: str, config_name: str, overrides: list[str]) -> str | None:
    """An unknown key that is an option of another objective (conf/objective/), or an objective's option given at the
    top level as before objectives were a config group (`label_smoothing`, `mixup.*`, `distill.*`, `mae.*`): say
    which objective has it and how to give it."""
    if config_name != "train":
        return None
    head, _, rest = key.partition(".")
    option = rest if head in ("objective", "distill", "mae") else key
    others = [o for o in overrides if not o.lstrip("+~").startswith("objective=")]
    try:
        current = _compose(config_name, overrides).objective.name
        having = [name for name in sorted(p.stem for p in (config_dir() / "objective").glob("*.yaml"))
                  if _has(_compose(config_name, [*others, f"objective={name}"]).objective, option)]  # fmt: skip
    except config_errors():
        return None
    if current in having:
        return f"{key} is an option of the objective (objective={current}): give it as objective.{option}=..."
    if having:  # (every objective that has it: mask_ratio is MAE's and DINO's)
        which = " and ".join(f"objective={name}" for name in having)
        chosen = having[0] if len(having) == 1 else f"<{'|'.join(having)}>"
        return (
            f"{key} is an option of {which}, and this run's objective is {current}: give it as objective={chosen} "
            f"objective.{option}=..."
        )
    return None


def _has(node: Any, dotted: str) -> bool:
    """Whether `node` has the key `dotted`, its value given or required (`???`: objective=distill's teacher)."""
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node.keys():
            return False
        node = node._get_node(part)
    return True


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
            "hydra.run.dir": lambda: _hydra_quoted(_primary_run_dir(rank)),
            "hydra.job.name": lambda: f"{config_name}_rank{rank}",
            "hydra.output_subdir": lambda: "null",
        }
        # Lightning's DDP launcher names the job train_ddp_process_<k>: its log is ours, train_rank<k>.log, as said.
        argv = [a for a in argv if not a.startswith("hydra.job.name=")]
        return [*argv, *(f"{key}={value()}" for key, value in own.items() if _override_value(argv, key) is None)]
    typed, argv = argv, without_config_dir(argv)  # (Hydra gets --config-dir as typed: config_tree reads it)
    if (note := shadowing_note()) is not None:
        print(note, file=sys.stderr, flush=True)
    run_dir = _override_value(argv, "hydra.run.dir")
    if run_dir is None and int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1 and _torchrun_store() is None:
        _primary_run_dir(rank)  # srun's task 0: its other tasks cannot follow it anywhere, so none starts
    flags = [a for a in argv if a.startswith("-")]
    if flags and all(f in ("-m", "--multirun") for f in flags):  # HYDRA_FULL_ERROR=1 or not: its data is at stake
        check_sweep_dir(_override_value(argv, "hydra.sweep.dir"), argv, f"vitlab.{config_name}")
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(f not in ("-m", "--multirun") for f in flags):
        return typed

    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/")) and not a.startswith("-")]
    refuse_unread_groups(config_name, overrides)
    refuse_repeated(overrides)
    refuse_unread_keys(config_name, overrides, groups_read(config_name), lambda o: _compose(config_name, o))
    if flags:  # a sweep: what every job would refuse alike (a misspelt key) is said once; the jobs check the rest
        _compose_first_job(config_name, overrides)
        return typed
    if _override_value(argv, "model") == "_base":
        models = sorted(p.stem for p in (config_dir() / "model").glob("*.yaml") if p.stem != "_base")
        fail(f"model=_base holds the defaults every model builds on, not a model; choose one of {models}")
    try:
        cfg = _compose(config_name, overrides, with_hydra=True)
        log_dir = OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False)
    except config_errors() as e:
        fail(_explain(e, config_name, overrides))
    if (_override_value(argv, "hydra.mode") or getattr(cfg.hydra.mode, "name", None)) == "MULTIRUN":
        check_sweep_dir(_override_value(argv, "hydra.sweep.dir"), argv, f"vitlab.{config_name}")  # (hparams_search=...)
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
