"""The RoPE choices of ViTConfig (config.py) and what contradicts them, without torch (model/rope.py builds them),
and the check of grouped-query attention's key/value heads (the other option timm's Eva brought).

RoPE rotates pairs of channels of each head by angles that grow with the patch's row and column (Su et al. 2021;
for images Heo et al. 2024 "Rotary Position Embedding for Vision Transformer", EVA02, DINOv3). The choices follow
timm's Eva arguments (timm.layers.pos_embed_sincos): `axial` is RotaryEmbeddingCat (fixed frequencies per axis,
EVA02's rescale to `rope_ref_feat_shape`), `mixed` RotaryEmbeddingMixed (learned frequencies per block and head,
rope-vit's RoPE-Mixed), `dinov3` RotaryEmbeddingDinoV3 (positions in [-1, 1], periods, training-time coordinate
augmentations).
"""

from __future__ import annotations

import math
from typing import Any

from vitlab.model.choices import ATTENTION_KINDS, BLOCK_KINDS, attention_names, names_with
from vitlab.utils.errors import UserError

ViTConfig = Any  # (config.py imports this module: a ViTConfig, not imported here)

# config.py's rope: '' none | axial (timm's RotaryEmbeddingCat: EVA02,
# rope-vit, PE) | mixed (learned per-head frequencies, RotaryEmbeddingMixed) | dinov3 (RotaryEmbeddingDinoV3)
ROPES = ("", "axial", "mixed", "dinov3")
ROPE_GRID_INDEXING = ("ij", "xy")
ROPE_NORMALIZE_COORDS = ("separate", "min", "max")
ROPE_AUGMENTATIONS = ("rope_shift_coords", "rope_jitter_coords", "rope_rescale_coords")


def check_rope(self: ViTConfig) -> None:
    """RoPE rotates pairs of channels of each head along two axes: what contradicts it is refused."""
    head = self.embed_dim // self.num_heads
    if self.rope not in ROPES:
        raise UserError(f"rope {self.rope!r} is not one of {list(ROPES)} ('' = none)")
    if head % 4:
        raise UserError(
            f"rope {self.rope!r} rotates channel pairs along two axes: embed_dim / num_heads {head} "
            f"(embed_dim {self.embed_dim}, num_heads {self.num_heads}) must be divisible by 4"
        )
    if self.pos_embed == "sincos1d":
        raise UserError("rope with pos_embed 'sincos1d' (a 1-D table over the tokens): use pos_embed 'none', "
                            "'learn', 'sincos2d' or 'sincos2d_mae' beside it")  # fmt: skip
    if BLOCK_KINDS[self.block_fn].fused or not ATTENTION_KINDS[self.attn_layer].rope:
        raise UserError(
            f"rope rotates the queries and keys of attn_layer {attention_names('rope')} in block_fn "
            f"{names_with(BLOCK_KINDS, 'fused', False)}, not {self.attn_layer!r} in {self.block_fn!r}"
        )
    for name, allowed in (("rope_grid_indexing", ROPE_GRID_INDEXING),
                              ("rope_normalize_coords", ROPE_NORMALIZE_COORDS)):  # fmt: skip
        if getattr(self, name) not in allowed:
            raise UserError(f"{name} {getattr(self, name)!r} is not one of {list(allowed)}")
    ref = self.rope_ref_feat_shape
    if ref is not None and self.rope != "axial":
        raise UserError(f"rope_ref_feat_shape {ref!r} is the grid axial RoPE's positions are rescaled to: it needs "
                        f"rope 'axial' (got rope {self.rope!r})")  # fmt: skip
    if ref is not None and not _positive_pair(ref):
        raise UserError(f"rope_ref_feat_shape {ref!r} must be a grid of positive sizes: an int n or [height, width]")
    if self.rope == "mixed" and self.rope_rotate_half:
        raise UserError("rope 'mixed' rotates interleaved channel pairs: rope_rotate_half must be false")
    periods = self.rope_period_range
    if periods is not None and (self.rope != "dinov3" or len(periods) != 2 or not 0 < periods[0] <= periods[1]):
        raise UserError(f"rope_period_range {periods!r} must be [min, max] with 0 < min <= max, with rope 'dinov3'")
    if self.rope_temperature <= 0:
        raise UserError(f"rope_temperature {self.rope_temperature} must be > 0")
    for name, least in zip(ROPE_AUGMENTATIONS, (0.0, 1.0, 1.0), strict=True):
        v = getattr(self, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not least <= v < math.inf):
            raise UserError(f"{name} {v!r} must be a finite number >= {least:g}, or null (off)")


def _positive_pair(size: Any) -> bool:
    """An int n >= 1 or a pair of them (a grid, as config.as_hw reads one)."""
    sizes = [size] if isinstance(size, int) else list(size) if isinstance(size, (list, tuple)) else [None, None, None]
    return (len(sizes) == 2 or isinstance(size, int)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes
    )


def check_kv_heads(self: ViTConfig) -> None:
    """Grouped-query attention (num_kv_heads): each block's key/value heads divide the query heads, on q_proj /
    k_proj / v_proj apart (timm's AttentionRope)."""
    kv = self.num_kv_heads
    heads = [kv] * self.depth if isinstance(kv, int) and not isinstance(kv, bool) else kv
    ok = isinstance(heads, (list, tuple)) and len(heads) == self.depth
    if not ok or not all(isinstance(h, int) and h >= 1 and self.num_heads % h == 0 for h in heads):
        raise UserError(f"num_kv_heads {kv!r} must divide num_heads {self.num_heads}: an int, or one per block "
                        f"({self.depth}), or null")  # fmt: skip
    if self.qkv_fused or not ATTENTION_KINDS[self.attn_layer].kv_heads:
        raise UserError(f"num_kv_heads {kv!r} (grouped-query attention) needs qkv_fused false and attn_layer "
                        f"{attention_names('kv_heads')}")  # fmt: skip


def check_attention(self: ViTConfig) -> None:
    """EVA's attention options against the rest: attn_layer 'eva', grouped-query heads, q/k/v apart or fused."""
    if self.attn_layer == "eva" and BLOCK_KINDS[self.block_fn].fused:
        raise UserError(f"attn_layer 'eva' is a separate attention: block_fn {self.block_fn!r} has its own")
    if self.num_kv_heads is not None:
        check_kv_heads(self)
    kind = ATTENTION_KINDS[self.attn_layer]
    if self.qkv_bias_separate and (not kind.separate_bias or not self.qkv_fused):
        raise UserError(f"qkv_bias_separate adds attn_layer {attention_names('separate_bias')}'s q/v biases after its "
                        "fused qkv projection only")  # fmt: skip
    if not self.qkv_fused and (not kind.unfused or BLOCK_KINDS[self.block_fn].fused):
        raise UserError(f"qkv_fused false (q_proj, k_proj, v_proj) is for attn_layer {attention_names('unfused')}, "
                        f"not {self.attn_layer!r} in block_fn {self.block_fn!r}")  # fmt: skip
