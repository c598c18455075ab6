"""The names a config accepts, each defined once and without torch (reading a config must not import it): the sizes
(`VARIANTS`, keyed by the paper's names: Dosovitskiy et al. 2021, Table 1; Ti from DeiT), the component names as timm
spells them, and what the rest of the code needs to know of each attention and block kind (`ATTENTION_KINDS`,
`BLOCK_KINDS`). The tables that
build the components (layers.py, attention.py, blocks.py, init.py, posemb.py) need torch;
tests/model/test_layout_components.py ties each of them to its names here.
"""

from __future__ import annotations

from typing import NamedTuple

from vitlab.utils.errors import UserError

# width, depth, heads; MLP ratio 4 (ViT paper Table 1; Ti from DeiT Table 1), except giant and gigantic: their MLP
# widths 6144 and 8192 (Zhai et al. 2022, "Scaling Vision Transformers", Table 2; timm's vit_giant_patch14_224 and
# vit_gigantic_patch14_224).
VARIANTS: dict[str, dict[str, float]] = {
    "Ti": dict(embed_dim=192, depth=12, num_heads=3),
    "S": dict(embed_dim=384, depth=12, num_heads=6),
    "B": dict(embed_dim=768, depth=12, num_heads=12),
    "L": dict(embed_dim=1024, depth=24, num_heads=16),
    "H": dict(embed_dim=1280, depth=32, num_heads=16),
    "g": dict(embed_dim=1408, depth=40, num_heads=16, mlp_ratio=48 / 11),
    "G": dict(embed_dim=1664, depth=48, num_heads=16, mlp_ratio=64 / 13),
}


def parse_variant(variant: str) -> dict[str, float]:
    """'B/16' -> dict(embed_dim=768, depth=12, num_heads=12, patch_size=16)."""
    name, _, patch = variant.partition("/")
    if name not in VARIANTS or not patch.isdigit():
        raise UserError(f"variant {variant!r} is not of the form <size>/<patch> with size in {list(VARIANTS)}")
    return dict(VARIANTS[name], patch_size=int(patch))


class AttentionKind(NamedTuple):
    """What the config's checks and the conversions need to know of an attention kind (its class: attention.py)."""

    rope: bool  # RoPE rotates its queries and keys (model/rope.py)
    unfused: bool  # takes q_proj / k_proj / v_proj apart (qkv_fused false)
    kv_heads: bool  # takes fewer key/value heads (num_kv_heads, grouped-query attention)
    separate_bias: bool  # its q/v biases may be added after the fused projection (qkv_bias_separate)
    differential: bool  # differential attention (Ye et al. 2024): its heads are halved
    timm: tuple[str, ...] = ()  # timm VisionTransformer's attn_layer: the name it reads, then its class's, lower case
    eva_type: str | None = None  # timm Eva's attn_type for it


# attn_layer: attn (softmax; timm's Attention / AttentionRope) | diff (differential attention, timm's DiffAttention) |
# eva (EVA's: no key bias, timm's q_bias / v_bias keys; EvaAttention)
ATTENTION_KINDS = {
    "attn": AttentionKind(rope=True, unfused=True, kv_heads=True, separate_bias=False, differential=False,
                          timm=("attn", "attention"), eva_type="rope"),
    "diff": AttentionKind(rope=False, unfused=False, kv_heads=False, separate_bias=False, differential=True,
                          timm=("diff", "diffattention")),
    "eva": AttentionKind(rope=True, unfused=True, kv_heads=False, separate_bias=True, differential=False,
                         eva_type="eva"),
}  # fmt: skip


class BlockKind(NamedTuple):
    """What the config's checks and the cost model need to know of a block kind (its class: blocks.py)."""

    fused: bool  # its own attention and MLP from one input projection (ViT-22B's): no attn_layer / mlp_layer choice
    differential: bool = False  # its attention is differential (its heads are halved)
    fix_init: bool = True  # timm's fix_init scales its attention and MLP output projections
    branches: int = 1  # attention and MLP branches side by side (Touvron et al. 2022: two)


# block_fn: block (pre-norm, the paper's) | parallel_scaling (ViT-22B: attention and MLP in parallel) |
# diff_parallel_scaling (the same with differential attention and one output projection) | res_post (post-norm
# residuals, Swin V2) | parallel_things (two attention, then two MLP branches) | eva (timm's EvaBlock)
BLOCK_KINDS = {
    "block": BlockKind(fused=False),
    "parallel_scaling": BlockKind(fused=True, fix_init=False),
    "diff_parallel_scaling": BlockKind(fused=True, differential=True, fix_init=False),
    "res_post": BlockKind(fused=False),
    "parallel_things": BlockKind(fused=False, fix_init=False, branches=2),
    "eva": BlockKind(fused=False),
}


def names_with(table: dict[str, NamedTuple], trait: str, value: bool = True) -> str:
    """The names of `table` (ATTENTION_KINDS, BLOCK_KINDS) whose `trait` is `value`, as a message lists them:
    "'block', 'res_post' or 'eva'"."""
    names = [repr(n) for n, kind in table.items() if getattr(kind, trait) == value]
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def attention_names(trait: str) -> str:
    """The attention kinds that have `trait`, as a message names them: "'attn' or 'eva'"."""
    return names_with(ATTENTION_KINDS, trait)


GLOBAL_POOLS = ("token", "avg", "max", "avgmax", "map", "")
ACT_LAYERS = ("gelu", "gelu_tanh", "quick_gelu", "silu")
NORM_LAYERS = ("layernorm", "rmsnorm")
MLP_LAYERS = ("mlp", "swiglu", "swiglu_packed")
ATTN_LAYERS = tuple(ATTENTION_KINDS)
BLOCK_FNS = tuple(BLOCK_KINDS)
POS_EMBEDS = ("learn", "sincos1d", "sincos2d", "sincos2d_mae", "factorized", "none")
POS_EMBED_RESAMPLE = ("timm", "dino")  # how a learned one is resampled (model/posemb.py: resample_grid)
# The regularisation fields: probabilities in [0, 1), free to change when a run is resumed.
DROPOUTS = ("drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")
WEIGHT_INITS = ("", "jax", "jax_nlhb", "moco", "mae", "eva", "skip")  # timm's modes, MAE's and timm's Eva's
