"""The assembly layer: a composed config becomes the objects a command runs (datamodule, module,
trainer with its loggers and callbacks); a checkpoint becomes a module to test or predict with in inference.py.
Every command (`train`, `eval`, `predict`, `visualize`, `benchmark`) calls these; no command imports another.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.convert.weights import read_checkpoint
from vitlab.data import naflex as naflex_loading
from vitlab.data import sizes
from vitlab.model.config import vit_config
from vitlab.training.callbacks.health import AdaptiveGradientClipping
from vitlab.training.callbacks.standard import NonFiniteLoss, RichBar, TQDMBar
from vitlab.training.devices import float8, sharding
from vitlab.training.devices.hardware import resolve_trainer
from vitlab.training.devices.rank_state import RankState
from vitlab.training.module import OBJECTIVES, ViTModule
from vitlab.training.objectives import dino
from vitlab.training.optim import OptimConfig, scaled_lr
from vitlab.training.run.node_checks import check_devices, check_node
from vitlab.utils.clipping import check_clipping
from vitlab.utils.errors import UserError
from vitlab.utils.logs import PROGRESS_BARS, route_lightning_logs

log = logging.getLogger(__name__)
route_lightning_logs()

__all__ = [
    "build_datamodule",
    "build_fit",
    "build_module",
    "build_trainer",
    "build_callbacks",
    "loggers_finished",
]


def build_datamodule(
    data_cfg: DictConfig | Mapping[str, Any], train_cfg: DictConfig | None = None
) -> L.LightningDataModule:
    """The data module of `data_cfg` (a config node, or a plain resolved mapping with its `_target_`); of a train
    config's (`train_cfg`), with the views its objective trains on (objective=dino's multi-crop)."""
    if not isinstance(data_cfg, DictConfig):
        data_cfg = OmegaConf.create(dict(data_cfg))
    check_node(data_cfg, "data")
    if train_cfg is not None and train_cfg.objective.get("name") == "dino":
        objective = OmegaConf.to_container(train_cfg.objective, resolve=True)
        return instantiate(data_cfg, multicrop=dino.data_views(objective, vit_config(train_cfg.model)))
    if train_cfg is not None and (data_cfg.get("naflex") or {}).get("seq_lens") is not None:  # the model's patches
        naflex_loading.check_mixup(OmegaConf.to_container(train_cfg.objective, resolve=True).get("mixup"))
        return instantiate(data_cfg, naflex=naflex_loading.for_model(data_cfg.naflex, vit_config(train_cfg.model)))
    return instantiate(data_cfg)


def build_module(cfg: DictConfig, datamodule: L.LightningDataModule | None, probe: bool = False) -> ViTModule:
    """The ViTModule of a train config, training `cfg.objective` (random weights; `train` loads pretrained ones).
    `probe`: the module memory.estimate reads before the batch size is chosen (auto_batch): laid out on the meta
    device (nothing allocated), the learning rate not yet scaled by the batch, no data module yet."""
    if not probe:
        resolve_lr(cfg)
    # trainer=fsdp: the ViT is laid out on the meta device and each process initialises its shards
    # (training.devices.sharding); pretrained weights are loaded into a whole model, built on the host.
    on_meta = probe or (sharding.requests_fsdp(cfg.get("trainer") or {}) and not cfg.model.get("pretrained"))
    model = vit_config(cfg.model)
    sizes.check_model(getattr(datamodule, "size_schedule", None), model, cfg.objective.get("name"))
    with sharding.networks_on_meta(on_meta):
        return ViTModule(
            model=model,
            objective=OmegaConf.to_container(cfg.objective, resolve=True, throw_on_missing=True),  # a `???` named
            optim=OmegaConf.to_container(cfg.optim, resolve=True),
            scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
            compile=cfg.compile,
            class_names=list(getattr(datamodule, "class_names", []) or []),
            data=OmegaConf.to_container(cfg.data, resolve=True),
            freeze_backbone=cfg.freeze_backbone,
        )


def resolve_lr(cfg: DictConfig) -> None:
    """optim.lr_base set: optim.lr becomes lr_base scaled by the global batch (timm's, DeiT's and MAE's rule), the
    batch being data.batch_size (already global: per device x devices x nodes) x trainer.accumulate_grad_batches.
    Both are logged and written into the config, so config.yaml and the checkpoints say which learning rate ran."""
    optim = OptimConfig.from_dict(OmegaConf.to_container(cfg.optim, resolve=True))
    if optim.lr_base is None:
        return
    batch, how = global_batch(cfg)
    lr = scaled_lr(optim, batch)
    with open_dict(cfg):
        cfg.optim.lr, cfg.optim.global_batch = lr, optim.global_batch or batch
    log.info(
        "optim.lr %.4g: optim.lr_base %g x %s(global batch %d / optim.lr_base_size %d); global batch %s",
        lr,
        optim.lr_base,
        "sqrt" if optim.lr_base_scale == "sqrt" else "",
        optim.global_batch or batch,
        optim.lr_base_size,
        f"{optim.global_batch} (optim.global_batch)" if optim.global_batch else how,
    )


def global_batch(cfg: DictConfig) -> tuple[int, str]:
    """The images per optimizer step over every process (MAE's eff_batch_size), and how it was counted."""
    t = cfg.get("trainer") or {}
    accumulate, devices, nodes = t.get("accumulate_grad_batches", 1) or 1, t.get("devices", 1), t.get("num_nodes", 1)
    batch, how = cfg.data.batch_size, f"= data.batch_size {cfg.data.batch_size}"
    schedule = sizes.SizeSchedule.from_data(cfg.data)
    if schedule is not None and schedule.batch_sizes:  # as timm's train.py: the schedule's average batch
        average = schedule.average_batch(batch, t.get("max_epochs"))
        batch, how = round(average), f"= {average:.2f}, data.train_batch_sizes averaged over their schedule,"
    elif isinstance(devices, int) and devices > 0 and isinstance(nodes, int) and nodes > 0:
        per = cfg.data.batch_size / (devices * nodes)
        how += f" ({per:g} per device x {devices} devices x {nodes} nodes)"
    batch *= accumulate
    return batch, how + f" x trainer.accumulate_grad_batches {accumulate}"


def progress_bar(choice: str) -> tuple[list, bool]:
    """The progress-bar callbacks and Trainer flag of `progress_bar=`; without a bar (a log file, CI)
    the EpochLog callback (conf/callbacks/epoch_log.yaml) writes a line per epoch."""
    if choice not in PROGRESS_BARS:
        raise UserError(f"progress_bar {choice!r} is not one of {list(PROGRESS_BARS)}")
    if choice == "auto":
        choice = "rich" if sys.stdout.isatty() else "none"
    if choice == "none":
        return [], False
    return [RichBar() if choice == "rich" else TQDMBar()], True  # (epochs counted from 1)


def instantiate_group(group: DictConfig | None, extra: Any = None) -> list[Any]:
    """Every entry with a _target_ in a callbacks/logger group, in order (`extra(its node)`: further arguments)."""
    if not group:
        return []
    nodes = {k: node for k, node in group.items() if isinstance(node, DictConfig) and "_target_" in node}
    for name, node in nodes.items():
        check_node(node, f"{group._key()}.{name}")
    return [instantiate(node, **(extra(node) if extra else {})) for node in nodes.values()]


def build_loggers(group: DictConfig | None, resume_from: str | None = None) -> list[Any]:
    """The logger group, each logger's `LOGGER_LIFECYCLE` check run before any is built (W&B without an API key,
    and not offline, is refused before it prompts). A run that goes on from the checkpoint `resume_from` goes on
    logging to the W&B run that checkpoint names (RunIds), offline too: one curve, its steps continued."""
    wandb_id = (read_checkpoint(resume_from, weights=False).get(RunIds.key) or {}).get("wandb") if resume_from else None
    nodes = [node for node in (group or {}).values() if isinstance(node, DictConfig) and "_target_" in node]
    for node in nodes:
        _lifecycle(node._target_)[0](node)
    if not any(_is_wandb(node) for node in nodes):
        wandb_id = None
    if wandb_id:
        log.info("W&B: continuing run %s, which %s names", wandb_id, resume_from)
    loggers = instantiate_group(group, lambda node: {"id": wandb_id} if _is_wandb(node) and wandb_id else {})
    for logger in loggers:  # Lightning passes anonymous=None, which W&B 0.19+ warns about on every run
        init = getattr(logger, "_wandb_init", None) if isinstance(logger, WandbLogger) else None
        if init is not None and init.get("anonymous") is None:
            init.pop("anonymous", None)
    return loggers


def _is_wandb(node: DictConfig) -> bool:
    target = get_object(node._target_) if isinstance(node._target_, str) else node._target_
    return isinstance(target, type) and issubclass(target, WandbLogger)


class RunIds(L.Callback):
    """The run ids of this run's loggers (W&B's), saved in every checkpoint: a run resumed from it continues them."""

    key = "logger_run_ids"

    def __init__(self):
        self.ids: dict[str, str] = {}  # kept once seen: a logger dropped on the way to a stop's checkpoint is in it

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        wandb = [lg.version for lg in trainer.loggers if isinstance(lg, WandbLogger) and lg.version]
        self.ids |= {"wandb": wandb[0]} if wandb else {}
        if self.ids:
            checkpoint[self.key] = dict(self.ids)


def _check_wandb_login(node: DictConfig) -> None:
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


def build_callbacks(cfg: DictConfig, extra: Sequence[L.Callback] = ()) -> tuple[list[L.Callback], bool]:
    """The configured callbacks (conf/callbacks), the progress bar's and `extra`; and whether a bar is shown."""
    bars, show_bar = progress_bar(cfg.progress_bar)
    return instantiate_group(checkpoint_follows_objective(cfg).get("callbacks")) + bars + [RunIds(), *extra], show_bar


def optimized_metric(cfg: DictConfig) -> str | None:
    """`optimized_metric`; in a single run its default (val/acc_best) follows an objective that logs no accuracy
    (val/loss_best), as the best checkpoint does. A sweep keeps what it was given: its direction goes with it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    key, (watched, _) = (
        cfg.get("optimized_metric"),
        OBJECTIVES[(cfg.get("objective") or {}).get("name", "classify")].best,
    )
    single = not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN
    return f"val/{watched}_best" if key == "val/acc_best" and watched != "acc" and single else key


def checkpoint_follows_objective(cfg: DictConfig) -> DictConfig:
    """The default choice of the best checkpoint (val/acc, highest) under an objective that logs no accuracy (MAE,
    DINO without its k-NN callback): that objective's own (val/loss, lowest), said in a line; a monitor set in a
    recipe or on the command line is kept."""
    node = (cfg.get("callbacks") or {}).get("model_checkpoint")
    watched, mode = OBJECTIVES[(cfg.get("objective") or {}).get("name", "classify")].best
    if node is None or node.get("monitor") != "val/acc" or watched == "acc":
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.callbacks.model_checkpoint.monitor, cfg.callbacks.model_checkpoint.mode = f"val/{watched}", mode
    if rank_zero_only.rank == 0:
        log.info("objective=%s logs no val/acc: the best checkpoint is the one of the %s val/%s", cfg.objective.name,
                 "lowest" if mode == "min" else "highest", watched)  # fmt: skip
    return cfg


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
    cfg: DictConfig,
    callbacks: Sequence[L.Callback] = (),
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> Fit:
    """vitlab.train's steps from data to Trainer (a data module built from `cfg.data` may be given), with `callbacks`
    added and `trainer_kwargs` over the trainer config."""
    datamodule = build_datamodule(cfg.data, cfg) if datamodule is None else datamodule
    module = build_module(cfg, datamodule)
    all_callbacks, show_bar = build_callbacks(cfg, callbacks)
    loggers = build_loggers(cfg.get("logger"))
    trainer = build_trainer(
        cfg.trainer, callbacks=all_callbacks, logger=loggers or False, enable_progress_bar=show_bar, **trainer_kwargs
    )
    return Fit(datamodule, module, trainer, loggers)


def build_trainer(trainer_cfg: DictConfig | Mapping[str, Any], **kwargs: Any) -> L.Trainer:
    """The Lightning Trainer of the config (a config node, or a plain resolved mapping with its `_target_`).
    Lightning's own refusal of a setting becomes one line: a device request this machine cannot serve names what
    there is; any other names the setting."""
    if not isinstance(trainer_cfg, DictConfig):
        trainer_cfg = OmegaConf.create(dict(trainer_cfg))
    check_devices(trainer_cfg)
    if (chosen := resolve_trainer(trainer_cfg)) and rank_zero_only.rank == 0:  # 'auto' is ours: Lightning's next
        log.info(chosen)
    check_node(trainer_cfg, "trainer")
    # What every run needs, whatever its callbacks group says: the non-finite-loss stop, each process's state in
    # its checkpoints, and the Lightning workarounds below.
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), NonFiniteLoss(), RankState(), LightningWorkarounds()]
    check_clipping(trainer_cfg)
    if trainer_cfg.get("gradient_clip_algorithm") == "agc":  # Lightning's Trainer knows value and norm only
        factor = trainer_cfg.gradient_clip_val
        kwargs["callbacks"].append(AdaptiveGradientClipping(float(factor)))  # after Health: it reads unclipped norms
        kwargs |= {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    try:
        return instantiate(trainer_cfg, **kwargs | float8.trainer_arguments(trainer_cfg))  # (precision=float8)
    except InstantiationException as e:
        cause = e.__cause__
        if not isinstance(cause, (MisconfigurationException, ValueError)) or isinstance(cause, UserError):
            raise
        text = str(cause).strip().splitlines()[0]
        if isinstance(cause, MisconfigurationException) and _is_device_error(text):
            have = f"{torch.cuda.device_count()} CUDA GPU(s) and {os.cpu_count()} CPU cores"
            raise UserError(
                f"trainer.accelerator={trainer_cfg.get('accelerator')!r} trainer.devices="
                f"{trainer_cfg.get('devices')!r} cannot run here ({text}); this machine has {have}"
            ) from cause
        raise UserError(f"trainer: {text}") from cause


class LightningWorkarounds(L.Callback):
    """What Lightning's Trainer gets wrong for us, set right where the Trainer is built, once the optimizer and its
    schedule have counted the steps (which builds the train loader) and before a checkpoint's loops are restored."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = max(1, int(trainer.estimated_stepping_batches))
        # Counting the steps (here and in configure_optimizers) built the train loader before a checkpoint's loader
        # position is restored, and fit then never applies that position (Lightning-AI/pytorch-lightning#20550,
        # open): drop the early loader, after the last count, so fit builds it again after the restore.
        # tests/end_to_end/test_reliability.py guards this.
        trainer.fit_loop._combined_loader = None
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
        if 0 < total // epochs < trainer.log_every_n_steps:
            # Epochs shorter than the logging interval would log no step at all (no loss or LR curve for a short
            # run): log once per epoch's worth of steps instead.
            trainer.log_every_n_steps = total // epochs


def _is_device_error(text: str) -> bool:
    return any(word in text.lower() for word in ("device", "accelerator", "gpu", "cuda", "mps", "tpu"))
