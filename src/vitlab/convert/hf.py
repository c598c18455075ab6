"""Hugging Face transformers' ViTForImageClassification and ViTModel -> vitlab.

HF keeps query, key and value as three Linear layers; vitlab (like timm) fuses them into one qkv
whose rows are q; k; v. HF's LayerNorm eps is 1e-12 (timm's 1e-6), carried over through the config.
Checkpoints on the Hub use transformers-4 names (`vit.encoder.layer.3.attention.attention.query`);
transformers 5 renames them in memory (`vit.layers.3.attention.q_proj`): both are accepted.
A bare `ViTModel` state dict (the Hub's backbone checkpoints: `embeddings.…`, no `vit.` prefix) is read
as the classifier's backbone; its pooler (`pooler.dense`, a dense layer and tanh on the class token that
neither timm nor vitlab has) is left out, as transformers itself leaves it out when it loads such a
checkpoint into ViTForImageClassification. Give it a config with `num_classes=0` (features), or pass
`reset_head=True` and load into a model with a new head (`load_state_dict(..., strict=False)`).
The result goes through the strict timm-name checks of `convert.weights` (every key, every shape).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from vitlab.convert.weights import StateDict, fit_state_dict
from vitlab.model import ViTConfig
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

# transformers-5 in-memory names -> the transformers-4 names stored in checkpoints
_V5_TO_V4 = [
    (r"^vit\.layers\.(\d+)\.attention\.q_proj\.", r"vit.encoder.layer.\1.attention.attention.query."),
    (r"^vit\.layers\.(\d+)\.attention\.k_proj\.", r"vit.encoder.layer.\1.attention.attention.key."),
    (r"^vit\.layers\.(\d+)\.attention\.v_proj\.", r"vit.encoder.layer.\1.attention.attention.value."),
    (r"^vit\.layers\.(\d+)\.attention\.o_proj\.", r"vit.encoder.layer.\1.attention.output.dense."),
    (r"^vit\.layers\.(\d+)\.mlp\.fc1\.", r"vit.encoder.layer.\1.intermediate.dense."),
    (r"^vit\.layers\.(\d+)\.mlp\.fc2\.", r"vit.encoder.layer.\1.output.dense."),
    (r"^vit\.layers\.(\d+)\.", r"vit.encoder.layer.\1."),
]

# transformers-4 name -> timm/vitlab name; {i} block index, {p} weight|bias
HF_KEY_MAP = {
    "vit.embeddings.cls_token": "cls_token",
    "vit.embeddings.position_embeddings": "pos_embed",
    "vit.embeddings.patch_embeddings.projection.{p}": "patch_embed.proj.{p}",
    "vit.encoder.layer.{i}.layernorm_before.{p}": "blocks.{i}.norm1.{p}",
    "vit.encoder.layer.{i}.attention.output.dense.{p}": "blocks.{i}.attn.proj.{p}",
    "vit.encoder.layer.{i}.layernorm_after.{p}": "blocks.{i}.norm2.{p}",
    "vit.encoder.layer.{i}.intermediate.dense.{p}": "blocks.{i}.mlp.fc1.{p}",
    "vit.encoder.layer.{i}.output.dense.{p}": "blocks.{i}.mlp.fc2.{p}",
    "vit.layernorm.{p}": "norm.{p}",
    "classifier.{p}": "head.{p}",
}
_QKV = re.compile(r"^vit\.encoder\.layer\.(\d+)\.attention\.attention\.(query|key|value)\.(weight|bias)$")


def _pattern(template: str) -> re.Pattern:
    rx = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(rx + "$")


_TABLE = [(_pattern(src), dst) for src, dst in HF_KEY_MAP.items()]


def canonical_hf_key(key: str) -> str:
    for rx, repl in _V5_TO_V4:
        new = re.sub(rx, repl, key)
        if new != key:
            return new
    return key


def backbone_keys(sd: StateDict) -> StateDict:
    """A bare ViTModel state dict with ViTForImageClassification's `vit.` names, without its pooler."""
    if any(k.startswith("vit.") for k in sd) or not any(k.startswith("embeddings.") for k in sd):
        return sd
    dropped = [k for k in sd if k.startswith("pooler.")]
    if dropped:
        log.info("HF ViTModel state dict: left out its pooler (%s), which vitlab and timm do not have", dropped)
    return {f"vit.{k}": v for k, v in sd.items() if not k.startswith("pooler.")}


def hf_to_vitlab(sd: StateDict, cfg: ViTConfig, *, reset_head: bool = False) -> StateDict:
    """An HF ViTForImageClassification or ViTModel state dict -> vitlab's, checked against `cfg`.
    `reset_head` leaves the classifier out (a new head, or a backbone that has none)."""
    sd = backbone_keys(sd)
    if cfg.num_classes and not reset_head and "classifier.weight" not in sd:
        raise UserError(
            f"HF state dict has no classifier, and the config asks for {cfg.num_classes} classes: convert it with "
            "num_classes=0 (features), or with reset_head=True to keep the model's new head"
        )
    timm_sd: StateDict = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in sd.items():
        key = canonical_hf_key(key)
        if m := _QKV.match(key):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = value
            continue
        for rx, dst in _TABLE:
            if mm := rx.match(key):
                timm_sd[dst.format(**mm.groupdict())] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"HF state dict has keys vitlab does not map: {unknown[:8]}")
    for (block, p), parts in qkv.items():
        if set(parts) != {"query", "key", "value"}:
            raise UserError(f"HF block {block} has {sorted(parts)} {p} but needs query, key and value")
        timm_sd[f"blocks.{block}.attn.qkv.{p}"] = torch.cat([parts["query"], parts["key"], parts["value"]], dim=0)
    return fit_state_dict(timm_sd, cfg, resample=False, reset_head=reset_head)


def vit_config_from_hf(hf: Any, **overrides: Any) -> ViTConfig:
    """ViTConfig of an HF `transformers.ViTConfig` (object or dict)."""
    get = hf.get if isinstance(hf, dict) else (lambda k, d=None: getattr(hf, k, d))
    if get("hidden_act", "gelu") != "gelu":
        raise UserError(f"HF hidden_act {get('hidden_act')!r} is not supported; vitlab uses the exact GELU")
    id2label = get("id2label") or {}
    return ViTConfig.from_dict(
        {
            "img_size": get("image_size", 224),
            "patch_size": get("patch_size", 16),
            "in_chans": get("num_channels", 3),
            "num_classes": len(id2label) or get("num_labels", 0) or 0,
            "embed_dim": get("hidden_size", 768),
            "depth": get("num_hidden_layers", 12),
            "num_heads": get("num_attention_heads", 12),
            "mlp_ratio": get("intermediate_size", 3072) / get("hidden_size", 768),
            "qkv_bias": get("qkv_bias", True),
            "norm_eps": get("layer_norm_eps", 1e-12),
            **overrides,
        }
    )
