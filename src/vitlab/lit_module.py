"""ViTModule: the LightningModule around our ViT. Loss, metrics, optimizer groups, LR schedule.

Its constructor takes plain data only (dicts, lists, numbers), saved as the checkpoint's
hyper-parameters, so `ViTModule.load_from_checkpoint(path)` rebuilds the model without Hydra and
without executing anything from the file (weights_only loading works).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

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
            raise ValueError(f"optim.{key} {o[key]!r} must be a number >= 0")
    for key in ("warmup_steps", "layer_decay"):
        if o[key] is not None and (not number(o[key]) or o[key] < 0):
            raise ValueError(f"optim.{key} {o[key]!r} must be a number >= 0 or null")
    if o["layer_decay"] is not None and not 0 < o["layer_decay"] <= 1:
        raise ValueError(f"optim.layer_decay {o['layer_decay']} must be in (0, 1]")
    if len(o["betas"]) != 2 or not all(number(b) and 0 <= b < 1 for b in o["betas"]):
        raise ValueError(f"optim.betas {list(o['betas'])} must be two numbers in [0, 1)")
    if not 0 <= o["min_lr_ratio"] <= 1:
        raise ValueError(f"optim.min_lr_ratio {o['min_lr_ratio']} must be in [0, 1]")


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
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = ViT(ViTConfig.from_dict(model))
        self.optim = {**DEFAULT_OPTIM, **(optim or {})}
        unknown = sorted(set(self.optim) - set(DEFAULT_OPTIM))
        if unknown:
            raise ValueError(f"unknown optim key(s) {unknown}; allowed: {sorted(DEFAULT_OPTIM)}")
        _check_optim(self.optim)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing {label_smoothing} must be in [0, 1)")
        self.label_smoothing = label_smoothing
        self.mixup = self._build_mixup(mixup or {})
        self.compile_model = compile

        k = self.model.cfg.num_classes
        if k < 2:
            raise ValueError(f"model.num_classes {k} must be >= 2 to train a classifier")
        acc = functools.partial(MulticlassAccuracy, k, average="micro")  # plain accuracy, not per-class mean
        self.train_acc, self.val_acc, self.test_acc = acc(top_k=1), acc(top_k=1), acc(top_k=1)
        self.val_acc5, self.test_acc5 = acc(top_k=min(5, k)), acc(top_k=min(5, k))
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

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

    def on_train_start(self) -> None:
        self.val_acc_best.reset()  # forget the sanity check's validation

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        target = y
        if self.mixup is not None and torch.rand(()) < self.mixup_prob:
            x, target = self.mixup(x, y)
        logits = self.model(x)
        loss = F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)
        self.train_loss(loss.detach(), weight=len(y))
        self.train_acc(logits.detach(), y)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def _eval_step(self, batch, loss_metric, acc, acc5, stage: str) -> None:
        x, y = batch
        logits = self.model(x)
        loss_metric(F.cross_entropy(logits, y), weight=len(y))
        acc(logits, y)
        acc5(logits, y)
        self.log(f"{stage}/loss", loss_metric, on_epoch=True, prog_bar=stage == "val")
        self.log(f"{stage}/acc", acc, on_epoch=True, prog_bar=stage == "val")
        self.log(f"{stage}/acc_top5", acc5, on_epoch=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_loss, self.val_acc, self.val_acc5, "val")

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_loss, self.test_acc, self.test_acc5, "test")

    def predict_step(self, batch, batch_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.model(x).softmax(-1)

    # ---- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.optim
        groups = param_groups(self.model, o["lr"], o["weight_decay"], o["layer_decay"])
        for g in groups:
            g.pop("names")
        optimizer = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=o["fused"])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        if o["warmup_steps"] is not None:
            warmup = int(o["warmup_steps"])
        else:
            epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
            warmup = round(o["warmup_epochs"] * total / epochs)
        if warmup < 0:
            raise ValueError(f"optim warmup {warmup} steps must be >= 0")
        if warmup > total:
            log.warning(
                "warmup of %d steps is longer than the %d training steps; warming up over all of them", warmup, total
            )
            warmup = total
        schedule = functools.partial(warmup_cosine, warmup=warmup, total=total, min_ratio=o["min_lr_ratio"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def batch_size(batch) -> int:
    """Images in a (images, labels) batch: for Lightning's ThroughputMonitor."""
    return len(batch[1])


def load_checkpoint(path: str, map_location: str = "cpu") -> ViTModule:
    """A ViTModule from a Lightning checkpoint, read with weights_only=True (nothing in the file runs);
    the model is rebuilt from the config stored in it."""
    from pathlib import Path

    if not Path(path).is_file():
        raise FileNotFoundError(f"ckpt_path {str(path)!r} does not exist")
    try:
        return ViTModule.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if isinstance(e, (ValueError, FileNotFoundError)):
            raise
        raise ValueError(
            f"ckpt_path {str(path)!r} is not a vitlab training checkpoint that can be read safely: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
