"""The optimisation recipe: any optimizer of timm's registry (`optim.name`, AdamW by default) over vitlab's
parameter groups (no decay on norms, biases, LayerScale, position embeddings and tokens; optional layer-wise LR
decay), the learning rate optionally scaled by the batch (`optim.lr_base`, as timm and DeiT), and a per-step
linear warmup + cosine schedule.

`OptimConfig` holds the defaults, the same as conf/optim/adamw.yaml (a test keeps them equal), so a
ViTModule built from Python trains the recipe the command line trains. No Lightning here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitlab.errors import UserError, close_matches
from vitlab.settings import check_at_least, check_range, from_mapping, is_number

log = logging.getLogger(__name__)


LR_BASE_SCALES = ("linear", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # any of timm.optim.list_optimizers() (sgd, momentum, lamb, lars, lion, ...), lookahead_<name>
    lr: float = 1e-3
    lr_base: float | None = None  # set: lr = lr_base * data.batch_size / lr_base_size (timm's train.py, DeiT)
    lr_base_size: int = 256
    lr_base_scale: str = "linear"  # linear | sqrt (of batch / lr_base_size)
    weight_decay: float = 0.05
    momentum: float = 0.9  # the optimizers that have one (sgd, momentum, nesterov, lars, ...)
    betas: tuple[float, ...] | None = None  # null: the optimizer's own (AdamW's: 0.9, 0.999)
    eps: float | None = None  # null: the optimizer's own (AdamW's: 1e-8)
    opt_args: dict[str, Any] = field(default_factory=dict)  # any other argument of the optimizer: {nesterov: true}
    warmup_epochs: float = 5.0  # may be fractional; converted to steps
    warmup_steps: int | None = None  # a step count instead of warmup_epochs
    min_lr_ratio: float = 0.01  # the cosine ends at lr * min_lr_ratio
    layer_decay: float | None = None  # e.g. 0.75: block i's LR scaled by layer_decay ** (depth - i)
    fused: bool | None = True  # one fused kernel for all parameters, where the optimizer has one (torch's)

    def __post_init__(self):
        for key in ("lr", "weight_decay", "momentum", "warmup_epochs"):
            check_at_least(f"optim.{key}", getattr(self, key))
        check_at_least("optim.eps", self.eps, optional=True)
        check_at_least("optim.lr_base", self.lr_base, optional=True)
        check_at_least("optim.lr_base_size", self.lr_base_size, 1)
        check_at_least("optim.warmup_steps", self.warmup_steps, optional=True)
        if self.lr_base_scale not in LR_BASE_SCALES:
            raise UserError(f"optim.lr_base_scale {self.lr_base_scale!r} is not one of {list(LR_BASE_SCALES)}")
        if self.layer_decay is not None:
            check_range("optim.layer_decay", self.layer_decay, 0, 1, low_open=True)
        if self.betas is not None:
            if len(self.betas) not in (2, 3) or not all(is_number(b) and 0 <= b < 1 for b in self.betas):
                raise UserError(f"optim.betas {list(self.betas)} must be two numbers in [0, 1) (three for adan)")
            object.__setattr__(self, "betas", tuple(self.betas))
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        if self.fused not in (True, False, None):
            raise UserError(f"optim.fused {self.fused!r} must be true, false or null")
        optimizer_info(self.name)  # a name timm has

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


def optimizer_info(name: str):
    """timm's facts about optimizer `name` (its class, whether it takes betas, eps, momentum), or a one-line
    error listing the names timm has. `lookahead_<name>` wraps <name> in Lookahead, as timm does."""
    from timm.optim import list_optimizers
    from timm.optim._optim_factory import default_registry

    base = name.lower().removeprefix("lookahead_")
    if base not in list_optimizers():
        close = close_matches(base, list_optimizers())
        raise UserError(
            f"optim.name {name!r} is not an optimizer of timm's"
            + (
                f"; did you mean {close}?"
                if close
                else f" (timm.optim.list_optimizers() lists {len(list_optimizers())})"
            )
        )
    info = default_registry.get_optimizer_info(base)
    if isinstance(info.opt_class, str):  # timm names a class of an optional package: bitsandbytes, apex
        module, _, cls = info.opt_class.rpartition(".")
        try:
            info = dataclasses.replace(info, opt_class=getattr(importlib.import_module(module), cls))
        except ImportError as e:
            raise UserError(
                f"optim.name {name!r} needs a package that is not installed: {info.opt_class} ({e})"
            ) from None
    if info.second_order:  # it needs backward(create_graph=True), which neither our loop nor SDPA's kernels do
        raise UserError(f"optim.name {name!r} is a second-order optimizer; vitlab trains with first-order ones")
    return info


def scaled_lr(o: OptimConfig, batch_size: int) -> float:
    """The learning rate of `o` for a global batch of `batch_size`: lr_base * (batch / lr_base_size), or its
    square root with lr_base_scale=sqrt (timm's train.py); `o.lr` when lr_base is not set."""
    if o.lr_base is None:
        return o.lr
    ratio = batch_size / o.lr_base_size
    return o.lr_base * (math.sqrt(ratio) if o.lr_base_scale == "sqrt" else ratio)


def make_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """Optimizer `o.name`, built by timm's `create_optimizer_v2` over our `param_groups`; betas, eps and fused
    only where the optimizer takes them (betas or eps given to one that does not is refused)."""
    import inspect

    from timm.optim import create_optimizer_v2

    info = optimizer_info(o.name)
    groups = param_groups(model, o.lr, o.weight_decay, o.layer_decay)
    for g in groups:
        g.pop("names")
    kwargs = dict(o.opt_args)
    for key, value, takes in (("betas", o.betas, info.has_betas), ("eps", o.eps, info.has_eps)):
        if value is not None and not takes:
            raise UserError(f"optim.{key} is not a setting of optimizer {o.name!r}; set it to null")
        if value is not None:
            kwargs[key] = value
    if o.fused is not None and "fused" in inspect.signature(info.opt_class).parameters:
        kwargs.setdefault("fused", o.fused)
    try:
        return create_optimizer_v2(groups, o.name, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, **kwargs)
    except TypeError as e:  # an argument of opt_args that the optimizer does not have
        if not o.opt_args:
            raise
        raise UserError(f"optim.opt_args {o.opt_args} do not fit optimizer {o.name!r}: {e}") from e


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
