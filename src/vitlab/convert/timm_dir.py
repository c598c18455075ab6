"""A way back to timm: a ViT written as the folder timm's `local-dir:` reads (timm's save_for_hf layout), so that
`timm.create_model('local-dir:<folder>', pretrained=True)` builds timm's own model with our weights: its
VisionTransformer for the plain ViTs, its Eva for the RoPE families (EVA02, DINOv3, RoPE-Mixed: convert/timm_eva.py),
its NaFlexVit for NaFlex models (convert/timm_naflex.py) — FAMILIES, one row each.

config.json names a registered architecture of that class and the arguments that make it ours (`model_args`, which
timm's factory puts over the architecture's own) and the pretrained configuration (preprocessing, class count, label
names); model.safetensors holds the state dict, whose keys are timm's. timm's arguments must be JSON: the components
timm takes as names (activation, attention, a norm at timm's default eps) are written as names; those it takes only as
classes (VisionTransformer's block and MLP, Eva's norm, a norm at another eps) are the architecture's own, so the
architecture is one whose registered arguments have ours (`timm_architecture_for`). The folder is written beside its
destination, loaded by timm and compared with the model before it is renamed into place: a folder that timm would not
read back as our logits is refused and nothing is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitlab.convert.timm_args import config_from_args, timm_kwargs, timm_model_args
from vitlab.convert.timm_eva import eva_kwargs, is_eva_config
from vitlab.convert.timm_naflex import UNSUPPORTED as NAFLEX_OFF
from vitlab.convert.timm_naflex import is_naflex_config, naflex_timm_kwargs
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT, ViTConfig
from vitlab.utils.atomic import atomic_dir
from vitlab.utils.errors import UserError

# Arguments timm's VisionTransformer takes as classes only: the architecture written in config.json must have ours.
CLASS_ARGS = ("distilled", "block_fn", "mlp_layer")
NORM_ARGS = ("norm_layer", "norm_eps", "embed_norm")  # names at timm's default eps; otherwise the architecture's
TIMM_EPS = 1e-6  # timm's LayerNorm and RmsNorm, built from their names
# Tried first: the plain architectures (their entry points add nothing a name or flag would not override).
PREFERRED = ("vit_base_patch16_224", "deit_base_distilled_patch16_224")
# The pretrained configuration's keys that describe the weights (timm's names), written as they are.
PRETRAINED_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std", "num_classes",
                   "pool_size", "fixed_input_size", "first_conv", "classifier", "label_names", "license")  # fmt: skip


def _vit_needs(cfg: ViTConfig) -> tuple[str, ...]:
    return CLASS_ARGS + (NORM_ARGS if cfg.norm_eps != TIMM_EPS else ())


def _vit_args(cfg: ViTConfig) -> dict[str, Any]:
    """timm's VisionTransformer arguments for cfg: components by name; the class-only ones left to the architecture."""
    args = timm_kwargs(cfg)
    for key in ("block_fn", "mlp_layer", "norm_layer", "embed_norm_layer"):
        del args[key]
    if cfg.norm_eps == TIMM_EPS:
        args["norm_layer"] = cfg.norm_layer
        args["embed_norm_layer"] = cfg.norm_layer if cfg.embed_norm else None
    return args


def _eva_args(cfg: ViTConfig) -> dict[str, Any]:
    """timm's Eva arguments for cfg (every one it reads, so nothing of the architecture's own is left to differ) but
    its norm, which Eva takes as a class only (the architecture's: _eva_needs)."""
    args = eva_kwargs(cfg)
    del args["norm_layer"]
    args.setdefault("swiglu_align_to", 0)  # (DINOv3's + architectures align theirs)
    return args


def _naflex_args(cfg: ViTConfig) -> dict[str, Any]:
    """timm's NaFlexVit arguments for cfg, what our ViT leaves off said as off (NaFlexVitCfg's fields), the norms by
    name: NaFlexVit builds them from their names only, at timm's eps."""
    if cfg.norm_eps != TIMM_EPS:
        raise UserError(
            f"timm's NaFlexVit builds its norms by name, at eps {TIMM_EPS}: a NaFlex model of norm_eps {cfg.norm_eps} "
            "cannot be exported as a timm folder (format=onnx or pt2 can)"
        )
    off = {name: value[0] if isinstance(value, tuple) else value for name, value in NAFLEX_OFF.items()}
    args = off | naflex_timm_kwargs(cfg)
    args["norm_layer"] = cfg.norm_layer
    args["embed_norm_layer"] = cfg.norm_layer if cfg.embed_norm else None
    return args


class TimmFamily(NamedTuple):
    """A class of timm's that builds our ViT: which configs it builds, its registered architectures (timm's modules),
    the fields an architecture must share with cfg (those timm takes only as classes, which JSON cannot name), and
    cfg's arguments for it (`model_args`)."""

    builds: Callable[[ViTConfig], bool]
    modules: tuple[str, ...]
    needs: Callable[[ViTConfig], tuple[str, ...]]
    args: Callable[[ViTConfig], dict[str, Any]]


# Asked in order: the first family that builds a config is its.
FAMILIES = {
    "NaFlexVit": TimmFamily(is_naflex_config, ("naflexvit",), lambda cfg: (), _naflex_args),
    "Eva": TimmFamily(is_eva_config, ("eva",), lambda cfg: ("norm_layer", "norm_eps"), _eva_args),
    "VisionTransformer": TimmFamily(lambda cfg: True, ("vision_transformer", "deit"), _vit_needs, _vit_args),
}


def timm_family(cfg: ViTConfig) -> str:
    """The class of timm's that builds cfg's network (a FAMILIES key)."""
    return next(name for name, family in FAMILIES.items() if family.builds(cfg))


@cache
def _names(modules: tuple[str, ...]) -> tuple[str, ...]:
    import timm

    return tuple(name for module in modules for name in timm.list_models(module=module))


@cache
def _registered(arch: str) -> dict[str, Any] | None:
    """An architecture's registered arguments as ViTConfig fields, or None when our ViT cannot express it."""
    try:
        return config_from_args(arch, timm_model_args(arch)).to_dict()
    except (UserError, RuntimeError, TypeError):
        return None


def timm_architecture_for(cfg: ViTConfig, hint: str | None = None) -> str:
    """A registered architecture of cfg's timm family whose class-only arguments are cfg's: `hint` (the one the model
    came from) if it is one; else for timm's VisionTransformer the first of PREFERRED and its registry, for Eva and
    NaFlexVit the one whose registered config shares the most fields with cfg (timm's own name for the model, where it
    has one: vit_small_patch16_dinov3, eva02_tiny_patch14_224)."""
    family = FAMILIES[timm_family(cfg)]
    ours = cfg.to_dict()
    want = {k: ours[k] for k in family.needs(cfg)}
    names = _names(family.modules)

    def fits(arch: str) -> bool:
        return (args := _registered(arch)) is not None and all(args[k] == v for k, v in want.items())

    if hint in names and fits(hint):
        return hint
    if family is FAMILIES["VisionTransformer"]:
        arch = next((a for a in dict.fromkeys([*PREFERRED, *names]) if fits(a)), None)
    else:
        same = {a: sum(_registered(a).get(k) == v for k, v in ours.items()) for a in names if fits(a)}
        arch = max(same, key=same.get) if same else None
    if arch is None:
        raise UserError(f"no architecture timm registers builds {want}: timm cannot read this model back")
    return arch


def timm_model_args_json(cfg: ViTConfig) -> dict[str, Any]:
    """The arguments of cfg's timm class (timm_family) for cfg, as JSON (tuples as lists); the class-only ones left
    to the architecture (timm_architecture_for)."""
    args = FAMILIES[timm_family(cfg)].args(cfg)
    args["img_size"], args["patch_size"] = list(cfg.img_hw), list(cfg.patch_hw)

    def unwritable(value: Any) -> Any:
        raise UserError(f"timm reads config.json's model_args as JSON, and {value!r} is not: cannot export this model")

    return json.loads(json.dumps(args, default=unwritable))


def timm_config(model: ViT, label_names: list[str] | None = None, hint: str | None = None) -> dict[str, Any]:
    """config.json as timm's save_for_hf writes it: architecture, class count, width, model_args, pretrained_cfg."""
    cfg = model.cfg
    pretrained = {k: v for k, v in model.pretrained_cfg.items() if k in PRETRAINED_KEYS and v is not None}
    pretrained |= dict(input_size=[cfg.in_chans, *cfg.img_hw], num_classes=cfg.num_classes,
                       fixed_input_size=not cfg.dynamic_img_size)  # fmt: skip
    pretrained["classifier"] = ["head", "head_dist"] if cfg.distilled else "head"
    if label_names:
        pretrained["label_names"] = list(label_names)
    return {
        "architecture": timm_architecture_for(cfg, hint),
        "num_classes": cfg.num_classes,
        "num_features": cfg.embed_dim,
        "global_pool": cfg.global_pool,
        "model_args": timm_model_args_json(cfg),
        "pretrained_cfg": json.loads(json.dumps(pretrained)),  # tuples as lists, as timm's writer does
    }


def save_timm_dir(
    model: ViT,
    out: str | os.PathLike,
    label_names: list[str] | None = None,
    atol: float = 1e-5,
    overwrite=False,
    card: Callable[[dict[str, Any], dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """Write `model` as a timm folder at `out` (config.json, model.safetensors), read back by timm and compared
    (largest |logit difference| <= atol) before it is put in place (utils.atomic.atomic_dir: with the permissions
    of any new file). `card(config, checked)`: the folder's README.md (convert.publish.model_card), from config.json
    and the check (architecture, max_abs_diff, atol, parameters). Returns what was written and measured."""
    from safetensors.torch import save_file

    from vitlab.convert.peft_dir import merged

    out, model = Path(out), merged(model)  # peft's adapters merged into plain timm layers
    if out.exists() and not overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    hint = model.pretrained_cfg.get("architecture")
    config = timm_config(model, label_names, hint)
    state = check_state_dict(model.state_dict(), model.cfg)
    state = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    measured: dict[str, float] = {}

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        measured["diff"] = diff = _timm_reads_it_back(model, folder)
        if not diff <= atol:
            raise UserError(
                f"timm's model of the folder is {diff:.3g} from ours (over {atol}): refused, nothing written"
            )
        if card is not None:
            checked = {"architecture": config["architecture"], "max_abs_diff": diff, "atol": atol,
                       "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
            (folder / "README.md").write_text(card(config, checked))

    atomic_dir(out, write, what="timm export", advice="free space, or export elsewhere with output=<folder>")
    loads = f"timm.create_model('local-dir:{out}', pretrained=True)"
    arch = config["architecture"]
    return {"output": str(out), "architecture": arch, "max_abs_diff": measured["diff"], "loads_with": loads}


@torch.no_grad()
def _timm_reads_it_back(model: ViT, folder: Path) -> float:
    """The largest |logit| difference between timm's model of `folder` and ours, in eval mode, on two images."""
    import timm

    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    ours = model.float().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.cfg.in_chans, *model.cfg.img_hw, generator=g).to(next(ours.parameters()).device)
    return (theirs.to(x.device)(x) - ours(x)).abs().max().item()
