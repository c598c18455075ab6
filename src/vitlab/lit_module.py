"""ViTModule: the LightningModule around our ViT. Loss, metrics, optimizer groups, LR schedule.

Its constructor takes plain data only (dicts, lists, numbers), saved as the checkpoint's
hyper-parameters, so `ViTModule.load_from_checkpoint(path)` rebuilds the model without Hydra and
without executing anything from the file (weights_only loading works).
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

from vitlab.callbacks import NonFiniteLossError
from vitlab.errors import MissingFileError, UserError
from vitlab.model import ViT, ViTConfig

log = logging.getLogger(__name__)

DEFAULT_OPTIM = dict(
    lr=1e-3,
    weight_decay=0.05,
    betas=(0.9, 0.999),
    eps=1e-8,
    warmup_epochs=0.0,
    warmup_steps=None,
    min_lr_ratio=0.0,
    layer_decay=None,
    fused=None,
)


def _check_optim(o: dict[str, Any]) -> None:
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key in ("lr", "weight_decay", "eps", "warmup_epochs", "min_lr_ratio"):
        if not number(o[key]) or o[key] < 0:
            raise UserError(f"optim.{key} {o[key]!r} must be a number >= 0")
    for key in ("warmup_steps", "layer_decay"):
        if o[key] is not None and (not number(o[key]) or o[key] < 0):
            raise UserError(f"optim.{key} {o[key]!r} must be a number >= 0 or null")
    if o["layer_decay"] is not None and not 0 < o["layer_decay"] <= 1:
        raise UserError(f"optim.layer_decay {o['layer_decay']} must be in (0, 1]")
    if len(o["betas"]) != 2 or not all(number(b) and 0 <= b < 1 for b in o["betas"]):
        raise UserError(f"optim.betas {list(o['betas'])} must be two numbers in [0, 1)")
    if not 0 <= o["min_lr_ratio"] <= 1:
        raise UserError(f"optim.min_lr_ratio {o['min_lr_ratio']} must be in [0, 1]")


def layer_id(name: str, depth: int) -> int:
    """Depth of a parameter for layer-wise LR decay (BEiT): embeddings 0, block i -> i + 1, the rest
    (final norm, head) depth + 1."""
    if name.startswith(("cls_token", "reg_token", "pos_embed", "patch_embed", "norm_pre")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(model: ViT, lr: float, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """AdamW groups: no weight decay on norms, biases, LayerScale, position embeddings and class/register
    tokens (every 1-D parameter, plus model.no_weight_decay()); with `layer_decay`, block i's LR is
    scaled by layer_decay ** (depth + 1 - (i + 1))."""
    skip, depth = model.no_weight_decay(), len(model.blocks)
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip
        layer = layer_id(name, depth) if layer_decay else depth + 1
        scale = layer_decay ** (depth + 1 - layer) if layer_decay else 1.0
        group = groups.setdefault(
            (layer, no_decay),
            {"params": [], "names": [], "lr": lr * scale, "weight_decay": 0.0 if no_decay else weight_decay},
        )
        group["params"].append(p)
        group["names"].append(name)
    return list(groups.values())


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor: linear warmup over `warmup` steps, then cosine from 1 to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ViTModule(L.LightningModule):
    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any] | None = None,
        label_smoothing: float = 0.0,
        mixup: dict[str, Any] | None = None,
        compile: bool = False,
        class_names: list[str] | None = None,
        data: dict[str, Any] | None = None,  # the data config that trained it, for vitlab.eval/predict
        freeze_backbone: bool = False,  # linear probe: train the head (and fc_norm) only
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = ViT(ViTConfig.from_dict(model))
        if freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(("head.", "fc_norm.")))
        self.optim = {**DEFAULT_OPTIM, **(optim or {})}
        unknown = sorted(set(self.optim) - set(DEFAULT_OPTIM))
        if unknown:
            raise UserError(f"unknown optim key(s) {unknown}; allowed: {sorted(DEFAULT_OPTIM)}")
        _check_optim(self.optim)
        if not 0.0 <= label_smoothing < 1.0:
            raise UserError(f"label_smoothing {label_smoothing} must be in [0, 1)")
        self.label_smoothing = label_smoothing
        self.mixup = self._build_mixup(mixup or {})
        self.compile_model = compile

        k = self.model.cfg.num_classes
        if k < 2:
            raise UserError(f"model.num_classes {k} must be >= 2 to train a classifier")
        # Updated every step, computed (and synced across processes) once per epoch: logging a value
        # costs ~1 ms in Lightning, as much as the forward pass of the digits model.
        acc = functools.partial(MulticlassAccuracy, k, average="micro", validate_args=False)
        # A non-finite training loss stops the run before it is averaged, so its mean skips the NaN check
        # (a device sync per step on a GPU).
        self.train_metrics = nn.ModuleDict({"loss": MeanMetric(nan_strategy="disable"), "acc": acc(top_k=1)})
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": acc(top_k=1), "acc_top5": acc(top_k=min(5, k))})
        self.test_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": acc(top_k=1), "acc_top5": acc(top_k=min(5, k))})
        self.val_acc_best = MaxMetric()
        # Running training metrics and the best accuracy so far are checkpointed, so a run resumed
        # mid-epoch logs the same values as one that was never interrupted.
        for metric in [*self.train_metrics.values(), self.val_acc_best]:
            metric.persistent(True)

    def _build_mixup(self, cfg: dict[str, Any]):
        """torchvision's MixUp/CutMix on the batch; None when both alphas are 0."""
        mixup_alpha, cutmix_alpha = cfg.get("mixup_alpha", 0.0), cfg.get("cutmix_alpha", 0.0)
        self.mixup_prob, switch = cfg.get("prob", 1.0), cfg.get("switch_prob", 0.5)
        if not mixup_alpha and not cutmix_alpha:
            return None
        k = self.hparams.model["num_classes"]
        ops, p = [], []
        if mixup_alpha:
            ops.append(v2.MixUp(alpha=mixup_alpha, num_classes=k))
            p.append(1.0 - switch if cutmix_alpha else 1.0)
        if cutmix_alpha:
            ops.append(v2.CutMix(alpha=cutmix_alpha, num_classes=k))
            p.append(switch if mixup_alpha else 1.0)
        return v2.RandomChoice(ops, p=p)

    # ---- steps -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def setup(self, stage: str) -> None:
        if self.compile_model and stage == "fit":
            self.model.compile()  # in place: state-dict keys stay the same
        dm = self.trainer.datamodule if self.trainer is not None else None
        if dm is not None and hasattr(dm, "per_device_batch_size"):
            # forward + backward ~ 3x forward: lets ThroughputMonitor report FLOP/s
            self.flops_per_batch = 3 * self.model.cfg.flops_per_image() * dm.per_device_batch_size

    def on_fit_start(self) -> None:
        names = getattr(self.trainer.datamodule, "class_names", None)
        if names:  # known once the dataset is read (CIFAR, ImageFolder); saved with the checkpoint
            self.hparams["class_names"] = list(names)

    def _update(self, stage: str, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        m = getattr(self, f"{stage}_metrics")
        m["loss"].update(loss.detach(), weight=len(y))
        for name, metric in m.items():
            if name != "loss":
                metric.update(logits.detach(), y)

    def _log_epoch(self, stage: str) -> dict[str, torch.Tensor]:
        values = {}
        for name, metric in getattr(self, f"{stage}_metrics").items():
            values[f"{stage}/{name}"] = metric.compute()
            metric.reset()
        self.log_dict(values, prog_bar=stage == "val")
        return values

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        target = y
        if self.mixup is not None and torch.rand(()) < self.mixup_prob:
            x, target = self.mixup(x, y)
        logits = self.model(x)
        loss = F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)
        if not torch.isfinite(loss):  # stop before the update, so no checkpoint ever holds NaN weights
            raise NonFiniteLossError(self._non_finite_message(loss))
        self._update("train", loss, logits, y)  # accuracy against the unmixed labels
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:  # the steps Lightning writes logs at
            self.log("train/loss_step", loss.detach(), prog_bar=True)
        return loss

    def _non_finite_message(self, loss: torch.Tensor) -> str:
        saved = [Path(p) for cb in self.trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path)]
        saved = [p for p in saved if str(p) not in ("", ".") and p.is_file()]
        last = max(saved, key=lambda p: p.stat().st_mtime) if saved else None
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved yet"
        return (
            f"training loss became {loss.item()} at step {self.global_step} (epoch {self.current_epoch}); "
            f"stopped before the update; {where}"
        )

    # Global RNG (dropout, stochastic depth, mixup) travels with checkpoints and is put back just before
    # the first batch after a resume, so resumed and uninterrupted runs draw the same numbers.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            checkpoint["rng_states"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rng_to_restore = checkpoint.get("rng_states")
        # Metric states are bookkeeping, not weights: a checkpoint without them (older, or written
        # elsewhere) starts them fresh; the model's own keys stay strictly checked.
        state = checkpoint.get("state_dict", {})
        for key, value in self.state_dict().items():
            if not key.startswith("model.") and key not in state:
                state[key] = value

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        states = getattr(self, "_rng_to_restore", None)
        if states:
            torch.set_rng_state(states["torch"])
            if "cuda" in states and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(states["cuda"])
            self._rng_to_restore = None

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self._update("val", F.cross_entropy(logits, y), logits, y)

    def on_validation_epoch_end(self) -> None:
        values = self._log_epoch("val")
        if not self.trainer.sanity_checking:  # the sanity check's numbers are no result
            self.val_acc_best.update(values["val/acc"])
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self._update("test", F.cross_entropy(logits, y), logits, y)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_step(self, batch, batch_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.model(x).softmax(-1)

    # ---- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = make_optimizer(self.model, self.optim)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        # Counting the steps builds the train loader before a checkpoint's loader position is restored,
        # and fit then never applies that position (Lightning-AI/pytorch-lightning#20550, open): drop the
        # early loader so fit builds it again after the restore. tests/test_reliability.py guards this.
        self.trainer.fit_loop._combined_loader = None
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        if 0 < total // epochs < self.trainer.log_every_n_steps:
            # Epochs shorter than the logging interval would log no step at all (no loss or LR curve for a
            # short run): log once per epoch's worth of steps instead.
            self.trainer.log_every_n_steps = total // epochs
        scheduler = make_scheduler(optimizer, self.optim, total, epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_optimizer(model: ViT, optim: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over `param_groups` with the settings of an `optim` dict (DEFAULT_OPTIM's keys)."""
    o = {**DEFAULT_OPTIM, **optim}
    groups = param_groups(model, o["lr"], o["weight_decay"], o["layer_decay"])
    for g in groups:
        g.pop("names")
    return torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=o["fused"])


def make_scheduler(
    optimizer: torch.optim.Optimizer, optim: dict[str, Any], total_steps: int, epochs: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step warmup + cosine (`warmup_cosine`) over `total_steps`; warmup_epochs convert to steps
    with `epochs` epochs in those steps."""
    o = {**DEFAULT_OPTIM, **optim}
    if o["warmup_steps"] is not None:
        warmup = int(o["warmup_steps"])
    else:
        warmup = round(o["warmup_epochs"] * total_steps / epochs)
    if warmup < 0:
        raise UserError(f"optim warmup {warmup} steps must be >= 0")
    if warmup > total_steps:
        log.warning(
            "warmup of %d steps is longer than the %d training steps; warming up over all of them", warmup, total_steps
        )
        warmup = total_steps
    schedule = functools.partial(warmup_cosine, warmup=warmup, total=total_steps, min_ratio=o["min_lr_ratio"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def batch_size(batch) -> int:
    """Images in a (images, labels) batch: for Lightning's ThroughputMonitor."""
    return len(batch[1])


def read_checkpoint(path: str) -> dict[str, Any]:
    """A vitlab training checkpoint as plain data, read with weights_only=True: a file that would run
    code when unpickled is refused, never executed; a file cut short is called corrupt."""
    if Path(path).is_dir():
        raise MissingFileError(f"ckpt_path {str(path)!r} is a directory; give a checkpoint file (.ckpt) in it")
    if not Path(path).is_file():
        raise MissingFileError(f"ckpt_path {str(path)!r} does not exist")
    try:
        ckpt = _load_weights_only(path)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"ckpt_path {str(path)!r} cannot be read safely as a training checkpoint (only tensors "
            f"and plain data are allowed; nothing in it was run): {type(e).__name__}"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(
            f"ckpt_path {str(path)!r} is corrupt or incomplete (cut short while copying or saving?): "
            f"{str(e).splitlines()[0].split('. ')[0]}"
        ) from e
    if (
        not isinstance(ckpt, dict)
        or "state_dict" not in ckpt
        or not isinstance((ckpt.get("hyper_parameters") or {}).get("model"), dict)
    ):
        raise UserError(f"ckpt_path {str(path)!r} is not a vitlab training checkpoint (it holds no model config)")
    return ckpt


def _load_weights_only(path: str) -> Any:
    """torch.load(weights_only=True), memory-mapped when the file is a zip checkpoint (every file torch
    has written since 1.6); older pickle files are read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(path: str, map_location: str = "cpu") -> ViTModule:
    """A ViTModule from a training checkpoint, rebuilt from the config stored in it (no Hydra)."""
    read_checkpoint(path)
    return ViTModule.load_from_checkpoint(path, map_location=map_location, weights_only=True)
