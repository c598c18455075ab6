"""timm's NaFlexVit (the `naflexvit` module) as ViTConfig fields, both ways, beside the plain ViT's table (timm_args):
`naflex_args(cfg, kwargs)` reads the NaFlexVitCfg and keywords timm's factory builds a NaFlexVit with, and
`naflex_timm_kwargs(cfg)` gives timm's for one of our configs (parity tests). The keys are timm's already
(model/naflex.py builds `embeds.*`), so the weights need no map."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from vitlab.model import ViTConfig
from vitlab.model.choices import DROPOUTS
from vitlab.utils.errors import UserError

# NaFlexVitCfg fields with the same meaning (and name) in ViTConfig
SAME = (
    "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "proj_bias", "init_values",
    "class_token", "reg_tokens", "global_pool", "pool_include_prefix", "weight_init", "fix_init", "dynamic_img_pad",
    "pre_norm", "final_norm", "scale_mlp_norm", "pos_embed_grid_size", "pos_embed_interp_mode",
    "pos_embed_ar_preserving", "pos_embed_antialias", "pos_embed_align_corners", "pos_embed_use_grid_sample",
    "act_layer", "norm_layer", "embed_norm_layer", "mlp_layer", "attn_layer", "block_fn", *DROPOUTS,
)  # fmt: skip
RENAMED = {"scale_attn_inner_norm": "scale_attn_norm"}
# RoPE (model/rope.py): NaFlexVitCfg's rope_type and the fields of the same name; with it (or attn_type 'eva' /
# 'rope') timm builds EvaBlocks, ours block_fn 'eva' (LayerScale as gamma_1 / gamma_2) with attn_type's attention.
ROPE_TYPES = {"axial": "axial", "mixed": "mixed", "dinov3": "dinov3"}
ROPE_SAME = ("rope_temperature", "rope_ref_feat_shape", "rope_grid_offset", "rope_grid_indexing", "rope_rotate_half",
             "rope_shift_coords", "rope_jitter_coords", "rope_rescale_coords")  # fmt: skip
# timm's attn_type in an EvaBlock -> its attention, by the class name timm_args.vitlab_args reads
EVA_ATTN = {"standard": "Attention", "rope": "Attention", "eva": "EvaAttention"}
POS_EMBED = {"learned": "learn", "factorized": "factorized", "none": "none", "": "none"}
# NaFlexVitCfg fields our ViT has no counterpart for here, with the value that means "off" (timm's default): MRoPE,
# grouped-query heads, EVA's SwiGLU, the patch-size interpolator, other patch layouts.
UNSUPPORTED = {
    "num_kv_heads": None, "use_key_only_attn_mask": False, "rope_type": ("", "none", *ROPE_TYPES),
    "attn_type": tuple(EVA_ATTN),
    "attn_gated": False, "swiglu_mlp": False, "qkv_fused": True, "attn_only_layer_scale": False,
    "enable_patch_interpolator": False, "patchify_channels_last": True, "embed_proj_type": "linear",
    "input_norm_layer": None, "attn_pool_num_heads": None, "attn_pool_mlp_ratio": None,
}  # fmt: skip


def is_naflex_config(cfg: Any) -> bool:
    """Whether timm's NaFlexVit builds the ViTConfig `cfg` (convert/timm_dir.py's families ask each in turn)."""
    return bool(cfg.naflex)


def naflex_class(build: Any) -> tuple[Any, str, Any]:
    """timm_args.timm_builds' row for timm's NaFlexVit: its module, its name there, and the stand-in that hands
    `build` its config and keywords as ours."""
    import timm.models.naflexvit as naflexvit

    return naflexvit, "NaFlexVit", lambda cfg=None, **kw: build(**naflex_args(cfg, kw))


def naflex_args(cfg: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """timm's NaFlexVit(cfg=NaFlexVitCfg, in_chans, num_classes, img_size, **overrides) as ViTConfig fields (timm's
    component names where timm_args.vitlab_args maps them); a UserError names what our ViT cannot express."""
    from timm.models.naflexvit import NaFlexVitCfg

    kwargs = dict(kwargs)
    fields = {f.name for f in dataclasses.fields(NaFlexVitCfg)}
    cfg = dataclasses.replace(cfg or NaFlexVitCfg(), **{k: kwargs.pop(k) for k in list(kwargs) if k in fields})
    for name, off in UNSUPPORTED.items():
        value = getattr(cfg, name)
        if value not in (off if isinstance(off, tuple) else (off,)):
            raise UserError(f"{name}={value!r}")
    out: dict[str, Any] = {name: getattr(cfg, name) for name in SAME if getattr(cfg, name) is not None}
    out.update({ours: getattr(cfg, theirs) for theirs, ours in RENAMED.items()})
    out.update(naflex=True, pos_embed=POS_EMBED[cfg.pos_embed])
    out.update(_rope_args(cfg))
    out["fc_norm"] = cfg.global_pool == "avg" if cfg.fc_norm is None else cfg.fc_norm  # NaFlexVit's default
    if cfg.embed_norm_layer is not None:  # timm's name for it (vitlab_args compares it with norm_layer)
        out["norm_layer"] = cfg.norm_layer or "layernorm"
    if isinstance(out.get("pos_embed_grid_size"), list):
        out["pos_embed_grid_size"] = tuple(out["pos_embed_grid_size"])
    img_size = kwargs.pop("img_size", None)
    if img_size is None:  # timm needs none when the table's grid is given: the grid's size in pixels
        if cfg.pos_embed_grid_size is None:
            raise UserError("neither img_size nor pos_embed_grid_size is given")
        ph, pw = (cfg.patch_size,) * 2 if isinstance(cfg.patch_size, int) else cfg.patch_size
        img_size = (cfg.pos_embed_grid_size[0] * ph, cfg.pos_embed_grid_size[1] * pw)
    return out | dict(img_size=img_size) | kwargs  # in_chans, num_classes, device, dtype


def naflex_timm_kwargs(cfg: ViTConfig) -> dict[str, Any]:
    """timm's NaFlexVit keywords (NaFlexVitCfg fields and its own) that build the same network as `cfg`."""
    from timm.layers import LayerNorm, RmsNorm

    theirs = {v: k for k, v in POS_EMBED.items() if k}
    norm = {"layernorm": LayerNorm, "rmsnorm": RmsNorm}[cfg.norm_layer]
    kw = {name: getattr(cfg, name) for name in SAME if hasattr(cfg, name) and name not in _COMPONENTS}
    kw |= dict(
        img_size=cfg.img_size, in_chans=cfg.in_chans, num_classes=cfg.num_classes, fc_norm=cfg.use_fc_norm,
        pos_embed=theirs[cfg.pos_embed], scale_attn_inner_norm=cfg.scale_attn_norm, act_layer=cfg.act_layer,
        norm_layer=partial(norm, eps=cfg.norm_eps),
        embed_norm_layer=partial(norm, eps=cfg.norm_eps) if cfg.embed_norm else None,
    )  # fmt: skip
    plain = cfg.attn_layer == "attn" and cfg.block_fn == "block" and not cfg.rope
    eva = cfg.block_fn == "eva" and cfg.attn_layer in ("attn", "eva")
    if cfg.mlp_layer != "mlp" or not (plain or eva):
        raise UserError("naflex_timm_kwargs: only the plain block (mlp, attn, block) or EVA's (mlp, attn or eva, eva; "
                        "with RoPE, eva) has a timm counterpart here")  # fmt: skip
    if eva:
        kw["attn_type"] = "eva" if cfg.attn_layer == "eva" else "rope"
    if cfg.rope:
        kw |= {name: getattr(cfg, name) for name in ROPE_SAME} | dict(rope_type=cfg.rope)
    return kw


def _rope_args(cfg: Any) -> dict[str, Any]:
    """NaFlexVitCfg's RoPE and EVA block fields as ViTConfig fields: EvaBlocks when timm builds them."""
    rope = ROPE_TYPES.get(cfg.rope_type, "")
    if not rope and cfg.attn_type == "standard":
        return {}
    out = dict(block_fn="EvaBlock", attn_layer=EVA_ATTN[cfg.attn_type])
    if rope:
        out |= {name: getattr(cfg, name) for name in ROPE_SAME} | dict(rope=rope)
        if out["rope_ref_feat_shape"] is not None:
            out["rope_ref_feat_shape"] = tuple(out["rope_ref_feat_shape"])
    return out


_COMPONENTS = ("act_layer", "norm_layer", "embed_norm_layer", "mlp_layer", "attn_layer", "block_fn")
