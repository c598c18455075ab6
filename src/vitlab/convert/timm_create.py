"""`vitlab.create_model`: timm's `create_model`, answered with vitlab's ViT.

A script that calls `timm.create_model(name, pretrained=..., num_classes=..., device=..., dtype=...,
features_only=..., out_indices=..., pretrained_cfg_overlay=..., checkpoint_path=...)` for a ViT of timm's
vision_transformer, deit or naflexvit modules may call `vitlab.create_model` with the same arguments instead (a
naflexvit one is our ViT with naflex=true, model/naflex.py). timm's own factory runs: it resolves the name (a
registered architecture, with or without a pretrained tag, or a `local-dir:` folder or `hf-hub:` repository), drops
None-valued keywords, merges the pretrained configuration's defaults, loads pretrained weights through its
checkpoint filter (position embeddings resampled), wraps the model for features_only as it wraps its ViTs
(FeatureGetterNet on forward_intermediates), and loads checkpoint_path; only the constructor is ours: where timm
would build its VisionTransformer, the same arguments build `ViT(config_from_args(...))`, on `device`, in `dtype`.
The keys of the state dict are timm's, so every step that reads them works unchanged.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from torch import nn

from vitlab.convert.timm_args import config_from_args, timm_builds
from vitlab.convert.timm_hub import from_the_hub, timm_architecture, timm_model_names
from vitlab.model import ViT
from vitlab.utils.errors import UserError, close_matches


def create_model(
    model_name: str,
    pretrained: bool = False,
    pretrained_cfg: str | dict[str, Any] | None = None,
    pretrained_cfg_overlay: dict[str, Any] | None = None,
    checkpoint_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    scriptable: bool | None = None,
    exportable: bool | None = None,
    no_jit: bool | None = None,
    **kwargs: Any,
) -> nn.Module:
    """timm.create_model's signature and semantics (see the module docstring), returning vitlab's ViT, or timm's
    feature wrapper around it with `features_only`. A keyword no ViT takes is a TypeError (UnknownArgumentError), as
    timm's; an architecture outside timm's plain ViTs, or one our ViT cannot express, a one-line UserError."""
    import timm

    arch = timm_architecture(model_name)
    names = timm_model_names()
    if arch not in names:
        close = close_matches(arch, names)
        raise UserError(
            f"{arch!r} is not a ViT of timm's vision_transformer, deit, eva or naflexvit modules, which vitlab's ViT "
            "expresses" + (f"; did you mean {close}?" if close else "")
        )

    def build(**args: Any) -> ViT:
        device, dtype = args.pop("device", None), args.pop("dtype", None)
        return ViT(config_from_args(arch, args, given=kwargs), device=device, dtype=dtype)

    local = model_name.startswith("local-dir:") or (pretrained_cfg_overlay or {}).get("file")
    downloads = model_name.startswith("hf-hub:") or (pretrained and not local)
    hub = from_the_hub(model_name) if downloads else contextlib.nullcontext()
    with timm_builds(build), hub:
        return timm.create_model(
            model_name,
            pretrained=pretrained,
            pretrained_cfg=pretrained_cfg,
            pretrained_cfg_overlay=pretrained_cfg_overlay,
            checkpoint_path=checkpoint_path,
            cache_dir=cache_dir,
            scriptable=scriptable,
            exportable=exportable,
            no_jit=no_jit,
            **kwargs,
        )
