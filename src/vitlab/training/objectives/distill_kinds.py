"""`objective=distill` and its kinds (objective.kind), each its class: `logits`, DeiT's (distillation.py); `feature` and
`tokens`, timm's and AM-RADIO's (feature_distill.py). `Distill` is the one row of module.OBJECTIVES: built, it is the
kind's objective; asked before it is built (the plan), it answers for the kind its options name. No Lightning or Hydra
here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitlab.model import ViTConfig
from vitlab.training.objectives.distill_heads import FEATURE_KINDS
from vitlab.training.objectives.distillation import Distillation
from vitlab.training.objectives.feature_distill import FeatureDistillation


def _kind(options: Mapping[str, Any] | None) -> type[Distillation]:
    return FeatureDistillation if (options or {}).get("kind", "logits") in FEATURE_KINDS else Distillation


class Distill(Distillation):
    """objective=distill: `Distill(options, model)` is the objective of the kind `options` names."""

    def __new__(cls, options: Mapping[str, Any] | None = None, model: ViTConfig | None = None):
        return _kind(options)(options, model)  # (not a Distill: Python does not call __init__ again)

    @classmethod
    def unlabeled_refusal(cls, options: Mapping[str, Any]) -> str | None:
        if _kind(options) is FeatureDistillation:
            return None
        return (
            "objective.kind=logits (DeiT's) learns from the labels beside the teacher's logits, and data.labels=false "
            "has none: distil features without labels with objective.kind=feature or tokens"
        )

    @classmethod
    def best_of(cls, options: Mapping[str, Any], unlabeled: bool = False) -> tuple[str, str]:
        """Without labels (feature, tokens): the distillation term on the validation images, lowest."""
        return ("loss", "min") if unlabeled and _kind(options) is FeatureDistillation else cls.best
