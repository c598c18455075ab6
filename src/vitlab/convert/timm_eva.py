"""timm's `eva` module (timm.models.eva.Eva: EVA, EVA02, rope-vit, Perception Encoder, DINOv3, LingBot, Sapiens2)
through vitlab's ViT: Eva's arguments as ViTConfig fields (one table, `eva_config`), the arguments our ViT does not
build and why (EVA_REFUSED), and the other way (`eva_kwargs`). DINOv3's released backbone files are convert/dinov3.py's.
Eva's state-dict keys are ours for the same config (attn_layer 'eva': q_bias / v_bias; block_fn 'eva': gamma_1 /
gamma_2; rope 'mixed': rope.freqs), so a file of either loads into the other.
"""

from __future__ import annotations

from typing import Any

from vitlab.model.choices import ATTENTION_KINDS
from vitlab.model.config import ViTConfig
from vitlab.utils.errors import UnknownArgumentError, UserError

# Eva's arguments that are ViTConfig fields of the same name and meaning
EVA_SAME = (
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads", "qkv_bias",
    "qkv_fused", "qk_norm", "mlp_ratio", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
    "attn_drop_rate", "drop_path_rate", "init_values", "class_token", "no_embed_class", "dynamic_img_size",
    "dynamic_img_pad", "attn_pool_num_heads", "attn_pool_mlp_ratio", "attn_only_layer_scale", "rope_grid_offset",
    "rope_grid_indexing", "rope_temperature", "rope_rotate_half", "rope_shift_coords", "rope_jitter_coords",
    "rope_rescale_coords", "num_kv_heads",
)  # fmt: skip
EVA_RENAMED = {
    "num_reg_tokens": "reg_tokens",  # DINOv3's storage tokens, placed after the class token as timm places them
    "scale_mlp": "scale_mlp_norm",  # EVA02's sub-LN in the MLP (NormFormer)
    "scale_attn_inner": "scale_attn_norm",  # EVA02-CLIP's norm of the attention output
    "use_pre_transformer_norm": "pre_norm",  # PE's norm before the blocks
    "ref_feat_shape": "rope_ref_feat_shape",
}
# Eva's arguments that decide several fields (eva_config reads them)
EVA_DERIVED = (
    "attn_type", "swiglu_mlp", "swiglu_align_to", "norm_layer", "use_abs_pos_emb", "use_rot_pos_emb", "rope_type",
    "use_post_norm", "use_post_transformer_norm", "use_fc_norm", "head_init_scale",
    "rope_mrope_section",
)  # fmt: skip
# Arguments our ViT does not build, with the values that mean "not used", and why (the docs' list of names left out)
EVA_REFUSED = {
    "rope_type": "rope_type 'mrope' (Qwen2-VL's multimodal RoPE) and 'base'",
    "rope_mrope_section": "MRoPE's sections",
    "head_init_scale": "a head init scale other than Eva's 0.001",
    "attn_type": "attention other than 'eva' and 'rope'",
}
ROPE_TYPES = {"cat": "axial", "mixed": "mixed", "dinov3": "dinov3"}  # Eva's rope_type -> our rope
# Eva's attn_type (EvaAttention, AttentionRope) -> our attn_layer
ATTN_TYPES = {kind.eva_type: name for name, kind in ATTENTION_KINDS.items() if kind.eva_type}


def eva_config_fields(arch: str, args: dict[str, Any]) -> dict[str, Any]:
    """timm's Eva arguments `args` (of architecture `arch`) as ViTConfig fields. A keyword Eva does not take is an
    UnknownArgumentError (a TypeError, as Eva's constructor raises), one our ViT does not build a UserError."""
    unknown = sorted(set(args) - set(EVA_SAME) - set(EVA_RENAMED) - set(EVA_DERIVED))
    if unknown:
        raise UnknownArgumentError(
            f"timm's {arch} (an Eva of timm's eva module) takes no argument {unknown[0]}={args[unknown[0]]!r}"
        )
    a = (
        dict(
            attn_type="eva",
            swiglu_mlp=False,
            swiglu_align_to=0,
            use_abs_pos_emb=True,
            use_rot_pos_emb=False,
            rope_type="cat",
            use_post_norm=False,
            global_pool="avg",
            head_init_scale=0.001,
            embed_dim=768,
            num_heads=12,
            depth=12,
            mlp_ratio=4.0,
        )
        | args
    )  # fmt: skip  (Eva's defaults where ours differ)
    out = {key: a[key] for key in EVA_SAME if key in a} | {ours: a[k] for k, ours in EVA_RENAMED.items() if k in a}
    _refuse(a)
    out.update(_norm(a.get("norm_layer", "layernorm")), weight_init="eva", fix_init=True)
    out["attn_layer"] = ATTN_TYPES[a["attn_type"]]
    out["block_fn"] = "res_post" if a["use_post_norm"] else "eva"
    if a["use_post_norm"]:
        out["init_values"] = None  # (Eva's post-norm block ignores it)
    out.update(_mlp(a))
    out["pos_embed"] = "learn" if a["use_abs_pos_emb"] else "none"
    out.update(_rope(a))
    out.update(_norms(a))
    out["pool_include_prefix"] = a["global_pool"] == "map"  # Eva's attention pool reads every token
    kv = a.get("num_kv_heads")
    if kv is not None and not isinstance(kv, int):
        kv = tuple(kv)  # (one per block, Sapiens2's; all of them num_heads: plain multi-head attention)
    out["num_kv_heads"] = None if kv is None or set(kv if isinstance(kv, tuple) else (kv,)) == {a["num_heads"]} else kv
    return out


def _norm(value: Any) -> dict[str, Any]:
    """Eva's norm_layer (timm's LayerNorm or RmsNorm, a partial with its eps, or a name) as norm_layer and norm_eps."""
    kind = getattr(value, "func", value)
    name = (kind if isinstance(kind, str) else getattr(kind, "__name__", type(kind).__name__)).lower()
    if name not in ("layernorm", "rmsnorm"):
        raise UserError(f"norm_layer={name!r}")
    return dict(norm_layer=name, norm_eps=getattr(value, "keywords", {}).get("eps", 1e-6))


def _refuse(a: dict[str, Any]) -> None:
    if a.get("use_rot_pos_emb") and a["rope_type"] not in ROPE_TYPES:
        raise UserError(f"rope_type={a['rope_type']!r}: {EVA_REFUSED['rope_type']}")
    if a.get("rope_mrope_section") is not None:
        raise UserError(f"rope_mrope_section={a['rope_mrope_section']!r}: {EVA_REFUSED['rope_mrope_section']}")
    if a["head_init_scale"] != 0.001:
        raise UserError(f"head_init_scale={a['head_init_scale']!r}: {EVA_REFUSED['head_init_scale']}")
    if a["attn_type"] not in ATTN_TYPES:
        raise UserError(f"attn_type={a['attn_type']!r}: {EVA_REFUSED['attn_type']}")


def _mlp(a: dict[str, Any]) -> dict[str, Any]:
    """Eva's MLP: GELU Mlp; SwiGLU (SiLU) with fc1_g / fc1_x when it has the sub-LN (scale_mlp) or an aligned width
    (swiglu_align_to, DINOv3's), else packed in one fc1 of twice the width (timm's GluMlp)."""
    if not a["swiglu_mlp"]:
        return dict(mlp_layer="mlp", act_layer="gelu")
    hidden, align = int(a["embed_dim"] * a["mlp_ratio"]), a["swiglu_align_to"]
    separate = a.get("scale_mlp", False) or (align and not a["use_post_norm"])  # (the post-norm block: scale_mlp only)
    if separate:
        return dict(mlp_layer="swiglu", act_layer="silu", mlp_hidden_dim=hidden + (-hidden % align if align else 0))
    return dict(mlp_layer="swiglu_packed", act_layer="silu", mlp_hidden_dim=2 * hidden)


def _rope(a: dict[str, Any]) -> dict[str, Any]:
    """Eva's RoPE arguments; those its RoPE type ignores are dropped, as timm's create_rope_embed drops them."""
    if not a["use_rot_pos_emb"]:
        return dict(rope="", rope_ref_feat_shape=None)
    kind = ROPE_TYPES[a["rope_type"]]
    out = dict(rope=kind)
    if kind != "axial":
        out["rope_ref_feat_shape"] = None
    if kind == "mixed":
        out["rope_grid_offset"] = 0.0
    return out


def _norms(a: dict[str, Any]) -> dict[str, Any]:
    """Eva's norms after the blocks: fc_norm (default: under avg pooling) and the final norm (default: without
    fc_norm); our ViT has one or the other."""
    fc = a["use_fc_norm"] if a.get("use_fc_norm") is not None else a["global_pool"] == "avg"
    post = a["use_post_transformer_norm"] if a.get("use_post_transformer_norm") is not None else not fc
    if fc and post:
        raise UserError("use_post_transformer_norm=True with use_fc_norm=True (a norm both before and after pooling)")
    return dict(fc_norm=fc, final_norm=fc or post)


# ---- the other way: a config's Eva arguments ------------------------------------------------------------------------

# ViTConfig fields only an Eva has, with their "off" values: a config that sets one is an Eva's (timm_kwargs refuses it)
EVA_ONLY_FIELDS = dict(mlp_hidden_dim=None, qkv_fused=True, qkv_bias_separate=False, attn_only_layer_scale=False,
                       rope="", attn_pool_num_heads=None, attn_pool_mlp_ratio=None, num_kv_heads=None)  # fmt: skip


def is_eva_config(cfg: ViTConfig) -> bool:
    """Whether only timm's Eva (not its VisionTransformer) builds `cfg`'s network."""
    own = any(getattr(cfg, k) != v for k, v in EVA_ONLY_FIELDS.items())
    return own or "eva" in (cfg.attn_layer, cfg.block_fn, cfg.weight_init)


def eva_kwargs(cfg: ViTConfig) -> dict[str, Any]:
    """Arguments of timm's Eva that build the same network as `cfg` (parity tests, benchmarks, export); a config
    Eva cannot build is a UserError naming the field."""
    from functools import partial

    from timm.layers import LayerNorm, RmsNorm

    def refuse(why: str) -> None:
        raise UserError(f"timm's Eva cannot build this config: {why}")

    if cfg.block_fn not in ("eva", "res_post") or cfg.attn_layer not in ATTN_TYPES.values() or cfg.distilled:
        refuse(f"block_fn {cfg.block_fn!r} / attn_layer {cfg.attn_layer!r} (Eva's: 'eva' or 'res_post' / 'eva' or "
               "'attn'), distilled false")  # fmt: skip
    if cfg.pos_embed not in ("learn", "none") or cfg.pool_include_prefix != (cfg.global_pool == "map"):
        refuse(f"pos_embed {cfg.pos_embed!r} (Eva's: learn or none), pool_include_prefix {cfg.pool_include_prefix}")
    if cfg.qkv_bias_separate or cfg.rope_normalize_coords != "separate" or cfg.rope_period_range is not None:
        refuse("qkv_bias_separate, rope_normalize_coords and rope_period_range are not Eva's arguments")
    if cfg.act_layer != ("gelu" if cfg.mlp_layer == "mlp" else "silu") or cfg.embed_norm or not cfg.proj_bias:
        refuse(f"act_layer {cfg.act_layer!r} with mlp_layer {cfg.mlp_layer!r}, embed_norm, proj_bias")
    d = {k: getattr(cfg, k) for k in EVA_SAME} | {theirs: getattr(cfg, ours) for theirs, ours in EVA_RENAMED.items()}
    d.update(
        img_size=cfg.img_hw, patch_size=cfg.patch_hw, attn_type={v: k for k, v in ATTN_TYPES.items()}[cfg.attn_layer]
    )
    d.update(use_post_norm=cfg.block_fn == "res_post", use_abs_pos_emb=cfg.pos_embed == "learn")
    d.update(use_rot_pos_emb=bool(cfg.rope), rope_type={v: k for k, v in ROPE_TYPES.items()}.get(cfg.rope, "cat"))
    d.update(
        use_fc_norm=cfg.use_fc_norm and cfg.final_norm, use_post_transformer_norm=cfg.final_norm and not cfg.use_fc_norm
    )
    d["norm_layer"] = partial(LayerNorm if cfg.norm_layer == "layernorm" else RmsNorm, eps=cfg.norm_eps)
    hidden = cfg.mlp_hidden // (2 if cfg.mlp_layer == "swiglu_packed" else 1)
    d.update(swiglu_mlp=cfg.mlp_layer != "mlp", mlp_ratio=hidden / cfg.embed_dim)
    if int(cfg.embed_dim * d["mlp_ratio"]) != hidden:
        refuse(f"an MLP of {hidden} hidden features is no int(embed_dim * mlp_ratio)")
    if cfg.mlp_layer == "swiglu" and not cfg.scale_mlp_norm:
        d["swiglu_align_to"] = hidden  # (Eva builds fc1_g / fc1_x with the sub-LN or an alignment; this one is exact)
    return d
