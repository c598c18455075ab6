"""The optimisation recipe: any optimizer of timm's registry (`optim.name`, AdamW by default) over vitlab's
parameter groups (no decay on norms, biases, LayerScale, position embeddings and tokens, or MAE's pretraining rule
with `decay_tokens`; optional layer-wise LR decay), the learning rate optionally scaled by the global batch
(`optim.lr_base`, as timm, DeiT and MAE), and its schedule: vitlab's per-step linear warmup + cosine, MAE's
`util/lr_sched.py` (`mae_cosine`, big_vision's warmup + cosine too), or any of timm's schedulers (`scheduler.name`).

`OptimConfig` and `SchedulerConfig` hold the defaults, the same as conf/optim/adamw.yaml and
conf/scheduler/warmup_cosine.yaml (a test keeps them equal), so a
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
from typing import TYPE_CHECKING, Any

from vitlab.utils.errors import UserError, close_matches
from vitlab.utils.values import check_at_least, check_range, from_mapping, is_number

if TYPE_CHECKING:  # torch is imported where an optimizer is made: the configs are checked before it (issue 53)
    import torch
    from torch import nn

log = logging.getLogger(__name__)


LR_BASE_SCALES = ("linear", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer (conf/optim/): timm's by name over vitlab's parameter groups, its learning-rate scaling."""

    name: str = "adamw"  # any of timm.optim.list_optimizers() (sgd, momentum, lamb, lars, lion, ...), lookahead_<name>
    lr: float = 1e-3
    lr_base: float | None = None  # set: lr = lr_base * global batch / lr_base_size (timm's train.py, DeiT, MAE)
    lr_base_size: int = 256
    lr_base_scale: str = "linear"  # linear | sqrt (of batch / lr_base_size)
    # The batch lr_base scales by; null: the run's global batch, data.batch_size x trainer.accumulate_grad_batches
    # (MAE's eff_batch_size = batch x accum_iter x world size), written into config.yaml when lr_base is set.
    global_batch: int | None = None
    weight_decay: float = 0.05
    # true: decay the class/register/mask tokens and a learned pos_embed too, every weight but the 1-D ones (MAE's
    # pretraining: timm 0.3.2's add_weight_decay without a skip list); false: none on them (timm, DeiT, MAE fine-tune)
    decay_tokens: bool = False
    momentum: float = 0.9  # the optimizers that have one (sgd, momentum, nesterov, lars, ...)
    betas: tuple[float, ...] | None = None  # null: the optimizer's own (AdamW's: 0.9, 0.999)
    eps: float | None = None  # null: the optimizer's own (AdamW's: 1e-8)
    opt_args: dict[str, Any] = field(default_factory=dict)  # any other argument of the optimizer: {nesterov: true}
    layer_decay: float | None = None  # e.g. 0.75: block i's LR scaled by layer_decay ** (depth - i)
    patch_embed_lr_mult: float = 1.0  # the patch embedding's LR scaled by this too (DINOv2's optim.patch_embed_lr_mult)
    fused: bool | None = True  # one fused kernel for all parameters, where the optimizer has one (torch's)

    def __post_init__(self):
        self.check_values()
        optimizer_info(self.name)  # a name timm has (timm's import: seconds)

    def check_values(self) -> None:
        """Every value but the optimizer's name, which needs timm."""
        for key in ("lr", "weight_decay", "momentum"):
            check_at_least(f"optim.{key}", getattr(self, key))
        check_at_least("optim.eps", self.eps, optional=True)
        check_at_least("optim.lr_base", self.lr_base, optional=True)
        check_at_least("optim.lr_base_size", self.lr_base_size, 1)
        check_at_least("optim.global_batch", self.global_batch, 1, optional=True)
        if self.lr_base_scale not in LR_BASE_SCALES:
            raise UserError(f"optim.lr_base_scale {self.lr_base_scale!r} is not one of {list(LR_BASE_SCALES)}")
        if self.layer_decay is not None:
            check_range("optim.layer_decay", self.layer_decay, 0, 1, low_open=True)
        check_range("optim.patch_embed_lr_mult", self.patch_embed_lr_mult, 0, 1, low_open=True)
        if self.betas is not None:
            if len(self.betas) not in (2, 3) or not all(is_number(b) and 0 <= b < 1 for b in self.betas):
                raise UserError(f"optim.betas {list(self.betas)} must be two numbers in [0, 1) (three for adan)")
            object.__setattr__(self, "betas", tuple(self.betas))
        if self.fused not in (True, False, None):
            raise UserError(f"optim.fused {self.fused!r} must be true, false or null")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> OptimConfig:
        return from_mapping(cls, values, "optim")

    @staticmethod
    def check_early(values: Mapping[str, Any]) -> None:
        """`values`' keys and every value but the name, before timm (and torch) are imported: a refusal at once."""
        _OptimValues.from_dict(values)


@dataclass(frozen=True)
class _OptimValues(OptimConfig):
    """OptimConfig checked without its name (OptimConfig.check_early)."""

    def __post_init__(self):
        self.check_values()


def layer_id(name: str, depth: int) -> int:
    """Depth of a parameter for layer-wise LR decay (BEiT): embeddings 0 (the tokens, iBOT's mask token among them,
    as dinov2's get_vit_lr_decay_rate), block i -> i + 1, the rest (final norm, head) depth + 1."""
    if name.startswith(("cls_token", "reg_token", "dist_token", "mask_token", "pos_embed", "patch_embed", "norm_pre")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    layer_decay: float | None = None,
    decay_tokens: bool = False,
    patch_embed_lr_mult: float = 1.0,
) -> list[dict]:
    """AdamW groups: no weight decay on norms, biases, LayerScale, position embeddings and class/register
    tokens (every 1-D parameter, plus model.no_weight_decay()), or with `decay_tokens` on every parameter but the
    1-D ones (MAE's pretraining); with `layer_decay`, block i's LR is scaled by layer_decay ** (depth + 1 - (i + 1));
    the patch embedding's also by `patch_embed_lr_mult` (DINOv2)."""
    skip, depth = set() if decay_tokens else model.no_weight_decay(), len(model.blocks)
    groups: dict[tuple[int, bool, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip
        layer = layer_id(name, depth) if layer_decay else depth + 1
        scale = layer_decay ** (depth + 1 - layer) if layer_decay else 1.0
        patch = name.startswith("patch_embed.") and patch_embed_lr_mult != 1.0
        scale *= patch_embed_lr_mult if patch else 1.0
        group = groups.setdefault(
            (layer, no_decay, patch),
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


def mae_cosine(step: int, warmup: float, total: int, min_ratio: float) -> float:
    """LR factor of MAE's util/lr_sched.py at update `step` (its fractional epoch is step / steps per epoch): lr * t / W
    during the warmup (0 at step 0), then min_lr + (lr - min_lr) * (1 + cos(pi (t - W) / (T - W))) / 2 to the run's
    end. Each group's LR is this factor times its own (MAE's lr_scale: layer decay scales min_lr too). With min_lr 0
    it is big_vision's create_learning_rate_schedule(warmup_steps, decay_type='cosine') as well."""
    if step < warmup:
        return step / warmup
    progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def dino_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor of DINO's (and DINOv2's) utils.cosine_scheduler(lr, min_lr, epochs, niter, warmup_epochs)[step]:
    np.linspace(0, lr, warmup) (step 0 at 0, the warmup's last step at lr), then min_lr + (lr - min_lr) (1 + cos(pi i /
    (total - warmup))) / 2 for i = 0 .. total - warmup - 1 (training.objectives.dino_losses.cosine_schedule)."""
    from vitlab.training.objectives.dino_losses import cosine_schedule

    return cosine_schedule(step, 1.0, min_ratio, total, int(warmup))


# vitlab's own schedules (per-step LambdaLRs), then timm's (timm.scheduler.create_scheduler_v2).
LAMBDA_SCHEDULES = {"warmup_cosine": warmup_cosine, "mae_cosine": mae_cosine, "dino_cosine": dino_cosine}
SCHEDULERS = ("warmup_cosine", "mae_cosine", "dino_cosine", "cosine", "tanh", "step", "multistep", "plateau", "poly")
PLATEAU_MODES = {"max": "val/acc", "min": "val/loss"}  # what a plateau schedule watches


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning rate over training. `warmup_cosine` (the default) is vitlab's: per step, linear warmup to lr,
    then cosine to lr * min_lr_ratio. `mae_cosine` is MAE's util/lr_sched.py, per step: warmup from 0, then a
    half-cycle cosine to min_lr over the rest of the run. The others are timm's schedulers as timm's train.py
    builds them: warmup from warmup_lr, min_lr, cooldown, cycles, decay, stepped per step or per epoch
    (step_on_epochs); after epoch e they step to e + epoch_offset."""

    name: str = "warmup_cosine"
    warmup_epochs: float = 5.0  # may be fractional
    warmup_steps: int | None = None  # a step count instead of warmup_epochs
    min_lr_ratio: float = 0.01  # warmup_cosine: it ends at lr * min_lr_ratio
    min_lr: float = 0.0  # the LR it decays to (mae_cosine, cosine, tanh, poly) or never goes below (step, plateau)
    # timm's schedulers only
    warmup_lr: float = 1e-5  # the LR warmup starts from (timm's train.py default)
    # true: the decay starts after the warmup and ends with the run (timm's default: both start at 0)
    warmup_prefix: bool = False
    step_on_epochs: bool = False  # change the LR once per epoch (timm's train.py, DeiT) rather than every step
    # after epoch e the scheduler steps to e + epoch_offset: 1 as timm's train.py; 0 as DeiT's main.py
    # (lr_scheduler.step(epoch)), whose every epoch runs at the LR timm's would give the epoch before
    epoch_offset: int = 1
    cooldown_epochs: int = 0  # the last epochs at min_lr (the decay ends that much earlier)
    decay_epochs: float = 90.0  # step: decay every this many epochs
    decay_milestones: tuple[int, ...] = (90, 180, 270)  # multistep: decay at these epochs
    decay_rate: float = 0.1  # step, multistep, plateau: the factor of each decay; poly: its power
    patience_epochs: int = 10  # plateau: epochs without improvement before a decay
    plateau_mode: str = "max"  # plateau: watch val/acc (max) or val/loss (min)
    cycle_mul: float = 1.0
    cycle_decay: float = 0.1
    cycle_limit: int = 1
    k_decay: float = 1.0

    def __post_init__(self):
        if self.name not in SCHEDULERS:
            raise UserError(f"scheduler.name {self.name!r} is not one of {list(SCHEDULERS)}")
        if self.plateau_mode not in PLATEAU_MODES:
            raise UserError(f"scheduler.plateau_mode {self.plateau_mode!r} is not one of {list(PLATEAU_MODES)}")
        for key in ("warmup_epochs", "warmup_lr", "min_lr", "cooldown_epochs", "decay_epochs", "patience_epochs"):
            check_at_least(f"scheduler.{key}", getattr(self, key))
        check_at_least("scheduler.warmup_steps", self.warmup_steps, optional=True)
        if self.epoch_offset not in (0, 1):
            raise UserError(f"scheduler.epoch_offset {self.epoch_offset!r} must be 1 (timm's train.py) or 0 (DeiT's)")
        if self.name == "plateau" and not self.step_on_epochs:
            raise UserError("scheduler.name=plateau changes the LR once per epoch: set scheduler.step_on_epochs=true")
        check_range("scheduler.min_lr_ratio", self.min_lr_ratio, 0, 1)
        object.__setattr__(self, "decay_milestones", tuple(self.decay_milestones))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SchedulerConfig:
        return from_mapping(cls, values, "scheduler")


def recipe(optim: Mapping[str, Any] | None, scheduler: Mapping[str, Any] | None) -> tuple[OptimConfig, SchedulerConfig]:
    """A module's optimiser and schedule settings (plain data: a run's plan, a checkpoint's hyper-parameters) as typed
    settings, each unknown key refused in one line, omitted keys at conf/optim/adamw.yaml's and
    conf/scheduler/warmup_cosine.yaml's defaults."""
    return from_mapping(OptimConfig, optim, "optim"), from_mapping(SchedulerConfig, scheduler, "scheduler")


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


def make_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """Optimizer `o.name`, built by timm's `create_optimizer_v2` over our `param_groups`; betas, eps and fused
    only where the optimizer takes them (betas or eps given to one that does not is refused)."""
    import inspect

    from timm.optim import create_optimizer_v2

    info = optimizer_info(o.name)
    groups = param_groups(model, o.lr, o.weight_decay, o.layer_decay, o.decay_tokens, o.patch_embed_lr_mult)
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


def name_parameters(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
    """Each group of `optimizer` gets its parameters' names (`param_names`, torch's own key: `names` maps id(p) to
    the module's name of p), and loading a state matches parameters by those names: a checkpoint from another
    strategy, or with its groups in another order, gives each parameter its own state, never its neighbour's. A
    state written before names were kept loads by position, as it was saved."""
    for group in optimizer.param_groups:
        group["param_names"] = [names[id(p)] for p in group["params"]]
    optimizer.register_load_state_dict_pre_hook(_match_by_name)


def states_by_name(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict's per-parameter states, keyed by the names its groups carry."""
    return {
        n: state["state"][i]
        for g in state["param_groups"]
        for i, n in zip(g["params"], g["param_names"], strict=True)
        if i in state["state"]
    }


def _match_by_name(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
    saved = state["param_groups"]
    if not all("param_names" in g for g in saved):
        return None
    number = {n: i for g in saved for n, i in zip(g["param_names"], g["params"], strict=True)}
    group_of = {n: g for g in saved for n in g["param_names"]}
    live = [n for g in optimizer.param_groups for n in g["param_names"]]
    if set(live) != set(number):
        missing, extra = sorted(set(live) - set(number)), sorted(set(number) - set(live))
        raise UserError(
            f"the checkpoint's optimizer state is for other parameters (not saved: {missing[:3]}, not trained here: "
            f"{extra[:3]}): resume with the parameters it trained (model, objective, freeze_backbone)"
        )
    groups = [
        {**group_of[names[0]], "params": [number[n] for n in names], "param_names": names}
        for names in (g["param_names"] for g in optimizer.param_groups)
    ]
    return {**state, "param_groups": groups}


_WARNED_WARMUP: list[bool] = []


def make_scheduler(optimizer: torch.optim.Optimizer, s: SchedulerConfig, total_steps: int, epochs: int):
    """The schedule of `s` over a run of `total_steps` steps in `epochs` epochs: vitlab's per-step warmup + cosine
    or MAE's (LambdaLRs), or timm's scheduler `s.name` (stepped by ViTModule: step_update after every step, step at
    each epoch's end)."""
    per_epoch = max(1, total_steps // max(1, epochs))
    if s.name == "mae_cosine":  # MAE's warmup is in fractional epochs: t / W with W = warmup_epochs * steps per epoch
        warmup = float(s.warmup_steps) if s.warmup_steps is not None else s.warmup_epochs * per_epoch
    else:
        warmup = int(s.warmup_steps) if s.warmup_steps is not None else round(s.warmup_epochs * per_epoch)
    if warmup > total_steps:
        # Once a process: a sweep's jobs (one process) would say it for every job.
        (log.info if _WARNED_WARMUP else log.warning)(
            "warmup of %d steps is longer than the %d training steps; warming up over all of them "
            "(set scheduler.warmup_epochs or scheduler.warmup_steps lower)",
            warmup,
            total_steps,
        )
        _WARNED_WARMUP.append(True)
        warmup = total_steps
    if s.name in LAMBDA_SCHEDULES:
        lr = optimizer.defaults["lr"]
        min_ratio = s.min_lr_ratio if s.name == "warmup_cosine" else (s.min_lr / lr if lr else 0.0)
        schedule = functools.partial(LAMBDA_SCHEDULES[s.name], warmup=warmup, total=total_steps, min_ratio=min_ratio)
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    from timm.scheduler import create_scheduler_v2

    # The run's epochs hold the cooldown, and with warmup_prefix the warmup too: the decay ends with the run (timm's
    # train.py would add both after num_epochs).
    decay_epochs = epochs - s.cooldown_epochs - (warmup / per_epoch if s.warmup_prefix else 0)
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=s.name,
        num_epochs=max(1, decay_epochs),
        decay_epochs=s.decay_epochs,
        decay_milestones=list(s.decay_milestones),
        cooldown_epochs=s.cooldown_epochs,
        patience_epochs=s.patience_epochs,
        decay_rate=s.decay_rate,
        min_lr=s.min_lr,
        warmup_lr=s.warmup_lr,
        warmup_epochs=warmup / per_epoch,
        warmup_prefix=s.warmup_prefix,
        cycle_mul=s.cycle_mul,
        cycle_decay=s.cycle_decay,
        cycle_limit=s.cycle_limit,
        k_decay=s.k_decay,
        plateau_mode=s.plateau_mode,
        step_on_epochs=s.step_on_epochs,
        updates_per_epoch=per_epoch,
    )
    return scheduler
