"""`objective=classify`: the labels' loss, as the supervised ViT recipes train it. MixUp/CutMix (timm's Mixup, as
DeiT's main.py builds it), then softmax cross-entropy with label smoothing (`ce`: class indices or mixed targets, the
same as timm's SoftTargetCrossEntropy) or sigmoid binary cross-entropy (`bce`: timm's BinaryCrossEntropy, as DeiT
III and big_vision train). The metrics read the unmixed labels. conf/objective/classify.yaml.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy

from vitlab.model import ViT, ViTConfig
from vitlab.model.init import log_prior_head_bias_
from vitlab.training.objectives.objective import Objective
from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, check_range, from_mapping

LOSSES = ("ce", "bce")  # softmax cross-entropy, sigmoid binary cross-entropy (evaluation reports cross-entropy)
MIXUP_MODES = ("batch", "pair", "elem")  # timm's: one draw a batch, a pair of images, an image


@dataclass(frozen=True)
class MixupConfig:
    """timm's Mixup (MixUp/CutMix) on each training batch; both alphas 0 = off (`objective.mixup`)."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: tuple[float, float] | None = None  # CutMix box as a fraction of the image, instead of alpha's
    prob: float = 1.0  # chance a batch (pair, image) is mixed
    switch_prob: float = 0.5  # chance of CutMix rather than MixUp when both are on
    mode: str = "batch"  # MIXUP_MODES
    off_epoch: int = 0  # from this epoch on, no mixing (timm's mixup_off_epoch; DeiT III); 0: mix throughout

    def __post_init__(self):
        for key in ("mixup_alpha", "cutmix_alpha"):
            check_at_least(f"objective.mixup.{key}", getattr(self, key))
        for key in ("prob", "switch_prob"):
            check_range(f"objective.mixup.{key}", getattr(self, key), 0, 1)
        if self.mode not in MIXUP_MODES:
            raise UserError(f"objective.mixup.mode {self.mode!r} is not one of {list(MIXUP_MODES)}")
        if self.cutmix_minmax is not None:
            mm = self.cutmix_minmax
            if len(mm) != 2 or not 0 < mm[0] <= mm[1] <= 1:
                raise UserError(
                    f"objective.mixup.cutmix_minmax {list(mm)} must be [min, max] with 0 < min <= max <= 1, or null"
                )
            object.__setattr__(self, "cutmix_minmax", tuple(mm))
        if not isinstance(self.off_epoch, int) or isinstance(self.off_epoch, bool) or self.off_epoch < 0:
            raise UserError(f"objective.mixup.off_epoch {self.off_epoch!r} must be an epoch number >= 0 (0: never off)")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> MixupConfig:
        return from_mapping(cls, values, "objective.mixup")

    def build(self, num_classes: int) -> Mixup | None:
        """timm's Mixup, its targets unsmoothed (the loss smooths them, as it smooths class indices)."""
        if not self.mixup_alpha and not self.cutmix_alpha and self.cutmix_minmax is None:
            return None
        return Mixup(
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            cutmix_minmax=self.cutmix_minmax,
            prob=self.prob,
            switch_prob=self.switch_prob,
            mode=self.mode,
            label_smoothing=0.0,
            num_classes=num_classes,
        )


@dataclass(frozen=True)
class ClassifyConfig:
    """conf/objective/classify.yaml."""

    label_smoothing: float = 0.0
    loss: str = "ce"  # LOSSES
    bce_target_thresh: float | None = None  # bce: targets above it become 1, the rest 0 (DeiT III: 0.2)
    mixup: MixupConfig = field(default_factory=MixupConfig)

    def __post_init__(self):
        check_range("objective.label_smoothing", self.label_smoothing, 0, 1, high_open=True)
        if self.loss not in LOSSES:
            raise UserError(f"objective.loss {self.loss!r} is not one of {list(LOSSES)}")
        if not isinstance(self.mixup, MixupConfig):
            object.__setattr__(self, "mixup", MixupConfig.from_dict(self.mixup))


class Classification(Objective):
    """`objective=classify`: the head's logits against the labels, softmax cross-entropy (with label smoothing, or
    soft targets under MixUp/CutMix) or sigmoid binary cross-entropy (`ClassifyConfig.loss`)."""

    name = "classify"
    config_class = ClassifyConfig
    schedules = frozenset({"sizes", "naflex"})

    def __init__(self, options: Mapping[str, Any], model: ViTConfig):
        if model.num_classes < 2:
            raise UserError(f"model.num_classes {model.num_classes} must be >= 2 to train a classifier")
        self.cfg = from_mapping(self.config_class, options, f"objective={self.name}")
        self.mixup = self.cfg.mixup.build(model.num_classes)
        self.bce = None
        if self.cfg.loss == "bce":
            self.bce = BinaryCrossEntropy(
                smoothing=self.cfg.label_smoothing, target_threshold=self.cfg.bce_target_thresh
            )

    def prepare(self, model: ViT) -> None:
        if self.bce is not None and isinstance(model.head, torch.nn.Linear):
            log_prior_head_bias_(model.head, model.cfg.num_classes)  # sigmoid targets are mostly 0: start improbable

    def training_loss(
        self, model: ViT, x: torch.Tensor, y: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = self.mix(x, y, epoch)
        logits = model(x)
        return self.label_loss(logits, target), logits

    def mix(self, x: torch.Tensor, y: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MixUp/CutMix of the batch until objective.mixup.off_epoch (its draw: numpy's generator, checkpointed
        with the others); the targets, mixed or the labels."""
        off = self.cfg.mixup.off_epoch
        if self.mixup is None or (off and epoch >= off):
            return x, y
        if len(x) % 2:
            raise UserError(
                f"mixup pairs the images of a batch, and this process's batch has {len(x)}: make "
                "data.batch_size / the processes even"
            )
        return self.mixup(x, y)

    def label_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.bce is None:
            return F.cross_entropy(logits, target, label_smoothing=self.cfg.label_smoothing)
        if target.ndim == 2:  # mixed targets, smoothed as timm's Mixup smooths them (its BCE smooths indices only)
            target = target * (1 - self.cfg.label_smoothing) + self.cfg.label_smoothing / logits.shape[-1]
        return self.bce(logits, target)
