"""peft='s settings (conf/peft/, training.adapters.PeftConfig) checked before torch is imported: their types and ranges,
and what peft= cannot go with (freeze_backbone, an objective that pretrains without labels)."""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

from annotated_types import Interval
from omegaconf import DictConfig, OmegaConf

from vitlab.utils.arguments import NonEmpty, NonNegativeInt, PositiveInt, PositiveNumber, check_arguments
from vitlab.utils.errors import UserError


class PeftSettings(TypedDict):  # conf/peft/ (training.adapters.PeftConfig)
    method: Literal["none", "lora", "dora", "bitfit", "partial"]
    rank: PositiveInt
    alpha: PositiveNumber
    dropout: Annotated[float, Interval(ge=0, lt=1)]
    use_dora: bool
    use_rslora: bool
    init: bool | str
    targets: NonEmpty[str]
    trainable: list[str]
    blocks: NonNegativeInt
    names: list[str]


def check_peft(cfg: DictConfig) -> None:
    """peft=: its settings' types and ranges, and what it cannot go with, before torch is imported."""
    if cfg.get("peft") is None or cfg.peft.method == "none":
        return
    check_arguments(PeftSettings, OmegaConf.to_container(cfg.peft, resolve=True), "peft")
    if cfg.freeze_backbone:
        raise UserError(
            f"peft={cfg.peft.method} chooses what trains, and freeze_backbone=true too: drop freeze_backbone (a linear "
            "probe is peft=partial peft.blocks=0)"
        )
    if _pretrains(cfg.objective.get("name")):
        raise UserError(
            f"peft={cfg.peft.method} fine-tunes a classifier of pretrained weights; objective={cfg.objective.name} "
            "pretrains the whole encoder without labels, which frozen weights and adapters would not do: drop peft="
        )


def _pretrains(objective: str | None) -> bool:
    """objective=`objective` reads no labels (training.module.OBJECTIVES' `uses_labels`); torch imported only here."""
    from vitlab.training.module import OBJECTIVES

    return objective in OBJECTIVES and not OBJECTIVES[objective].uses_labels
