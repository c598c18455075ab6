"""The assembly of a fit as the benchmarks run it: vitlab.train's steps from data to Trainer (run/build.py's builders,
the plan's loggers), in one call (`build_fit`), its loggers ended by `Fit.finished`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L

from vitlab.training.module import ViTModule
from vitlab.training.run.build import build_callbacks, build_module, build_trainer, fit_datamodule
from vitlab.training.run.loggers import build_loggers, loggers_finished
from vitlab.training.run.plan import TrainPlan


@dataclasses.dataclass
class Fit:
    """What the benchmarks fit, assembled as `vitlab.train` assembles it: built by `build_fit`, its loggers ended by
    `finished`."""

    datamodule: L.LightningDataModule
    module: ViTModule
    trainer: L.Trainer
    loggers: list[Any]

    @contextlib.contextmanager
    def finished(self) -> Iterator[Fit]:
        with loggers_finished(self.loggers):
            yield self


def build_fit(
    plan: TrainPlan,
    callbacks: Sequence[L.Callback] = (),
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> Fit:
    """vitlab.train's steps from data to Trainer (a data module built from the plan's data may be given), with
    `callbacks` added and `trainer_kwargs` over the plan's trainer settings."""
    datamodule = fit_datamodule(plan) if datamodule is None else datamodule
    module = build_module(plan, datamodule)
    all_callbacks, show_bar = build_callbacks(plan.callbacks, plan.progress_bar, callbacks)
    loggers = build_loggers(plan.loggers)
    trainer = build_trainer(
        plan.trainer,
        plan.trainer_args,
        callbacks=all_callbacks,
        logger=loggers or False,
        enable_progress_bar=show_bar,
        **trainer_kwargs,
    )
    return Fit(datamodule, module, trainer, loggers)
