"""Going on from a checkpoint: which one (the user's, `last`, or the one a restarted job left in its own run
directory), read once when the run is planned (`Checkpoint`), whether this run can go on from it (one-line refusals of
another architecture, batch size or a finished run). A run stopped on a signal says what to resume from: steps.py."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from vitlab.convert.source import Weights, resolve
from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint
from vitlab.model.choices import DROPOUTS
from vitlab.model.config import ViTConfig
from vitlab.training.devices.sharding import requests_fsdp
from vitlab.training.module import ViTModule
from vitlab.training.run.plan import Checkpoint, TrainPlan
from vitlab.utils.atomic import remove_stale_temporaries
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

# Regularisation (and gradient checkpointing) may change between a run and its resumption; the architecture may not.
RESUME_MAY_DIFFER = {*DROPOUTS, "grad_checkpointing"}


def planned_checkpoint(ckpt_path: str | None, runs_dir: Path, run_dir: Path, trainer: Mapping) -> Checkpoint | None:
    """The checkpoint a run goes on from, read once: the user's `ckpt_path` (`last`: the newest of `runs_dir`'s), else
    one a restarted job left in its own run directory `run_dir`; None for a new run. An average's weights are resolved
    here too (weights_to_start_from). A directory of shards is refused without trainer=fsdp (`trainer`: the run's
    settings)."""
    path = resolve_ckpt_path(ckpt_path, runs_dir)
    if path and is_sharded_checkpoint(path) and not requests_fsdp(trainer):
        raise UserError(
            f"ckpt_path {path!r} is a directory of shards: go on from it with trainer=fsdp, or make one file of "
            f"it first (python -m vitlab.export ckpt_path={path} format=ckpt), which any strategy reads"
        )
    given = path is not None
    if not (path := path or earlier_start(run_dir)):
        return None
    meta = read_checkpoint(path, weights=False)
    return Checkpoint(path, meta, given, weights=resolve(path) if "averaged" in meta else None)


def starting_point(plan: TrainPlan, module: ViTModule) -> str | None:
    """The checkpoint `vitlab.train` goes on from (the plan's: the user's, refused if its run had finished; a restarted
    job's own), or None: a new run, from the weights the module was built with (the plan's: model.pretrained's, an
    average's)."""
    ckpt = plan.resume
    if ckpt:  # a job that restarts goes on to test even when it had finished
        check_resumable(ckpt, module, plan.trainer if ckpt.given and plan.train else None)
        return ckpt.path
    return None


def weights_to_start_from(ckpt: Checkpoint | None, weights: Weights | None) -> tuple[Checkpoint | None, Weights | None]:
    """(the checkpoint to go on from, the weights a new run starts from): an average of checkpoints (vitlab.average)
    as ckpt_path has no training state to go on from, and starts a new run from its weights, as model.pretrained=<file>
    does; anything else as it is."""
    if ckpt is None or not ckpt.averaged:
        return ckpt, weights
    log.info("ckpt_path %s is an average of checkpoints (vitlab.average), without a training state to go on "
             "from: training starts anew from its weights, as with model.pretrained=<file>", ckpt.path)  # fmt: skip
    return None, ckpt.weights


def resolve_ckpt_path(ckpt_path: str | None, runs_dir: Path) -> str | None:
    """The checkpoint to resume from: the file the user named, or for `last` the newest last.ckpt or
    interrupted.ckpt among this task's earlier runs. Temporaries that a killed save left beside it are
    removed."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        ckpt_path = _newest(runs_dir.glob("*/checkpoints"))
        if ckpt_path is None:
            raise MissingFileError(f"ckpt_path=last: no last.ckpt or interrupted.ckpt under {runs_dir}/*/checkpoints")
    if Path(ckpt_path).is_file() or is_sharded_checkpoint(ckpt_path):  # others: read_checkpoint names them
        remove_stale_temporaries(Path(ckpt_path).parent)
    return ckpt_path


def earlier_start(run_dir: Path) -> str | None:
    """The checkpoint to go on from when this run directory already holds one: the same job started again (Slurm
    requeued or pre-empted it, or submitit resubmitted it at its time limit), which resumes where it stopped. A
    new run never finds one: every command claims a new directory, and Lightning's DDP children start before
    anything is saved."""
    found = _newest([run_dir / "checkpoints"])
    if found:
        restart = os.environ.get("SLURM_RESTART_COUNT")
        log.info(
            "%s holds a checkpoint of an earlier start%s: resuming from %s",
            run_dir,
            f" (Slurm restart {restart})" if restart else "",
            found,
        )
        remove_stale_temporaries(Path(found).parent)
    return found


def _newest(folders) -> str | None:
    """The newest last.ckpt or interrupted.ckpt in `folders`."""
    found = [
        p
        for folder in folders
        for p in (folder / "last.ckpt", folder / "interrupted.ckpt")
        if p.is_file() or is_sharded_checkpoint(p)
    ]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def _model_defaults() -> dict[str, Any]:
    """ViTConfig's defaults: what a checkpoint written before a field existed trained with."""
    return {f.name: f.default for f in dataclasses.fields(ViTConfig) if f.default is not dataclasses.MISSING}


def check_resumable(ckpt: Checkpoint, module: ViTModule, trainer: Mapping | None = None) -> None:
    """Refuse, in one line, a checkpoint this run cannot go on from: another architecture or class count (before
    Lightning fails deep inside load_state_dict), another batch size (its saved position in the epoch and its
    learning-rate schedule count steps of the batch it had) or, given the run's trainer settings, a run that
    had already finished (it would train nothing), or another optimizer or schedule setting (the saved state and
    schedule go on: a new learning rate would be silently ignored)."""
    ckpt_path, meta = ckpt.path, ckpt.meta
    theirs = _model_defaults() | meta["hyper_parameters"]["model"]  # (a key added since: the default it trained with)
    ours = module.hparams["model"]
    diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k] and k not in RESUME_MAY_DIFFER}
    if diff:
        shown = ", ".join(f"{k}={a!r} (this run: {b!r})" for k, (a, b) in list(diff.items())[:4])
        raise UserError(f"ckpt_path {ckpt_path!r} was trained with a different model: {shown}")
    batch = (
        (meta["hyper_parameters"].get("data") or {}).get("batch_size"),
        (module.hparams.get("data") or {}).get("batch_size"),
    )
    if None not in batch and batch[0] != batch[1]:
        raise UserError(
            f"ckpt_path {ckpt_path!r} was trained with data.batch_size={batch[0]} (this run: {batch[1]}): its place "
            f"in the epoch and its learning-rate schedule count steps of {batch[0]} images; resume with "
            f"data.batch_size={batch[0]}"
        )
    for group in ("optim", "scheduler"):  # the optimizer's state and the schedule go on as they were saved
        saved, given = meta["hyper_parameters"].get(group) or {}, module.hparams.get(group) or {}
        changed = [k for k in given if k in saved and saved[k] != given[k]]
        if changed:
            shown = ", ".join(f"{group}.{k}={saved[k]!r} (this run: {given[k]!r})" for k in changed[:4])
            raise UserError(
                f"ckpt_path {ckpt_path!r} was trained with {shown}: a resume goes on with the checkpoint's optimizer "
                "state and learning-rate schedule, and the new value would not be applied; drop the override to "
                "resume, or train anew without ckpt_path"
            )
    if trainer is not None:
        check_unfinished(ckpt_path, meta, trainer.get("max_epochs"))


def check_unfinished(ckpt_path: str, ckpt: dict[str, Any], limit: int | None) -> None:
    """Refuse a checkpoint of a run that had finished: with `limit` (this run's trainer.max_epochs) reached, nothing
    would be trained; with its own planned epochs done and trainer.max_epochs not given on the command line, the
    config's (300 by default) would silently train it on."""
    epochs = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    done = max(epochs.get("processed", 0), epochs.get("completed", 0))
    test = f"or test it: python -m vitlab.eval ckpt_path={ckpt_path}"
    if limit and limit > 0 and done >= limit:
        raise UserError(
            f"ckpt_path {ckpt_path!r} is of a run that had finished ({done} of {limit} epochs): nothing is left to "
            f"train; raise trainer.max_epochs to train on, {test}"
        )
    planned = ckpt.get("max_epochs")  # (a checkpoint written before it was kept: not known)
    typed = HydraConfig.initialized() and any(
        o.lstrip("+~").startswith("trainer.max_epochs=") for o in HydraConfig.get().overrides.task
    )
    if planned and 0 < planned <= done and not typed:
        raise UserError(
            f"ckpt_path {ckpt_path!r} is of a run that had finished ({done} of {planned} epochs), and "
            f"trainer.max_epochs is not given (the config's {limit} would train it on): train it on with "
            f"trainer.max_epochs above {done} (the epochs to reach), {test}"
        )
