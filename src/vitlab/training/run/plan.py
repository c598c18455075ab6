"""A vitlab.train run's plan: one frozen value of typed parts, made once from the checked config by vitlab.cli.plans
before anything is built (`TrainPlan`): the model's ViTConfig (pretrained architecture applied), the data's,
objective's, optimiser's, scheduler's and trainer's settings (resolved plain data: preprocessing of pretrained weights
filled, the learning rate scaled, the trainer's `auto` chosen), the pretrained weights, the checkpoint to go on from
(`Checkpoint`, read once), the callback and logger nodes, and the run's own settings. Each builder takes the part of it
it uses; the run's steps that read it are in steps.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L

from vitlab.convert.source import Weights
from vitlab.model.config import ViTConfig
from vitlab.training.callbacks.standard import LOGGER_IDS


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a run goes on from, read once when the run is planned (its metadata: hyper-parameters, loops,
    its loggers' run ids, whether it is an average) and handed to each step that asks (the batch of
    data.batch_size=auto, the resumability checks, the W&B run to continue); Lightning's fit reads its state."""

    path: str
    meta: dict[str, Any]  # read_checkpoint(path, weights=False): a directory of shards, its metadata only
    given: bool  # named by ckpt_path; False: found in this run's own directory (a restarted job's)
    weights: Weights | None = None  # an average's (vitlab.average): the weights training starts anew from

    @property
    def hparams(self) -> dict[str, Any]:
        return self.meta["hyper_parameters"]

    @property
    def averaged(self) -> bool:
        """vitlab.average's: weights alone, without a training state to go on from."""
        return "averaged" in self.meta

    def logger_id(self, name: str) -> str | None:
        """The run id of logger `name` ("wandb") this checkpoint's run logged to (callbacks.standard.RunIds)."""
        return (self.meta.get(LOGGER_IDS) or {}).get(name)


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What a vitlab.train run does, settled before anything is built; each builder takes the part it uses."""

    model: ViTConfig  # the model to build: pretrained weights' architecture applied
    data: dict[str, Any]  # the data module's settings with its _target_; batch_size=auto chosen (auto_batch.planned)
    views: dict[str, Any]  # the data module's arguments beside `data`: the objective's and NaFlex's (build.data_views)
    objective: dict[str, Any]  # {"name": an OBJECTIVES key, its options}
    optim: dict[str, Any]  # optim.lr scaled from optim.lr_base by the global batch
    scheduler: dict[str, Any]
    trainer: dict[str, Any]  # Lightning's Trainer settings with its _target_, precision and strategy `auto` chosen
    on_meta: bool  # trainer=fsdp without pretrained weights: the ViT laid out on the meta device, sharded as it starts
    trainer_args: dict[str, Any]  # the Trainer's arguments they translate to: AGC's callback, float8's plugin
    callbacks: dict[str, Any]  # conf/callbacks' nodes (the best checkpoint following the objective's metric)
    loggers: dict[str, Any]  # conf/logger's nodes
    weights: Weights | None  # model.pretrained, an average as ckpt_path or peft='s base, resolved once: the module
    # starts from them (None for a run resumed from a checkpoint that holds its whole state)
    resume: Checkpoint | None  # the checkpoint fit goes on from, read once
    output_dir: Path
    seed: int
    train: bool
    test: bool
    compile: bool | str
    freeze_backbone: bool
    memory_check: bool
    memory_budget_gb: float | None
    resample_patch: bool  # model.resample_patch: pretrained patch filters of another size resampled
    progress_bar: str
    print_config: bool  # config.yaml shown as a tree too
    optimized_metric: str | None  # what a sweeper optimises (optimized_metric, following the objective)
    pruning: tuple[L.Callback, ...] = ()  # an Optuna trial's pruning callback, in a sweep with a pruner
    peft: dict[str, Any] | None = None  # peft=: the method and the base weights it adapts (training.adapters)
    batch_size_auto: dict[str, Any] | None = None  # what data.batch_size=auto chose, and why
    memory: Any = None  # the memory estimate per process (devices.memory.Estimate)
    memory_refusal: str | None = None  # with memory_check: why the run would not fit (it stops on it), else None
    config: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # as it runs: config.yaml's

    def first_metrics(self) -> dict[str, Any]:
        return {"batch_size_auto": self.batch_size_auto} if self.batch_size_auto else {}
