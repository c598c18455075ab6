"""A way back to timm: a ViT written as the folder timm's `local-dir:` reads (timm's save_for_hf layout), so that
`timm.create_model('local-dir:<folder>', pretrained=True)` builds timm's own VisionTransformer with our weights.

config.json names a registered architecture and the arguments that make it ours (`model_args`, which timm's factory
puts over the architecture's own) and the pretrained configuration (preprocessing, class count, label names);
model.safetensors holds the state dict, whose keys are timm's. timm's arguments must be JSON: the components timm
takes as names (activation, attention, a norm at timm's default eps) are written as names; those it takes only as
classes (the block, the MLP, a norm at another eps) are the architecture's own, so the architecture is one whose
registered arguments have ours (`timm_architecture_for`). The folder is written beside its destination, loaded by
timm and compared with the model before it is renamed into place: a folder that timm would not read back as our
logits is refused and nothing is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from vitlab.convert.timm_args import timm_kwargs, timm_model_args, vitlab_args
from vitlab.convert.timm_hub import timm_vit_names
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT, ViTConfig
from vitlab.utils.atomic import atomic_dir
from vitlab.utils.errors import UserError

# Arguments timm takes as classes only: the architecture written in config.json must have ours.
CLASS_ARGS = ("distilled", "block_fn", "mlp_layer")
NORM_ARGS = ("norm_layer", "norm_eps", "embed_norm")  # names at timm's default eps; otherwise the architecture's
TIMM_EPS = 1e-6  # timm's LayerNorm and RmsNorm, built from their names
# Tried first: the plain architectures (their entry points add nothing a name or flag would not override).
PREFERRED = ("vit_base_patch16_224", "deit_base_distilled_patch16_224")
# The pretrained configuration's keys that describe the weights (timm's names), written as they are.
PRETRAINED_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std", "num_classes",
                   "pool_size", "fixed_input_size", "first_conv", "classifier", "label_names", "license")  # fmt: skip


def _needs(cfg: ViTConfig) -> tuple[str, ...]:
    return CLASS_ARGS + (NORM_ARGS if cfg.norm_eps != TIMM_EPS else ())


@cache
def _registered(arch: str) -> dict[str, Any] | None:
    """An architecture's registered arguments as ViTConfig fields, or None when our ViT cannot express it."""
    try:
        return ViTConfig.from_dict(vitlab_args(timm_model_args(arch))).to_dict()
    except (UserError, RuntimeError, TypeError):
        return None


def timm_architecture_for(cfg: ViTConfig, hint: str | None = None) -> str:
    """A registered architecture of timm's vision_transformer / deit modules whose class-only arguments are cfg's
    (`hint`, the one the model came from, tried first)."""
    want = {k: cfg.to_dict()[k] for k in _needs(cfg)}
    names = timm_vit_names()
    for arch in dict.fromkeys([hint, *PREFERRED, *names]):
        if arch not in names:
            continue
        args = _registered(arch)
        if args is not None and all(args[k] == v for k, v in want.items()):
            return arch
    raise UserError(f"no architecture timm registers builds {want}: timm cannot read this model back")


def timm_model_args_json(cfg: ViTConfig) -> dict[str, Any]:
    """timm's VisionTransformer arguments for cfg as JSON: components by name; the class-only ones left to the
    architecture (timm_architecture_for)."""
    args = timm_kwargs(cfg)
    for key in ("block_fn", "mlp_layer", "norm_layer", "embed_norm_layer"):
        del args[key]
    if cfg.norm_eps == TIMM_EPS:
        args["norm_layer"] = cfg.norm_layer
        args["embed_norm_layer"] = cfg.norm_layer if cfg.embed_norm else None
    args["img_size"], args["patch_size"] = list(cfg.img_hw), list(cfg.patch_hw)
    return args


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

    out = Path(out)
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
    return {"output": str(out), "architecture": config["architecture"], "max_abs_diff": measured["diff"]}


@torch.no_grad()
def _timm_reads_it_back(model: ViT, folder: Path) -> float:
    """The largest |logit| difference between timm's model of `folder` and ours, in eval mode, on two images."""
    import timm

    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    ours = model.float().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.cfg.in_chans, *model.cfg.img_hw, generator=g).to(next(ours.parameters()).device)
    return (theirs.to(x.device)(x) - ours(x)).abs().max().item()
