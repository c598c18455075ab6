"""A run's directory: claimed new by the process that owns it (rank 0, cli/ranks.py), checked writable, and removed
again when the run stopped before it had any result."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path

from vitlab.cli.ranks import process_rank
from vitlab.utils.errors import UserError

# Written into every run directory the moment a command claims it (see claim_run_dir).
CLAIM_FILE = ".vitlab-run"
CLAIMED: list[Path] = []  # the run directory this process claimed (claim_run_dir), once it has
# The log of another process of the same launch (`<command>_rank<k>.log`): started with the same hydra.run.dir by
# torchrun or srun, it may write this before rank 0 has claimed the directory (issue 53).
SECONDARY_LOG = re.compile(r"\w+_rank[1-9]\d*\.log")


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
