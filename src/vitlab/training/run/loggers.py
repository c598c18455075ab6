"""A run's loggers and their lifecycle: the logger group built from the plan's nodes (each logger's check before any is
built, `LOGGER_LIFECYCLE`), a resumed run continuing the W&B run its checkpoint names (`RunIds`, saved in every
checkpoint), and each logger's run ended after the fit, also after an error or a signal (one W&B run per job, in
sweeps too)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from hydra.utils import get_object
from lightning.pytorch.loggers import WandbLogger

from vitlab.training.run.build import instantiate_group
from vitlab.training.run.plan import Checkpoint
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


def build_loggers(group: Mapping[str, Any] | None, resumed: Checkpoint | None = None) -> list[Any]:
    """The logger group, each logger's `LOGGER_LIFECYCLE` check run before any is built (W&B without an API key,
    and not offline, is refused before it prompts). A run that goes on from the checkpoint `resumed` (read once, by
    the plan) goes on logging to the W&B run that checkpoint names (RunIds), offline too: one curve, its steps
    continued."""
    wandb_id = resumed.logger_id("wandb") if resumed else None
    nodes = [node for node in (group or {}).values() if isinstance(node, Mapping) and "_target_" in node]
    for node in nodes:
        _lifecycle(node["_target_"])[0](node)
    if not any(_is_wandb(node) for node in nodes):
        wandb_id = None
    if wandb_id:
        log.info("W&B: continuing run %s, which %s names", wandb_id, resumed.path)
    loggers = instantiate_group(group, lambda node: {"id": wandb_id} if _is_wandb(node) and wandb_id else {})
    for logger in loggers:  # Lightning passes anonymous=None, which W&B 0.19+ warns about on every run
        init = getattr(logger, "_wandb_init", None) if isinstance(logger, WandbLogger) else None
        if init is not None and init.get("anonymous") is None:
            init.pop("anonymous", None)
    return loggers


def _is_wandb(node: Mapping[str, Any]) -> bool:
    target = get_object(node["_target_"]) if isinstance(node["_target_"], str) else node["_target_"]
    return isinstance(target, type) and issubclass(target, WandbLogger)


def _check_wandb_login(node: Mapping[str, Any]) -> None:
    offline = node.get("offline") or os.environ.get("WANDB_MODE") in ("offline", "disabled")
    if offline or os.environ.get("WANDB_API_KEY"):
        return
    import wandb

    if not wandb.login(prompt=False):  # finds a key in the environment, ~/.netrc or wandb's settings
        raise UserError(
            "logger=wandb needs a W&B login: run `wandb login`, set WANDB_API_KEY, or log offline with "
            "logger.wandb.offline=true (or WANDB_MODE=offline; `wandb sync` uploads later)"
        )


def _finish_wandb(logger: Any) -> None:
    import wandb

    try:
        wandb.finish()  # one W&B run per job, also in sweeps
    except (ConnectionError, OSError) as e:  # its service went with a signal (Slurm's, to every process of a job)
        log.warning("W&B's run could not be finished (%s: %s); its records so far are on disk", type(e).__name__, e)


def _nothing(_: Any) -> None:
    pass


# Logger class -> (check of its config node before anything is built, end of its run after the fit); a logger
# not listed (or a subclass of none listed) needs neither.
LOGGER_LIFECYCLE: dict[type, tuple[Any, Any]] = {WandbLogger: (_check_wandb_login, _finish_wandb)}


def _lifecycle(target: Any) -> tuple[Any, Any]:
    cls = get_object(target) if isinstance(target, str) else type(target)
    for kind, steps in LOGGER_LIFECYCLE.items():
        if isinstance(cls, type) and issubclass(cls, kind):
            return steps
    return _nothing, _nothing


@contextlib.contextmanager
def loggers_finished(loggers: list[Any]) -> Iterator[None]:
    """A fit's block; afterwards (also after an error or a signal) each logger's run is ended (LOGGER_LIFECYCLE)."""
    try:
        yield
    finally:
        finish_loggers(loggers)


def finish_loggers(loggers: list[Any]) -> None:
    """Each logger's run ended (LOGGER_LIFECYCLE): W&B's footer said before a stopped run's last line, not after it."""
    for logger in loggers:
        _lifecycle(logger)[1](logger)
