"""What `objective=classify` adds for labels as real data has them: several labels an image (`objective.multilabel`:
sigmoid binary cross-entropy per class, or timm's AsymmetricLossMultiLabel, `objective.loss=asl`, Ridnik et al. 2021)
and long-tailed classes: class weights from the training split's counts (`objective.class_weights`: inverse
frequency, or Cui et al. 2019's effective number with `class_weights_beta`, both timm's compute_class_weights, mean 1;
or one weight a class) and Menon et al. 2021's logit-adjusted loss (`objective.logit_adjust`: tau; the training loss
adds tau * log(prior) to the logits, evaluation reads them as they are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.loss import AsymmetricLossMultiLabel, BinaryCrossEntropy, compute_class_weights

from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, check_range, from_mapping

CLASS_WEIGHTS = {"inverse": "inv_freq", "effective_number": "effective_num"}  # ours -> timm's method


@dataclass(frozen=True)
class AslConfig:
    """timm's AsymmetricLossMultiLabel's focusing and clipping (`objective.asl`; the paper's defaults)."""

    gamma_neg: float = 4.0
    gamma_pos: float = 1.0
    clip: float = 0.05  # the probability margin shifted onto negatives; 0: none

    def __post_init__(self):
        for key in ("gamma_neg", "gamma_pos"):
            check_at_least(f"objective.asl.{key}", getattr(self, key))
        check_range("objective.asl.clip", self.clip, 0, 1, high_open=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> AslConfig:
        return from_mapping(cls, values, "objective.asl")


def check_long_tail(cfg: Any) -> None:
    """The options of several labels and long tails, each refused in one line (ClassifyConfig's __post_init__)."""
    check_range("objective.threshold", cfg.threshold, 0, 1, low_open=True, high_open=True)
    weights = cfg.class_weights
    if isinstance(weights, str) and weights not in CLASS_WEIGHTS:
        raise UserError(
            f"objective.class_weights {weights!r} is not one of {list(CLASS_WEIGHTS)}, a list of one weight a class, "
            "or null"
        )
    if isinstance(weights, (list, tuple)) and not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
    ):
        raise UserError(f"objective.class_weights {list(weights)} must be numbers >= 0, one a class")
    check_range("objective.class_weights_beta", cfg.class_weights_beta, 0, 1, low_open=True, high_open=True)
    check_at_least("objective.logit_adjust", cfg.logit_adjust)
    if cfg.loss == "asl" and not cfg.multilabel:
        raise UserError("objective.loss=asl is timm's multi-label asymmetric loss: set objective.multilabel=true")
    if cfg.logit_adjust and (cfg.multilabel or cfg.loss != "ce"):
        raise UserError(
            f"objective.logit_adjust {cfg.logit_adjust} adjusts the softmax of one label an image (Menon et al. "
            f"2021): it needs objective.loss=ce without objective.multilabel (loss here: {cfg.loss}, multilabel: "
            f"{cfg.multilabel})"
        )


def class_weights(cfg: Any, counts: Sequence[int], num_images: int) -> torch.Tensor | None:
    """The loss's weight of each class, from the training split's class counts (`counts`, over `num_images`)."""
    given = cfg.class_weights
    if given is None:
        return None
    if isinstance(given, (list, tuple)):
        if len(given) != len(counts):
            raise UserError(
                f"objective.class_weights has {len(given)} weights and the data {len(counts)} classes: give one a class"
            )
        return torch.tensor(given, dtype=torch.float32)
    return compute_class_weights(counts, num_images, method=CLASS_WEIGHTS[given], beta=cfg.class_weights_beta)[1]


def train_counts(datamodule: Any) -> tuple[list[int], int]:
    """(images of each class, images) of the training split (what trains: a held-out slice or fold left out), from
    its images' labels (folds.labels_of: no image decoded)."""
    from vitlab.data.folds import labels_of

    names = list(getattr(datamodule, "class_names", None) or [])
    train = datamodule.train_set
    labels = torch.as_tensor(labels_of(getattr(train, "base", train)))
    if (indices := getattr(train, "indices", None)) is not None:
        labels = labels[torch.as_tensor(indices, dtype=torch.long)]
    num_classes = datamodule.num_classes or len(names)
    if labels.ndim == 2:
        return labels.sum(0).tolist(), len(labels)
    return torch.bincount(labels, minlength=num_classes).tolist(), len(labels)


def log_prior(counts: Sequence[int]) -> torch.Tensor:
    """log of each class's share of the training images (an empty class counts one, as timm's weights count it)."""
    counts = torch.as_tensor(counts, dtype=torch.float32).clamp(min=1)
    return (counts / counts.sum()).log()


class LabelLoss:
    """The training loss of `objective=classify` (classification.py's `label_loss` calls it): ce (softmax, label
    smoothing, class weights, logit adjustment), bce (timm's BinaryCrossEntropy), asl (timm's, several labels)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.weight: torch.Tensor | None = None  # (classes,): set from the data (fit)
        self.adjust: torch.Tensor | None = None  # (classes,): tau * log(prior), set from the data (fit)
        self.sigmoid = self._sigmoid_loss()

    def fit(self, counts: Sequence[int], num_images: int, device: torch.device) -> None:
        """The weights and priors of the training split's class counts."""
        weight = class_weights(self.cfg, counts, num_images)
        self.weight = None if weight is None else weight.to(device)
        if self.cfg.logit_adjust:
            self.adjust = (self.cfg.logit_adjust * log_prior(counts)).to(device)
        self.sigmoid = self._sigmoid_loss()

    def _sigmoid_loss(self) -> torch.nn.Module | None:
        cfg = self.cfg
        if cfg.multilabel and cfg.loss == "asl":
            return AsymmetricLossMultiLabel(**vars(cfg.asl), weight=self.weight)
        if cfg.multilabel or cfg.loss == "bce":  # (multi-hot targets: smoothed in __call__, as timm's mixup smooths)
            smoothing = 0.0 if cfg.multilabel else cfg.label_smoothing
            return BinaryCrossEntropy(smoothing=smoothing, target_threshold=cfg.bce_target_thresh, weight=self.weight)
        return None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        smoothing = self.cfg.label_smoothing
        if self.cfg.multilabel:  # target (B, C): 0/1, or mixed; smoothed towards 0.5 as timm's multi-label mixup_target
            return self.sigmoid(logits, target.float() * (1 - smoothing) + 0.5 * smoothing)
        if self.sigmoid is not None:  # bce
            if target.ndim == 2:  # mixed targets, smoothed as timm's Mixup smooths them (its BCE smooths indices only)
                target = target * (1 - smoothing) + smoothing / logits.shape[-1]
            return self.sigmoid(logits, target)
        if self.adjust is not None:  # Menon et al. 2021, eq. 10: the softmax of logits + tau * log(prior)
            logits = logits + self.adjust
        return F.cross_entropy(logits, target, weight=self.weight, label_smoothing=smoothing)


def evaluation_loss(multilabel: bool, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Validation's and test's loss, unweighted: cross-entropy, or (several labels) binary cross-entropy."""
    if multilabel:
        return F.binary_cross_entropy_with_logits(logits.float(), y.float())
    return F.cross_entropy(logits, y)
