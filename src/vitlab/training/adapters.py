"""peft=lora|dora|bitfit|partial: fine-tuning a pretrained ViT cheaply, on Hugging Face peft.

The run's `peft` settings (`PeftConfig`, conf/peft/) become the plan's part once (`plan_peft`: the base weights named
by their source and sha256); ViTModule hands that part to `attach`, which loads the base weights, checks their hash,
and then makes the ViT train what the method says: LoRA and DoRA are peft's own (`LoraConfig`,
`inject_adapter_in_model`, on timm's module names, which are ours), with `peft.trainable` as peft's `modules_to_save`;
BitFit (biases and norms, Ben Zaken et al. 2022) and partial fine-tuning (the last blocks, or names by glob) are a
choice of `requires_grad`, peft having no tuner for either. A checkpoint keeps the trainable tensors only
(`drop_frozen`), its hyper-parameters naming the base; a load fills the frozen tensors from that base (`fill_frozen`).
The merged model and peft's folder, for export: convert.peft_dir.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Iterable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitlab.training import pretrained
from vitlab.utils.errors import UserError

log = logging.getLogger("vitlab.train")

METHODS = ("none", "lora", "dora", "bitfit", "partial")
ADAPTED = ("lora", "dora")  # the methods whose tensors are peft's adapters (format=peft exports them)
MIN_PEFT = (0, 17)  # LoraConfig's use_dora/use_rslora/init_lora_weights and inject_adapter_in_model as used here


@dataclasses.dataclass(frozen=True)
class PeftConfig:
    """conf/peft/'s settings (their meaning: conf/peft/_base.yaml)."""

    method: str = "none"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_dora: bool = False
    use_rslora: bool = False
    init: str = "default"  # LoraConfig.init_lora_weights: default (A Kaiming, B zero) | gaussian | pissa | olora | ...
    targets: tuple[str, ...] = ("qkv",)
    trainable: tuple[str, ...] = ("head",)
    blocks: int = 2  # peft=partial: the last `blocks` blocks (and the final norm) train
    names: tuple[str, ...] = ()  # peft=partial: parameter names (globs) that train besides

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"peft.method {self.method!r} is not one of {list(METHODS)}")
        if self.rank <= 0:
            raise UserError(f"peft.rank {self.rank} must be an integer >= 1 (the adapters' rank r)")
        if self.method == "partial" and self.blocks < 0:
            raise UserError(f"peft.blocks {self.blocks} must be >= 0 (the last blocks that train)")
        for key in ("targets", "trainable", "names"):
            object.__setattr__(self, key, tuple(getattr(self, key) or ()))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> PeftConfig:
        values = {k: v for k, v in dict(values or {}).items() if k != "base"}
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserError(f"peft has no key(s) {unknown}; it takes {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**values)

    @property
    def lora(self) -> bool:
        return self.method in ADAPTED

    def lora_config(self) -> Any:
        """peft's LoraConfig of these settings (peft=dora: use_dora)."""
        from peft import LoraConfig

        init: Any = {"default": True, "true": True, "false": False}.get(str(self.init).lower(), self.init)
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            use_dora=self.use_dora or self.method == "dora",
            use_rslora=self.use_rslora,
            init_lora_weights=init,
            target_modules=list(self.targets),
            modules_to_save=list(self.trainable) or None,
        )


def check_peft_version(installed: str | None = None) -> None:
    """peft older than MIN_PEFT refused in one line."""
    installed = installed or version("peft")
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if parts < MIN_PEFT:
        raise UserError(f"peft {installed} is too old for peft=: install peft>={'.'.join(map(str, MIN_PEFT))}")


def plan_peft(
    settings: Mapping[str, Any] | None, weights: Any, resumed: Mapping[str, Any] | None, resample_patch: bool = False
) -> dict | None:
    """The plan's part of peft= (None for the full fine-tune): the settings with the base weights they adapt, named by
    source and sha256: model.pretrained's (`weights`, convert.source.Weights), or the base that the checkpoint to go
    on from names (`resumed`: its hyper-parameters)."""
    cfg, before = PeftConfig.from_dict(settings), (resumed or {}).get("peft")
    if before and PeftConfig.from_dict(before) != cfg:
        settings = {k: v for k, v in before.items() if k != "base"}
        raise UserError(f"the checkpoint to go on from trained with peft={before['method']} {settings}: go on with the "
                        "same peft settings")  # fmt: skip
    if resumed is not None and not before and cfg.method != "none":
        raise UserError(f"the checkpoint to go on from is a full fine-tune's: to adapt its weights with peft="
                        f"{cfg.method}, give it as model.pretrained=<it> (a new run), not as ckpt_path")  # fmt: skip
    if cfg.method == "none":
        return None
    check_peft_version()
    if weights is None and before:
        base = dict(before["base"])
    elif weights is None:
        raise UserError(
            f"peft={cfg.method} adapts pretrained weights: give model.pretrained=<checkpoint | timm name> (the base "
            "the adapters train on)"
        )
    else:
        source = str(Path(weights.source).resolve()) if weights.is_file else weights.source
        base = {"source": source, "sha256": pretrained.weights_digest(weights), "is_file": bool(weights.is_file)}
        base["resample_patch"] = resample_patch
    if before and dict(before["base"])["sha256"] != base["sha256"]:
        raise UserError(
            f"the checkpoint to go on from adapts base weights of sha256 {before['base']['sha256'][:12]}..., and "
            f"model.pretrained {base['source']!r} has sha256 {base['sha256'][:12]}...: give the same base"
        )
    return dataclasses.asdict(cfg) | {"base": base}


def attach(module: Any, peft: Mapping[str, Any] | None) -> None:
    """peft='s method applied to the ViT of `module` (a new ViTModule, its base weights already loaded:
    ViTModule._start_from), what the adapters adapt named on the ViT for format=peft's folder."""
    if not peft:
        return
    cfg, base = PeftConfig.from_dict(peft), peft["base"]
    if not module.objective.uses_labels:
        raise UserError(
            f"peft={cfg.method} fine-tunes a classifier (objective=classify or distill); objective="
            f"{type(module.objective).__name__.lower()} pretrains the whole encoder, which adapters would not change"
        )
    apply(module.model, cfg)
    module.model.adapter_base = dict(base)  # what format=peft's folder names (convert.peft_dir)
    log.info(describe(module.model, peft))


def apply(model: nn.Module, cfg: PeftConfig) -> nn.Module:
    """`model` made to train what `cfg` says, in place: peft's LoRA/DoRA injected (timm's module names), or BitFit's
    and partial fine-tuning's parameters left trainable; everything else frozen."""
    if "head" in cfg.trainable and isinstance(getattr(model, "head_dist", None), nn.Linear):  # DeiT's second head
        cfg = dataclasses.replace(cfg, trainable=(*cfg.trainable, "head_dist"))  # (objective=distill trains it too)
    _check_names(model, cfg.targets if cfg.lora else (), "peft.targets")
    _check_names(model, cfg.trainable, "peft.trainable")
    if cfg.lora:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(cfg.lora_config(), model)
        _dropout_by_rows(model)
        return model
    depth = len(getattr(model, "blocks", ()))
    last = {f"blocks.{i}." for i in range(max(0, depth - cfg.blocks), depth)}
    norms = {n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if cfg.method == "bitfit":
            train = name.endswith("bias") or owner in norms
        else:  # partial: the last blocks, the norm after them, names by glob
            train = name.startswith(tuple(last)) or owner in ("norm", "fc_norm")
            train = train or any(fnmatch.fnmatchcase(name, g) for g in cfg.names)
        p.requires_grad_(train or _within(name, cfg.trainable))
    return model


def _dropout_by_rows(model: nn.Module) -> None:
    """peft's `lora_dropout` (an nn.Dropout an adapted layer, applied to its input) made a draw site of model/draws.py:
    within a training step of a global data order it drops by each sample's row of the global batch, not from the
    process's generator, so an adapter run resumed on another number of processes goes on exactly (issue 78). Every
    site is numbered again (the adapters' among the model's)."""
    from vitlab.model.draws import Dropout, number_draw_sites

    for layer in model.modules():
        drops = getattr(layer, "lora_dropout", None)
        for name, drop in drops.items() if isinstance(drops, nn.ModuleDict) else ():
            if type(drop) is nn.Dropout:
                drops[name] = Dropout(drop.p)
    number_draw_sites(model)


def _within(name: str, modules: Iterable[str]) -> bool:
    return any(name.startswith(f"{m}.") or f".{m}." in f".{name}" for m in modules)


def _check_names(model: nn.Module, wanted: Iterable[str], key: str) -> None:
    """Each of `wanted` names a module (peft's rule: the full name, or its end after a dot), else one line naming
    the modules there are."""
    names = [n for n, _ in model.named_modules() if n]
    for target in wanted:
        if not any(n == target or n.endswith(f".{target}") for n in names):
            leaves = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise UserError(
                f"{key} {target!r} matches no module of this ViT; its Linear modules end in {leaves}, its top-level "
                f"modules are {sorted({n.split('.')[0] for n in names})}"
            )


def frozen_keys(module: nn.Module, prefix: str = "model.") -> set[str]:
    """The state-dict keys of `module`'s frozen parameters under `prefix` (the base an adapter checkpoint omits)."""
    return {f"{prefix}{n}" for n, p in module.model.named_parameters() if not p.requires_grad}


# The sets of weights a checkpoint may hold: its own, and callbacks=ema's other set beside them (the EMA's, or the raw
# weights where the checkpoint holds the EMA's: convert/averaging.py EMA_BESIDE, RAW_BESIDE).
WEIGHT_SETS = ("state_dict", "average_model_state", "current_model_state")


def drop_frozen(module: Any, checkpoint: dict[str, Any]) -> None:
    """A peft= run's checkpoint without the frozen base in any set of its weights (its hyper-parameters name the
    base's source and sha256): with callbacks=ema the set beside held the whole network, base and all."""
    if module.hparams.get("peft"):
        frozen = frozen_keys(module)
        for key in (k for k in WEIGHT_SETS if k in checkpoint):
            checkpoint[key] = {k: v for k, v in checkpoint[key].items() if k not in frozen}


def fill_frozen(module: Any, state: dict[str, Any]) -> None:
    """A peft= checkpoint's state dict completed with its frozen base before it is loaded into `module`: the base
    `module` started from (a training run's, to test its best checkpoint), else the one the hyper-parameters name
    (`base_state`: a module rebuilt from the checkpoint)."""
    missing = frozen_keys(module) - set(state) if module.hparams.get("peft") else set()
    if not missing:
        return
    ours = module.state_dict() if module.started_from_weights else base_state(module, missing)
    for key in missing:
        state[key] = ours[key]


def base_state(module: Any, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The frozen base of an adapted `module` under its state-dict `keys`, from the base weights its peft=
    hyper-parameters name (resolved, their sha256 checked: pretrained.checked_base) loaded into a plain ViT of its
    config: peft's `base_layer` and `original_module` are the plain ViT's own layers."""
    from vitlab.model import ViT

    base = module.hparams["peft"]["base"]
    plain = ViT(module.model.cfg)
    pretrained.checked_base(base).load_into(plain, resample_patch=bool(base.get("resample_patch")))
    tensors = plain.state_dict()
    named = {k: k.removeprefix("model.").replace(".base_layer.", ".").replace(".original_module.", ".") for k in keys}
    return {key: tensors[name] for key, name in named.items()}


def describe(model: nn.Module, cfg: Mapping[str, Any]) -> str:
    """The line a run logs: the method and its trainable share."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"peft={cfg['method']}: {trainable:,} of {total:,} parameters train ({100 * trainable / max(total, 1):.2f}%)"
