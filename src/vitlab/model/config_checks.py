"""ViTConfig's checks of its fields (config.py's __post_init__ calls them), without torch: the types YAML may have
parsed wrong (`check_types`), then the component names and the combinations they do not support (`check_choices`;
RoPE's and EVA's attention options in rope_config.py, NaFlex's in naflex_config.py). Each failure is a one-line
UserError naming the field and what it may be.
"""

from __future__ import annotations

from typing import Any

from vitlab.model.choices import (
    ACT_LAYERS,
    ATTN_LAYERS,
    BLOCK_FNS,
    BLOCK_KINDS,
    DROPOUTS,
    MLP_LAYERS,
    NORM_LAYERS,
    POS_EMBED_RESAMPLE,
    POS_EMBEDS,
    names_with,
)
from vitlab.model.naflex_config import check_naflex
from vitlab.model.rope_config import check_attention, check_rope
from vitlab.utils.errors import UserError

ViTConfig = Any  # (config.py imports this module: a ViTConfig, not imported here)


def check_choices(self: ViTConfig) -> None:
    """The component names, and the combinations they do not support."""
    components = (("act_layer", ACT_LAYERS), ("norm_layer", NORM_LAYERS), ("mlp_layer", MLP_LAYERS))
    components += (("attn_layer", ATTN_LAYERS),)
    for name, allowed in (*components, ("block_fn", BLOCK_FNS)):
        if getattr(self, name) not in allowed:
            raise UserError(f"{name} {getattr(self, name)!r} is not one of {list(allowed)}")
    block = BLOCK_KINDS[self.block_fn]
    if block.fused and (
        self.mlp_layer != "mlp" or self.attn_layer != "attn" or self.scale_attn_norm or self.scale_mlp_norm
    ):
        raise UserError(
            f"block_fn {self.block_fn!r} has its own fused attention and MLP: it takes attn_layer 'attn', "
            "mlp_layer 'mlp' and no scale_attn_norm / scale_mlp_norm"
        )
    if self.differential and (self.embed_dim // self.num_heads) % 2:
        head = self.embed_dim // self.num_heads
        raise UserError(f"differential attention halves each head: embed_dim / num_heads {head} must be even")
    if self.fix_init and not block.fix_init:
        raise UserError(
            f"fix_init scales the attention and MLP projections of block_fn {names_with(BLOCK_KINDS, 'fix_init')} only"
        )
    if self.mlp_layer == "swiglu_packed" and self.mlp_hidden % 2:
        raise UserError(
            f"mlp_layer 'swiglu_packed' splits its {self.mlp_hidden} hidden features in "
            "two halves: embed_dim * mlp_ratio (or mlp_hidden_dim) must be even"
        )
    if self.global_pool == "token" and not self.class_token:
        raise UserError("global_pool 'token' needs class_token=true; use global_pool 'avg' without it")
    if self.distilled and (self.global_pool != "token" or self.reg_tokens):
        raise UserError(
            f"distilled=true reads the class and distillation tokens (DeiT): it needs global_pool 'token' (got "
            f"{self.global_pool!r}) and no reg_tokens (got {self.reg_tokens})"
        )
    if self.pos_embed_resample not in POS_EMBED_RESAMPLE:
        raise UserError(f"pos_embed_resample {self.pos_embed_resample!r} is not one of {list(POS_EMBED_RESAMPLE)}")
    if self.pos_embed not in POS_EMBEDS:
        raise UserError(f"pos_embed {self.pos_embed!r} is not one of {list(POS_EMBEDS)}")
    if self.pos_embed in ("sincos2d", "sincos2d_mae") and self.embed_dim % 4:
        raise UserError(f"pos_embed {self.pos_embed!r} needs embed_dim divisible by 4, got {self.embed_dim}")
    if self.pos_embed == "sincos1d" and self.embed_dim % 2:
        raise UserError(f"pos_embed 'sincos1d' needs an even embed_dim, got {self.embed_dim}")
    check_attention(self)  # model/rope_config.py: EVA's attention options
    if self.rope != "":
        check_rope(self)  # (a rope that is not a string included)
    check_naflex(self)  # model/naflex_config.py


def check_types(self: ViTConfig) -> None:
    # Hydra hands over whatever YAML parsed; catch "depth: 12.5" or "qk_norm: yes please" here.
    ints = ("in_chans", "num_classes", "embed_dim", "depth", "num_heads", "reg_tokens")
    for name in ("mlp_hidden_dim", "attn_pool_num_heads"):
        v = getattr(self, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise UserError(f"{name} {v!r} must be a positive integer, or null")
    bools = ("qkv_bias", "qk_norm", "class_token", "distilled", "no_embed_class", "pre_norm", "dynamic_img_size",
             "dynamic_img_pad", "final_norm", "proj_bias", "embed_norm", "scale_attn_norm", "scale_mlp_norm",
             "pool_include_prefix", "fix_init", "drop_path_uniform", "qkv_fused", "qkv_bias_separate",
             "attn_only_layer_scale", "rope_rotate_half", "naflex")  # fmt: skip
    floats = ("mlp_ratio", "norm_eps", "rope_temperature", "rope_grid_offset", *DROPOUTS)
    for name in ints:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise UserError(f"{name} {v!r} must be an integer")
    for name in bools:
        if not isinstance(getattr(self, name), bool):
            raise UserError(f"{name} {getattr(self, name)!r} must be true or false")
    for name in floats:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(f"{name} {v!r} must be a number")
    g = self.grad_checkpointing
    if not (isinstance(g, bool) or g == "selective" or (isinstance(g, int) and g >= 1)):
        raise UserError(f"grad_checkpointing {g!r} must be true, false, N >= 1 (every N-th block) or selective")
    if not isinstance(g, bool) and isinstance(g, int) and isinstance(self.depth, int) and g > self.depth:
        raise UserError(
            f"grad_checkpointing {g} recomputes every {g}th block and the model has {self.depth}: none would be; "
            f"give N from 1 to {self.depth}, true (every block), false or selective"
        )
    if self.fc_norm is not None and not isinstance(self.fc_norm, bool):
        raise UserError(f"fc_norm {self.fc_norm!r} must be true, false or null")
