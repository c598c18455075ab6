"""The assembly layer: a composed config becomes the objects a command runs (datamodule, module,
trainer with its loggers and callbacks), and a checkpoint path becomes a module to test or predict
with. Every command (`train`, `eval`, `predict`, `visualize`, `benchmark`) calls these; no command
imports another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from vitlab.training import resume
from vitlab.training.callbacks import SaveOnInterrupt
from vitlab.convert.weights import read_checkpoint
from vitlab.utils.errors import UserError
from vitlab.training.hardware import resolve_trainer
from vitlab.training.module import ViTModule
from vitlab.utils.logs import route_lightning_logs
from vitlab.training.mae import MAEModule, objective_module
from vitlab.model.config import vit_config
from vitlab.training.optim import OptimConfig, scaled_lr
from vitlab.utils.checks import check_arguments
from vitlab.utils.signals import pass_on

log = logging.getLogger(__name__)
route_lightning_logs()

PROGRESS_BARS = ("auto", "rich", "tqdm", "none")

__all__ = [
    "build_datamodule",
    "build_fit",
    "build_module",
    "build_trainer",
    "check_launch",
    "check_node",
    "check_settings",
    "fit_and_test",
    "inference_datamodule",
    "load_for_inference",
]


def _train_settings(
    seed: int,
    train: bool,
    test: bool,
    ckpt_path: str | None,
    optimized_metric: str | None,
    compile: bool | str,
    progress_bar: str,
    print_config: bool,
    freeze_backbone: bool,
    label_smoothing: float,
    loss: str,
    bce_target_thresh: float | None,
    task_name: str,
    tags: list[str],
) -> None:
    """The top-level keys of conf/train.yaml, with their types (check_settings checks them against these)."""


def check_settings(cfg: DictConfig) -> None:
    """The top-level keys, before anything uses them: types (settings.check_arguments), then the seed's range
    (what Lightning's seed_everything takes)."""
    values = {k: cfg[k] for k in inspect.signature(_train_settings).parameters}
    plain = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in values.items()}
    check_arguments(_train_settings, plain, "")
    if not 0 <= cfg.seed < 2**32:
        raise UserError(f"seed {cfg.seed} must be in [0, {2**32 - 1}]")


def check_launch(cfg: DictConfig) -> None:
    """Lightning's DDP launcher re-runs this command for every rank; under a -m sweep on a launcher that runs
    jobs in this process (the basic one) or as one process each (submitit_local), every child would re-run the
    whole sweep. Stop before anything starts; the Slurm launcher starts one task per device itself."""
    hc = HydraConfig.get()
    launcher = str(hc.launcher.get("_target_", ""))
    if hc.mode != RunMode.MULTIRUN or launcher.endswith("SlurmLauncher"):
        return
    t = cfg.trainer
    devices, nodes = t.get("devices", 1), t.get("num_nodes", 1)
    many = (
        nodes > 1
        or devices in (-1, "auto")
        or (isinstance(devices, int) and devices > 1)
        or (not isinstance(devices, (int, str)) and len(devices) > 1)
    )
    if many:
        how = "as one process (hydra/launcher=submitit_local)" if "submitit" in launcher else "in this process"
        raise UserError(
            f"-m sweeps run each job {how}, but trainer.devices={devices} (num_nodes={nodes}) needs one process "
            "per device, which Lightning starts by re-running the command: sweep with trainer.devices=1, or use "
            "hydra/launcher=slurm (one Slurm job per sweep point, one task per device)"
        )


def check_node(node: DictConfig, key: str) -> None:
    """The values of a config node that builds something (`_target_`), and of the nodes in it, have the types
    their target declares (settings.check_arguments): a wrong type is one line naming the key before anything
    is built, not a TypeError deep inside (Lightning's Trainer arguments included)."""
    try:
        target = get_object(str(node._target_))
    except Exception:  # an unknown target: instantiate names it
        return
    check_arguments(target, OmegaConf.to_container(node, resolve=True), key)
    for name, value in node.items():
        inner = value if isinstance(value, ListConfig) else [value]
        for i, item in enumerate(inner):
            if isinstance(item, DictConfig) and "_target_" in item:
                check_node(item, f"{key}.{name}" + (f"[{i}]" if isinstance(value, ListConfig) else ""))


def build_datamodule(data_cfg: DictConfig) -> L.LightningDataModule:
    check_node(data_cfg, "data")
    return instantiate(data_cfg)


def build_module(cfg: DictConfig, datamodule: L.LightningDataModule) -> ViTModule:
    """The ViTModule of a train config, or with `objective=mae` the MAEModule (random weights; `train` loads
    pretrained ones)."""
    resolve_lr(cfg)
    mae = OmegaConf.to_container(cfg.mae, resolve=True) if "mae" in cfg else None
    kind, extra = objective_module(cfg.get("objective", "classify"), bool(cfg.data.get("unlabeled")), mae)
    return kind(
        **extra,
        model=vit_config(cfg.model),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        label_smoothing=cfg.label_smoothing,
        loss=cfg.loss,
        bce_target_thresh=cfg.bce_target_thresh,
        mixup=OmegaConf.to_container(cfg.mixup, resolve=True),
        distill=OmegaConf.to_container(cfg.distill, resolve=True) if "distill" in cfg else None,
        compile=cfg.compile,
        class_names=list(getattr(datamodule, "class_names", []) or []),
        data=OmegaConf.to_container(cfg.data, resolve=True),
        freeze_backbone=cfg.freeze_backbone,
    )


def resolve_lr(cfg: DictConfig) -> None:
    """optim.lr_base set: optim.lr becomes lr_base scaled by the global batch (timm's and DeiT's rule), logged and
    written into the config, so config.yaml and the checkpoints say which learning rate ran."""
    optim = OptimConfig.from_dict(OmegaConf.to_container(cfg.optim, resolve=True))
    if optim.lr_base is None:
        return
    lr = scaled_lr(optim, cfg.data.batch_size)
    with open_dict(cfg):
        cfg.optim.lr = lr
    log.info(
        "optim.lr %.4g: optim.lr_base %g x %s(data.batch_size %d / optim.lr_base_size %d)",
        lr,
        optim.lr_base,
        "sqrt" if optim.lr_base_scale == "sqrt" else "",
        cfg.data.batch_size,
        optim.lr_base_size,
    )


def progress_bar(choice: str) -> tuple[list, bool]:
    """The progress-bar callbacks and Trainer flag of `progress_bar=`; without a bar (a log file, CI)
    the EpochLog callback (conf/callbacks/epoch_log.yaml) writes a line per epoch."""
    if choice not in PROGRESS_BARS:
        raise UserError(f"progress_bar {choice!r} is not one of {list(PROGRESS_BARS)}")
    if choice == "auto":
        choice = "rich" if sys.stdout.isatty() else "none"
    if choice == "none":
        return [], False
    return ([RichProgressBar()] if choice == "rich" else []), True


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Every entry with a _target_ in a callbacks/logger group, in order."""
    if not group:
        return []
    nodes = {k: node for k, node in group.items() if isinstance(node, DictConfig) and "_target_" in node}
    for name, node in nodes.items():
        check_node(node, f"{group._key()}.{name}")
    return [instantiate(node) for node in nodes.values()]


def build_loggers(group: DictConfig | None) -> list[Any]:
    """The logger group, each logger's `LOGGER_LIFECYCLE` check run before any is built (W&B without an API key,
    and not offline, is refused before it prompts)."""
    for node in (group or {}).values():
        if isinstance(node, DictConfig) and "_target_" in node:
            check, _ = _lifecycle(node._target_)
            check(node)
    return instantiate_group(group)


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

    wandb.finish()  # one W&B run per job, also in sweeps


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


@dataclasses.dataclass
class Fit:
    """What `vitlab.train` and the benchmarks fit: built by `build_fit`, its loggers ended by `finished`."""

    datamodule: L.LightningDataModule
    module: ViTModule
    trainer: L.Trainer
    loggers: list[Any]

    @contextlib.contextmanager
    def finished(self) -> Iterator[Fit]:
        """The fit's block; afterwards (also after an error or a signal) each logger's run is ended."""
        try:
            yield self
        finally:
            for logger in self.loggers:
                _lifecycle(logger)[1](logger)


def build_fit(
    cfg: DictConfig,
    callbacks: Sequence[L.Callback] = (),
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> Fit:
    """The one assembly of a fit from a train config: data module (unless one built from it is given), module, the
    configured callbacks with the progress bar's and `callbacks`, loggers (checked first) and the Trainer
    (`trainer_kwargs` over its config)."""
    datamodule = build_datamodule(cfg.data) if datamodule is None else datamodule
    module = build_module(cfg, datamodule)
    bars, show_bar = progress_bar(cfg.progress_bar)
    loggers = build_loggers(cfg.get("logger"))
    trainer = build_trainer(
        cfg.trainer,
        callbacks=instantiate_group(cfg.get("callbacks")) + bars + list(callbacks),
        logger=loggers or False,
        enable_progress_bar=show_bar,
        **trainer_kwargs,
    )
    return Fit(datamodule, module, trainer, loggers)


def build_trainer(trainer_cfg: DictConfig, **kwargs: Any) -> L.Trainer:
    """The Lightning Trainer of the config. Lightning's own refusal of a setting becomes one line: a
    device request this machine cannot serve names what there is; any other names the setting."""
    check_devices(trainer_cfg)
    if (chosen := resolve_trainer(trainer_cfg)) and rank_zero_only.rank == 0:  # 'auto' is ours: Lightning's next
        log.info(chosen)
    check_node(trainer_cfg, "trainer")
    try:
        return instantiate(trainer_cfg, **kwargs)
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


def check_devices(t: DictConfig) -> None:
    """Several devices with accelerator=auto on a machine without a GPU would start that many CPU processes, each
    as slow as the machine is small: say so, and how to ask for CPU processes on purpose."""
    devices = t.get("devices", 1)
    many = (isinstance(devices, int) and devices > 1) or (not isinstance(devices, (int, str)) and len(devices) > 1)
    if t.get("accelerator", "auto") == "auto" and many and not torch.cuda.is_available():
        raise UserError(
            f"trainer.devices={devices} asks for {devices} devices and this machine has no GPU: that would train in "
            f"{devices} CPU processes; ask for them with trainer=ddp_cpu trainer.devices={devices}, or train on the "
            "CPU in one process with trainer.devices=1"
        )


def _is_device_error(text: str) -> bool:
    return any(word in text.lower() for word in ("device", "accelerator", "gpu", "cuda", "mps", "tpu"))


# ---- training --------------------------------------------------------------------------------------


def fit_and_test(
    cfg: DictConfig, trainer: L.Trainer, module: ViTModule, datamodule: L.LightningDataModule, ckpt_path: str | None
) -> dict[str, Any]:
    """Fit (resuming from `ckpt_path`), then test the best checkpoint (data with a test split); the final metrics,
    with the best checkpoint and what each split is."""
    metrics: dict[str, Any] = {}
    best = ""
    if cfg.train:
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        except SIGTERMException:
            _stopped(trainer)
        metrics.update({k: v.item() for k, v in trainer.callback_metrics.items()})
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        metrics["best_checkpoint"] = best or None
    datamodule.setup("test")  # (done already when it trained)
    metrics["splits"] = dict(getattr(datamodule, "splits", {}))
    if cfg.test and getattr(datamodule, "test_set", True) is None:
        log.info("not tested: the data has no test split (its val/ chose the checkpoint); the result is val/acc_best")
    elif cfg.test:
        if cfg.train and not best:
            log.warning("no best checkpoint was saved; testing the final weights")
        ckpt = best or (None if cfg.train else ckpt_path)
        trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True if ckpt else None)
        metrics.update({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
        metrics["tested_checkpoint"] = ckpt or "final weights"
    return metrics


def _stopped(trainer: L.Trainer) -> None:
    """Training stopped on a signal: say what was saved and the command that resumes it, pass the signal on to the
    handler that was there before (submitit's requeues a Slurm job) and exit with 128 + the signal's number."""
    saved = next((cb.saved for cb in trainer.callbacks if isinstance(cb, SaveOnInterrupt) and cb.saved), None)
    if saved is None:  # callbacks without save_on_interrupt: Lightning's own SIGTERM handling
        if trainer.is_global_zero:
            print("stopped by SIGTERM; no checkpoint saved (callbacks without save_on_interrupt)", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)
    if trainer.is_global_zero:
        name, path = signal.Signals(saved["signal"]).name, saved["path"]
        print(
            f"interrupted by {name} at step {saved['step']} (epoch {saved['epoch'] + 1}): saved {path}; resume with: "
            f"{resume.resume_command(path)}",
            file=sys.stderr,
            flush=True,
        )
    pass_on(saved["signal"])
    raise SystemExit(128 + saved["signal"])


# ---- checkpoints ---------------------------------------------------------------------------------


def load_for_inference(ckpt_path: str, map_location: str = "cpu") -> ViTModule:
    """A trained ViTModule from a checkpoint file, rebuilt from the config stored in it (no Hydra), for
    eval, predict and visualize."""
    ckpt = read_checkpoint(ckpt_path)  # names a missing, corrupt or unsafe file in one line
    kind = MAEModule if "mae" in ckpt["hyper_parameters"] else ViTModule  # objective=mae's: the encoder and decoder
    return kind.load_from_checkpoint(ckpt_path, map_location=map_location, weights_only=True)


def inference_datamodule(module: ViTModule, ckpt_path: str) -> L.LightningDataModule:
    """The DataModule of the checkpoint's stored data config: its predict_tensor() prepares an image
    exactly as the test images were."""
    data = module.hparams.get("data")
    if not data:
        raise UserError(f"checkpoint {ckpt_path!r} stores no data config to preprocess images with")
    return build_datamodule(OmegaConf.create(data))
