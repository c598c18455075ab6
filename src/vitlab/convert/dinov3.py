"""DINOv3's released backbones (facebookresearch/dinov3 hub files, `dinov3_vit*16_pretrain_*.pth`) in timm's keys, as
timm's eva.checkpoint_filter_fn converts them: a weights family of its own, recognised by `is_dinov3` and read by
`from_dinov3` (convert/weights.py's table of families). Its architecture is an Eva's (convert/timm_eva.py).
"""

from __future__ import annotations

import re

import torch

from vitlab.utils.errors import UserError

# The hub's names -> timm's (eva.checkpoint_filter_fn's DINOv3 branch and its general renames)
DINOV3_RENAMES = [("storage_tokens", "reg_token"), ("ls1.gamma", "gamma_1"), ("ls2.gamma", "gamma_2"),
                  ("mlp.w12", "mlp.fc1"), ("mlp.w1", "mlp.fc1_g"), ("mlp.w2", "mlp.fc1_x"),
                  ("mlp.w3", "mlp.fc2")]  # fmt: skip
# Entries a backbone does not use: the masked-token embedding, the RoPE periods (recomputed; the hub's are bf16), the
# qkv bias mask, the 7B's local-crop norm, EUPE's distillation projectors
DINOV3_DROPPED = re.compile(r"(^|\.)(mask_token|periods|bias_mask)$|^(rope_embed|local_cls_norm|projectors)\.")
# timm's keys of a DINOv3 Eva (what a converted file must hold)
DINOV3_TIMM_KEYS = re.compile(
    r"^(cls_token|reg_token|pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)|head\.(weight|bias)|"
    r"blocks\.\d+\.(gamma_[12]|norm[12]\.(weight|bias)|attn\.(qkv\.weight|q_bias|v_bias|proj\.(weight|bias))|"
    r"mlp\.(fc1|fc2|fc1_g|fc1_x)\.(weight|bias)))$"
)


def is_dinov3(sd: dict[str, torch.Tensor]) -> bool:
    """A DINOv3 backbone in its hub's layout: its storage tokens or its RoPE periods (Sapiens2's files, with storage
    tokens too, name their attention wq / wk / wv: not these)."""
    if "blocks.0.attn.wq.weight" in sd:
        return False
    return "storage_tokens" in sd or "rope_embed.periods" in sd


def from_dinov3(sd: dict[str, torch.Tensor], path: object = "weights file") -> dict[str, torch.Tensor]:
    """A DINOv3 hub state dict in timm's keys, as timm's checkpoint filter converts it: storage tokens -> reg_token,
    ls1/ls2 -> gamma_1/gamma_2, SwiGLU w1/w2/w3 -> fc1_g/fc1_x/fc2, the qkv bias split into q_bias and v_bias (the
    key's third, fixed at zero, dropped; an all-zero bias, the distilled ViT-B/L/H+ and 7B's, dropped whole: those
    models have none), pretraining-only entries dropped. Keys that are neither the hub's layout nor timm's: a one-line
    UserError naming the file."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if DINOV3_DROPPED.search(key):
            continue
        if key.endswith("attn.qkv.bias"):
            q, k, v = value.chunk(3, dim=-1)
            if value.any():
                out[key.replace("qkv.bias", "q_bias")], out[key.replace("qkv.bias", "v_bias")] = q, v
            continue
        for old, new in DINOV3_RENAMES:
            key = key.replace(old, new)
        out[key] = value
    bad = [k for k in out if not DINOV3_TIMM_KEYS.match(k)]
    if bad:
        raise UserError(
            f"weights file {str(path)!r} holds DINOv3's storage tokens, but its keys are neither DINOv3's hub layout "
            f"nor timm's: {bad[:4]}"
        )
    return out
