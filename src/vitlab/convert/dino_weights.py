"""DINO's and DINOv2's released checkpoints -> the ViT's state dict (timm's names, which are vitlab's):

- dino `dino_<arch>_pretrain.pth`: the teacher's backbone, already in timm's names (a bare state dict: nothing to do);
- dino `*_full_checkpoint.pth` and main_dino.py's `checkpoint.pth`: {'student', 'teacher', 'optimizer', 'epoch',
  'args', 'dino_loss', ...}, each network `backbone.*` and `head.*` (the student's under DDP's `module.`); the
  teacher's backbone is taken, as DINO evaluates and releases it;
- dinov2 hub `dinov2_vit*14*_pretrain.pth`: the backbone with `mask_token` (dropped), LayerScale `ls1.gamma`,
  `register_tokens` in the `_reg` variants and the giant's SwiGLU `w12`/`w3`: timm's own conversion
  (timm.models.vision_transformer._convert_dinov2) gives timm's names.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


def is_dino_training_checkpoint(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("teacher"), dict) and isinstance(obj.get("student"), dict)


def teacher_backbone(ckpt: dict, path: object) -> StateDict:
    """The teacher's backbone of a DINO training checkpoint (`module.` prefixes, DDP's, stripped)."""
    teacher = {k.removeprefix("module."): v for k, v in ckpt["teacher"].items()}
    backbone = {k[len("backbone.") :]: v for k, v in teacher.items() if k.startswith("backbone.")}
    left = sorted({k.split(".")[0] for k in teacher if not k.startswith("backbone.")})
    log.info(
        "%s: a DINO training checkpoint (epoch %s): took the teacher's backbone; left out the student, %s",
        path,
        ckpt.get("epoch", "?"),
        ", ".join(f"the teacher's {k}.*" for k in left) or "nothing else",
    )
    return backbone


def is_dinov2(sd: StateDict) -> bool:
    """A DINOv2 backbone: its mask token (1, D) and no MAE decoder (whose mask token is (1, 1, D)), nor DINOv3's storage
    tokens or RoPE periods (convert/timm_eva.py)."""
    token = sd.get("mask_token")
    dinov3 = "storage_tokens" in sd or "rope_embed.periods" in sd
    return token is not None and token.dim() == 2 and not dinov3 and not any(k.startswith("decoder_") for k in sd)


def from_dinov2(sd: StateDict) -> StateDict:
    from timm.models.vision_transformer import _convert_dinov2

    return _convert_dinov2(dict(sd), None)


# The backbones DINO released (facebookresearch/dino's README: dino_deitsmall16_pretrain.pth, dino_vitbase8_...):
# timm's names alone inside, so their file names are what says they are DINO's.
RELEASED_NAME = re.compile(r"dino_(deitsmall|deittiny|vitsmall|vitbase|vitlarge)(8|14|16)_pretrain\.pth")


def is_released_name(path: str | os.PathLike) -> bool:
    return RELEASED_NAME.fullmatch(Path(path).name) is not None


def posemb_rule(obj: object) -> str:
    """How the position table of the weights in `obj` (a file's contents, as read) is resampled by the code that
    trained them (model/posemb.py): DINO's training checkpoints and DINOv2's weights without registers "dino" (their
    interpolate_pos_encoding; DINOv2's hub: interpolate_offset 0.1, no antialias); DINOv2's register models (offset 0,
    antialias) and everything else "timm". DINO's bare `dino_*_pretrain.pth` is timm's names alone: nothing in it says
    it is DINO's; its released file name does (is_released_name), or model.pos_embed_resample=dino."""
    if is_dino_training_checkpoint(obj):
        return "dino"
    sd = obj.get("model", obj) if isinstance(obj, dict) else obj
    if isinstance(sd, dict) and is_dinov2(sd) and not any(k.startswith("register_tokens") for k in sd):
        return "dino"
    return "timm"
