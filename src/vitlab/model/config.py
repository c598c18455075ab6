"""ViTConfig: every architectural choice of the network, with timm's argument names.

Sizes live in one table, `VARIANTS` (model/choices.py, with every component name a config accepts), keyed by the
paper's names. `ViTConfig.from_variant("B/16", img_size=384)` decodes a variant string the way big_vision does and
lets explicit keyword arguments override it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vitlab.model.choices import ATTENTION_KINDS, BLOCK_KINDS, DROPOUTS, GLOBAL_POOLS, WEIGHT_INITS, parse_variant
from vitlab.model.config_checks import check_choices, check_types
from vitlab.utils.errors import UnknownArgumentError, UnsupportedRequestError, UserError

MODEL_EXTRA_KEYS = ("variant", "timm_name", "pretrained", "resample_patch")  # the commands' model keys, not fields


def as_hw(size: Any, name: str = "size") -> tuple[int, int]:
    """An image or patch size as (height, width): an int n is (n, n), [h, w] or (h, w) is (h, w). Anything else
    is a UserError naming the value (`name` says which)."""
    if _is_int(size):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(_is_int(n) for n in size):
        return (size[0], size[1])
    raise UserError(f"{name} {size!r} must be an int or [height, width]")


def _is_int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


@dataclass
class ViTConfig:
    """Every choice the ViT is built from, with timm's argument names; `from_variant("B/16", ...)` takes a row of
    `VARIANTS`. Validated in `__post_init__`: a bad value is a one-line `ValueError` naming the field."""

    img_size: int | tuple[int, int] = 224  # int for square images, (H, W) otherwise
    patch_size: int | tuple[int, int] = 16  # int for square patches, (H, W) otherwise
    in_chans: int = 3  # input channels (1 for grey images)
    num_classes: int = 1000  # 0: no head, forward returns pooled features
    embed_dim: int = 768  # token width D (the variant's)
    depth: int = 12  # number of blocks
    num_heads: int = 12  # attention heads; embed_dim must divide by it
    mlp_ratio: float = 4.0  # the MLP's hidden width over embed_dim
    mlp_hidden_dim: int | None = None  # the MLP's hidden width (fc1's), else int(embed_dim * mlp_ratio) (timm's Eva)
    qkv_bias: bool = True  # biases of the query, key and value projections
    qkv_fused: bool = True  # one qkv projection; False: q_proj, k_proj, v_proj (timm's Eva and AttentionRope)
    qkv_bias_separate: bool = False  # attn_layer 'eva': the q/v biases added after the projection, not inside it
    # grouped-query attention (qkv_fused false): key/value heads, for every block or one per block (Sapiens2); None: H
    num_kv_heads: int | tuple[int, ...] | None = None
    qk_norm: bool = False  # a norm (norm_layer) on each head's queries and keys (ViT-22B)
    init_values: float | None = None  # LayerScale (CaiT); None switches it off
    attn_only_layer_scale: bool = False  # block_fn 'eva': LayerScale on the attention branch only (Sapiens2)
    class_token: bool = True  # a learned class token before the patches
    reg_tokens: int = 0  # "Vision Transformers Need Registers"
    distilled: bool = False  # DeiT's distillation token and second head (head_dist); the logits average both heads
    no_embed_class: bool = False  # position embedding for patches only (DeiT-III, big_vision)
    global_pool: str = "token"  # token | avg | max | avgmax | map (attention pool, SigLIP) | '' (every token)
    fc_norm: bool | None = None  # None: norm after pooling iff global_pool is avg/max/avgmax (as timm)
    final_norm: bool = True  # False: no norm after the blocks (nor fc_norm), as timm
    act_layer: str = "gelu"  # gelu (exact) | gelu_tanh | quick_gelu (CLIP) | silu
    norm_layer: str = "layernorm"  # layernorm | rmsnorm (every norm of the network, qk_norm's too)
    # attn | diff (differential attention, Ye et al. 2024) | eva (EVA's: no key bias, timm's q_bias / v_bias keys)
    attn_layer: str = "attn"
    mlp_layer: str = "mlp"  # mlp | swiglu (fc1_g, fc1_x) | swiglu_packed (one fc1, halves: act(a) * b)
    proj_bias: bool = True  # biases of the attention projection and the MLP's linear layers
    embed_norm: bool = False  # a norm (norm_layer) after the patch embedding (AIMv2)
    scale_attn_norm: bool = False  # a norm on the attention output before its projection (BEiT-3)
    scale_mlp_norm: bool = False  # a norm on the MLP's hidden features before fc2 (BEiT-3)
    pool_include_prefix: bool = False  # avg/max/avgmax/map pools over the prefix tokens too
    # block (pre-norm, the paper's) | parallel_scaling (ViT-22B: attention and MLP in parallel) |
    # diff_parallel_scaling (the same with differential attention and one output projection) | res_post
    # (post-norm residuals, Swin V2) | parallel_things (two attention, then two MLP branches, Touvron et al. 2022) |
    # eva (timm's EvaBlock: the pre-norm block with LayerScale as gamma_1 / gamma_2)
    block_fn: str = "block"
    pre_norm: bool = False  # LayerNorm before the blocks (CLIP); drops the patch-embedding bias
    # 'learn', 'sincos1d' (fixed, Vaswani's table over the tokens), 'sincos2d' (fixed, big_vision's, patches only),
    # 'sincos2d_mae' (fixed, MAE's frequencies, zero rows for the prefix tokens; its decoder's table follows) or 'none'
    pos_embed: str = "learn"
    # how a learned pos_embed is resampled to another grid (another image size, dynamic_img_size's batches): 'timm'
    # (timm's resample_abs_pos_embed) or 'dino' (DINO's and DINOv2's interpolate_pos_encoding: +0.1 in the scale
    # factor, no antialias), which their recipes and weights use (model/posemb.py)
    pos_embed_resample: str = "timm"
    # RoPE (Heo et al. 2024; EVA02, DINOv3) on the patch tokens' queries and keys, beside pos_embed or with 'none':
    rope: str = ""  # '' (off) | axial | mixed | dinov3 (model/rope.py), computed for each input's grid
    rope_temperature: float = 10_000.0  # axial/dinov3: the frequencies' (periods') base; mixed: its magnitudes'
    rope_ref_feat_shape: int | tuple[int, int] | None = None  # axial: positions rescaled to this grid (EVA02's)
    rope_grid_offset: float = 0.0  # added to every position (PE: 1)
    rope_grid_indexing: str = "ij"  # ij: channels (row, column); xy: (column, row) (rope-vit, PE)
    rope_rotate_half: bool = False  # rotate the halves of each head (DINOv3), not interleaved pairs
    rope_normalize_coords: str = "separate"  # dinov3: positions in [-1, 1] over each side, the shorter or longer
    rope_period_range: tuple[float, float] | None = None  # dinov3: (min, max) period instead of the temperature's
    rope_shift_coords: float | None = None  # training only: positions shifted by U(-s, s) (DINOv3's augmentation)
    rope_jitter_coords: float | None = None  # training only: each axis scaled by log-uniform [1/J, J]
    rope_rescale_coords: float | None = None  # training only: both axes scaled by log-uniform [1/R, R]
    attn_pool_num_heads: int | None = None  # global_pool 'map': its heads (None: num_heads)
    attn_pool_mlp_ratio: float | None = None  # global_pool 'map': its MLP's ratio (None: mlp_ratio)
    drop_rate: float = 0.0  # before the head
    pos_drop_rate: float = 0.0  # dropout after the position embedding is added
    patch_drop_rate: float = 0.0  # training drops this fraction of the patch tokens (FLIP; timm's PatchDropout)
    proj_drop_rate: float = 0.0  # dropout after the attention output projection and after each MLP layer
    attn_drop_rate: float = 0.0  # dropout on the attention weights
    drop_path_rate: float = 0.0  # stochastic depth, linear in depth from 0 to this value
    drop_path_uniform: bool = False  # every block at drop_path_rate instead (DINOv2's student.drop_path_uniform)
    dynamic_img_size: bool = False  # accept any input size, resampling pos_embed per batch
    dynamic_img_pad: bool = False  # pad inputs (right, bottom, zeros) to a multiple of patch_size, as timm
    norm_eps: float = 1e-6  # every norm's epsilon (timm's ViTs: 1e-6)
    # '' (timm's), 'jax', 'jax_nlhb' (head bias -log K), 'moco', 'mae' (MAE's models_mae.py), 'skip' (PyTorch's own)
    weight_init: str = ""
    fix_init: bool = False  # divide each block's output projections by sqrt(2 * (layer + 1)) (timm's fix_init)
    # Recompute blocks in the backward pass instead of keeping their activations: less memory (ViT-L/H), more time;
    # the same numbers. true: every block; N: every N-th block; "selective": every block keeps its matmul and
    # attention outputs and recomputes the rest. Not part of the architecture: a run may resume with it switched.
    grad_checkpointing: bool | int | str = False
    # NaFlex (timm's naflexvit; model/naflex.py): timm's `embeds.*`, each image's grid, images or NaFlex's dict
    naflex: bool = False
    pos_embed_grid_size: tuple[int, int] | None = None  # naflex: the table's grid (None: img_size // patch_size)
    pos_embed_interp_mode: str = "bicubic"  # naflex: bicubic | bilinear, the resampling to an image's grid
    pos_embed_ar_preserving: bool = False  # naflex: resample to a square of the longer side, crop top-left
    pos_embed_antialias: bool = True  # naflex: antialias when the table is shrunk
    pos_embed_align_corners: bool = False  # naflex: align_corners of the resampling
    pos_embed_use_grid_sample: bool = False  # naflex: sample the table at each patch's coordinates (grid_sample)
    grid_size: tuple[int, int] = field(init=False)  # derived: patches along H and W

    def __post_init__(self) -> None:
        for name in ("rope_ref_feat_shape", "rope_period_range", "num_kv_heads"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        for name in ("img_size", "patch_size"):  # [h, w] from YAML is a tuple from here on (in messages too)
            size = getattr(self, name)
            if isinstance(size, (list, tuple)) and len(size) == 2:
                setattr(self, name, tuple(size))
            as_hw(getattr(self, name), name)  # an int or a pair of ints
        ph, pw = self.patch_hw
        if ph == pw:
            self.patch_size = ph  # a square patch is an int (timm's patch_size=16); img_size keeps its pair
        check_types(self)  # model/config_checks.py
        for name in ("in_chans", "embed_dim", "depth", "num_heads"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} {getattr(self, name)} must be >= 1")
        if min(self.patch_hw) < 1:
            raise UserError(f"patch_size {self.patch_size} must be >= 1")
        for name in ("num_classes", "reg_tokens"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} {getattr(self, name)} must be >= 0")
        h, w = self.img_hw
        if h < 1 or w < 1:
            raise UserError(f"img_size {self.img_size} must be positive")
        ph, pw = self.patch_hw
        if h % ph or w % pw:
            raise UserError(f"img_size {self.img_size} is not divisible by patch_size {self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise UserError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.mlp_ratio <= 0:
            raise UserError(f"mlp_ratio {self.mlp_ratio} must be > 0")
        if self.global_pool is None:
            self.global_pool = ""
        self.rope = "" if self.rope is None else self.rope  # (YAML's null: no RoPE)
        if self.global_pool not in GLOBAL_POOLS:
            # (an AssertionError too, as timm's VisionTransformer asserts the pool: timm's tests expect one)
            raise UnsupportedRequestError(
                f"global_pool {self.global_pool!r} is not one of {list(GLOBAL_POOLS)} ('' = none)"
            )
        check_choices(self)
        if self.weight_init not in WEIGHT_INITS:
            raise UserError(f"weight_init {self.weight_init!r} is not one of {list(WEIGHT_INITS)}")
        for name in DROPOUTS:
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise UserError(f"{name} {p} must be in [0, 1)")
        if self.init_values is not None and self.init_values <= 0:
            raise UserError(f"init_values {self.init_values} must be > 0, or null to switch LayerScale off")
        if self.norm_eps <= 0:
            raise UserError(f"norm_eps {self.norm_eps} must be > 0")
        self.grid_size = (h // ph, w // pw)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def img_hw(self) -> tuple[int, int]:
        """img_size as (height, width)."""
        return as_hw(self.img_size, "img_size")

    @property
    def patch_hw(self) -> tuple[int, int]:
        """patch_size as (height, width)."""
        return as_hw(self.patch_size, "patch_size")

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width (fc1's output): mlp_hidden_dim, else int(embed_dim * mlp_ratio)."""
        return self.mlp_hidden_dim or int(self.embed_dim * self.mlp_ratio)

    @property
    def num_patches(self) -> int:
        """Patch tokens of an img_size image: grid_size's product."""
        return self.grid_size[0] * self.grid_size[1]

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: the class token, DeiT's distillation token, the registers."""
        return int(self.class_token) + int(self.distilled) + self.reg_tokens

    @property
    def differential(self) -> bool:
        """Whether attention is differential (Ye et al. 2024): attn_layer 'diff', or its parallel block."""
        attn, block = ATTENTION_KINDS.get(self.attn_layer), BLOCK_KINDS.get(self.block_fn)
        return any(kind is not None and kind.differential for kind in (attn, block))

    @property
    def use_fc_norm(self) -> bool:
        """Whether a norm follows the pool (fc_norm, or by its None rule) instead of the blocks' final norm."""
        return self.global_pool in ("avg", "max", "avgmax") if self.fc_norm is None else self.fc_norm

    @property
    def embeds_prefix(self) -> bool:
        """Whether pos_embed has rows for the class/register tokens (timm's original layout; never NaFlex's)."""
        return self.pos_embed in ("learn", "sincos1d", "sincos2d_mae") and not self.no_embed_class and not self.naflex

    @property
    def pos_prefix_rows(self) -> int:
        """pos_embed's rows for the class/register tokens: all of them in timm's original layout, else none."""
        return self.num_prefix_tokens if self.embeds_prefix else 0

    # ---- construction and plain-data round trip -------------------------------------------------
    @classmethod
    def from_variant(cls, variant: str | None = None, **overrides: Any) -> ViTConfig:
        """Sizes from `VARIANTS` (e.g. 'S/16'), then explicit overrides; None overrides are ignored
        for the fields the variant sets, so a config file can leave them open (mlp_ratio None: 4 without one)."""
        kwargs: dict[str, Any] = {}
        if variant:
            kwargs.update(parse_variant(variant))
            overrides = {k: v for k, v in overrides.items() if not (k in kwargs and v is None)}
        if overrides.get("mlp_ratio", 0) is None:
            overrides = {k: v for k, v in overrides.items() if k != "mlp_ratio"}
        kwargs.update(overrides)
        return cls.from_dict(kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        """A config from plain data (a checkpoint's, `to_dict`'s); an unknown key is refused, naming the allowed."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UnknownArgumentError(f"unknown model key(s) {unknown}; allowed: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (no tuples, no derived fields): what a checkpoint stores."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}  # (sizes, grids: YAML's lists)

    def replace(self, **changes: Any) -> ViTConfig:
        """A copy with these fields changed, validated anew (derived values recomputed)."""
        return ViTConfig.from_dict({**self.to_dict(), **changes})

    # ---- cost model -----------------------------------------------------------------------------
    def num_tokens(self) -> int:
        """Tokens the blocks see at img_size: patches and prefix tokens."""
        return self.num_patches + self.num_prefix_tokens

    def flops_per_image(self) -> int:
        """Forward FLOPs of one image as `ViT.forward` computes them (model/cost.py)."""
        from vitlab.model.cost import flops_per_image

        return flops_per_image(self)

    def block_flops(self, n: int, rows: int) -> int:
        """Forward FLOPs of one block on n tokens of which the first `rows` are updated (model/cost.py)."""
        from vitlab.model.cost import block_flops

        return block_flops(self, n, rows)


def vit_config(model: Mapping[str, Any]) -> ViTConfig:
    """A config's model group (a mapping, YAML's or Hydra's) -> ViTConfig: sizes from `variant`, then the
    explicit fields; the group's other keys (MODEL_EXTRA_KEYS) are left to the commands."""
    fields = {k: _plain(v) for k, v in model.items() if k not in MODEL_EXTRA_KEYS}
    return ViTConfig.from_variant(model.get("variant"), **fields)


def _plain(value: Any) -> Any:
    """A YAML list (OmegaConf's ListConfig is a Sequence, not a list) as a list."""
    return [_plain(v) for v in value] if isinstance(value, Sequence) and not isinstance(value, str) else value
