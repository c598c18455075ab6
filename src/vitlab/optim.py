"""The optimisation recipe: AdamW parameter groups (no decay on norms, biases, LayerScale, position
embeddings and tokens; optional layer-wise LR decay) and a per-step linear warmup + cosine schedule.

`OptimConfig` holds the defaults, the same as conf/optim/adamw.yaml (a test keeps them equal), so a
ViTModule built from Python trains the recipe the command line trains. No Lightning here.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vitlab.errors import UserError
from vitlab.settings import check_at_least, check_range, from_mapping, is_number

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_epochs: float = 5.0  # may be fractional; converted to steps
    warmup_steps: int | None = None  # a step count instead of warmup_epochs
    min_lr_ratio: float = 0.01  # the cosine ends at lr * min_lr_ratio
    layer_decay: float | None = None  # e.g. 0.75: block i's LR scaled by layer_decay ** (depth - i)
    fused: bool | None = True  # one fused kernel for all parameters (CPU and CUDA)

    def __post_init__(self):
        for key in ("lr", "weight_decay", "eps", "warmup_epochs"):
            check_at_least(f"optim.{key}", getattr(self, key))
        check_at_least("optim.warmup_steps", self.warmup_steps, optional=True)
        if self.layer_decay is not None:
            check_range("optim.layer_decay", self.layer_decay, 0, 1, low_open=True)
        if len(self.betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in self.betas):
            raise UserError(f"optim.betas {list(self.betas)} must be two numbers in [0, 1)")
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        if self.fused not in (True, False, None):
            raise UserError(f"optim.fused {self.fused!r} must be true, false or null")
        object.__setattr__(self, "betas", tuple(self.betas))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> OptimConfig:
        return from_mapping(cls, values, "optim")


def layer_id(name: str, depth: int) -> int:
    """Depth of a parameter for layer-wise LR decay (BEiT): embeddings 0, block i -> i + 1, the rest
    (final norm, head) depth + 1."""
    if name.startswith(("cls_token", "reg_token", "pos_embed", "patch_embed", "norm_pre")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(model: nn.Module, lr: float, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
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


def make_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups` with the settings of `o`."""
    groups = param_groups(model, o.lr, o.weight_decay, o.layer_decay)
    for g in groups:
        g.pop("names")
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)


def make_scheduler(
    optimizer: torch.optim.Optimizer, o: OptimConfig, total_steps: int, epochs: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step warmup + cosine (`warmup_cosine`) over `total_steps`; warmup_epochs convert to steps
    with `epochs` epochs in those steps."""
    warmup = int(o.warmup_steps) if o.warmup_steps is not None else round(o.warmup_epochs * total_steps / epochs)
    if warmup > total_steps:
        log.warning(
            "warmup of %d steps is longer than the %d training steps; warming up over all of them "
            "(set optim.warmup_epochs or optim.warmup_steps lower)",
            warmup,
            total_steps,
        )
        warmup = total_steps
    schedule = functools.partial(warmup_cosine, warmup=warmup, total=total_steps, min_ratio=o.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
