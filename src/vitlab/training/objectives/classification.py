"""`objective=classify`: the labels' loss, as the supervised ViT recipes train it. MixUp/CutMix (timm's Mixup, as
DeiT's main.py builds it), then softmax cross-entropy with label smoothing (`ce`: class indices or mixed targets, the
same as timm's SoftTargetCrossEntropy) or sigmoid binary cross-entropy (`bce`: timm's BinaryCrossEntropy, as DeiT
III and big_vision train). The metrics read the unmixed labels. Several labels an image (`multilabel`), class
weights and logit adjustment for long tails: label_losses.py; their metrics: label_metrics.py.
conf/objective/classify.yaml.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from timm.data import Mixup

from vitlab.model import ViT, ViTConfig
from vitlab.model.draws import rows_for
from vitlab.model.init import log_prior_head_bias_
from vitlab.training.objectives import label_losses, label_metrics
from vitlab.training.objectives.objective import Objective
from vitlab.utils.errors import UserError
from vitlab.utils.seeds import mix
from vitlab.utils.values import check_at_least, check_range, from_mapping

# softmax cross-entropy, sigmoid binary cross-entropy (evaluation reports cross-entropy), timm's asymmetric loss
# (several labels an image; with objective.multilabel, ce and bce both mean a sigmoid binary cross-entropy a class)
LOSSES = ("ce", "bce", "asl")
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

    def build(self, num_classes: int, multi_label: bool = False) -> Mixup | None:
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
            multi_label=multi_label,  # multi-hot targets mixed as they are (timm's mixup_target)
        )


@dataclass(frozen=True)
class ClassifyConfig:
    """conf/objective/classify.yaml."""

    label_smoothing: float = 0.0
    loss: str = "ce"  # LOSSES
    bce_target_thresh: float | None = None  # bce: targets above it become 1, the rest 0 (DeiT III: 0.2)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    multilabel: bool = False  # several labels an image: a sigmoid a class, mAP chooses the checkpoint
    threshold: float = 0.5  # multilabel: a label is predicted above this probability (F1, vitlab.predict)
    asl: label_losses.AslConfig = field(default_factory=label_losses.AslConfig)  # loss=asl's settings
    class_weights: str | list[float] | None = None  # inverse | effective_number | one weight a class | null
    class_weights_beta: float = 0.999  # effective_number's beta (Cui et al. 2019)
    logit_adjust: float = 0.0  # tau of Menon et al. 2021's logit-adjusted loss (1.0 in the paper); 0: off

    def __post_init__(self):
        check_range("objective.label_smoothing", self.label_smoothing, 0, 1, high_open=True)
        if self.loss not in LOSSES:
            raise UserError(f"objective.loss {self.loss!r} is not one of {list(LOSSES)}")
        if not isinstance(self.mixup, MixupConfig):
            object.__setattr__(self, "mixup", MixupConfig.from_dict(self.mixup))
        if not isinstance(self.asl, label_losses.AslConfig):
            object.__setattr__(self, "asl", label_losses.AslConfig.from_dict(self.asl))
        if not isinstance(self.multilabel, bool):
            raise UserError(f"objective.multilabel {self.multilabel!r} must be true or false")
        label_losses.check_long_tail(self)


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
        self.mixup = self.cfg.mixup.build(model.num_classes, multi_label=self.cfg.multilabel)
        # MixUp/CutMix pair images within these parts of the global batch: the shares of the processes the run
        # started on (the checkpoint keeps it: training/devices/rank_state.py), so on any count that divides it the
        # pairs and draws are the same
        self.mix_groups: int | None = None
        self.loss = label_losses.LabelLoss(self.cfg)
        self.best = self.best_of(options)

    @classmethod
    def best_of(cls, options: Mapping[str, Any], unlabeled: bool = False) -> tuple[str, str]:
        return ("map", "max") if options.get("multilabel") else cls.best

    def metrics(self, stage: str, num_classes: int) -> dict[str, Any]:
        if self.cfg.multilabel:
            return label_metrics.multilabel_metrics(stage, num_classes, self.cfg.threshold)
        return super().metrics(stage, num_classes) | label_metrics.long_tail_metrics(stage, num_classes)

    def fit_start(self, datamodule: Any, device: torch.device) -> None:
        """Refuse data of one label an image under multilabel; the class weights and priors of the training split;
        MixUp's groups (the processes this run starts on, unless it resumes)."""
        trainer = getattr(datamodule, "trainer", None)
        if self.mix_groups is None:
            self.mix_groups = trainer.world_size if trainer is not None else 1
        if self.cfg.multilabel and not getattr(datamodule, "multilabel", False):
            raise UserError(
                f"objective.multilabel=true needs several labels an image, and {type(datamodule).__name__} reads one "
                "(an image folder cannot say more): give the labels in a list (data=list) or a dataset (data=hf)"
            )
        if self.cfg.class_weights is not None or self.cfg.logit_adjust:
            counts, images = label_losses.train_counts(datamodule)
            self.loss.fit(counts, images, device)

    def prepare(self, model: ViT) -> None:
        if self.loss.sigmoid is not None and isinstance(model.head, torch.nn.Linear):
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
        rows = rows_for(len(x))  # the global batch's rows (a global order), or None
        size = rows.total // self.mix_groups if rows is not None and self.mix_groups else 0
        if not size or rows.total % self.mix_groups or rows.start % size or len(x) % size or size % 2:
            return self.mixup(x, y)  # within this process's batch, from numpy's generator (timm's, DeiT's)
        mixed = [
            self._mixed(x[i : i + size], y[i : i + size], share_seed(rows.seed, (rows.start + i) // size))
            for i in range(0, len(x), size)
        ]
        return torch.cat([m[0] for m in mixed]), torch.cat([m[1] for m in mixed])

    def _mixed(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """timm's Mixup on one group of the global batch, its draws (numpy's generator) seeded by the group's `seed`
        and numpy's state put back after."""
        state = numpy.random.get_state()
        numpy.random.seed(seed)
        try:
            return self.mixup(x, y)
        finally:
            numpy.random.set_state(state)

    def per_process(self, processes: int) -> str | None:
        groups = self.mix_groups
        if self.mixup is not None and groups and groups % processes:
            return f"MixUp/CutMix pair images within the shares of the {groups} processes the run started on"
        return None

    def label_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, target)

    def evaluation_loss(self, model: ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x)
        return label_losses.evaluation_loss(self.cfg.multilabel, logits, y), logits


def share_seed(step_seed: int, share: int) -> int:
    """numpy's seed for MixUp's draws on share `share` of a training step's global batch (Classification.mix)."""
    return mix(step_seed, 3, share) % 2**32
