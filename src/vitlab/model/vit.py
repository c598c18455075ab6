"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021): the core.

Reads top to bottom: input helpers -> the config read into each layer's arguments -> constructor -> embed -> blocks
-> forward_features -> forward_head -> forward -> attention maps -> position-embedding resampling on load. This is
where ViTConfig is read: its components (the tables a config picks from, in layers.py, attention.py and blocks.py)
take the arguments they use, as timm's and dinov2's layers do. The weight-init schemes are in init.py, gradient
checkpointing in recompute.py, and what is there only for timm's model API in timm_api.py (a mixin). Parameter names
are timm's, so timm checkpoints load as they are; the computation follows timm's order of operations, so logits agree
with timm's bit for bit on CPU in fp32.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim, P patch size.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from vitlab.model import init
from vitlab.model.attention import ATTENTIONS, AttentionPool
from vitlab.model.blocks import BLOCKS, EvaBlock
from vitlab.model.config import ViTConfig, as_hw
from vitlab.model.draws import Dropout, number_draw_sites
from vitlab.model.layers import ACTIVATIONS, MLPS, POOLS, PatchDropout, PatchEmbed, norm_layer
from vitlab.model.naflex import (
    NAFLEX_KEYS,
    NaFlexEmbeds,
    NaFlexPos,
    attention_mask,
    drop_patches,
    masked_pool,
    naflex_rope,
)
from vitlab.model.naflex_config import pos_grid
from vitlab.model.posemb import POS_EMBEDS, resample_grid, resample_pos_embed
from vitlab.model.recompute import recompute_region
from vitlab.model.rope import Rope, RopeSpec, keep_rows
from vitlab.model.timm_api import TimmAPI

# ---- inputs ----------------------------------------------------------------------------------------


@torch.fx.wrap  # FX records one call: the grid comes from the input's shape
def _pos_embed_at(
    pos_embed: torch.Tensor, tokens: torch.Tensor, kind: str, trained_grid, num_prefix: int, rule: str = "timm"
):
    """The position embedding for the grid of `tokens` (B, h, w, D) (dynamic_img_size): a learned one resampled
    from its trained grid by `rule` (timm's resample_abs_pos_embed, or DINO's), a fixed one recomputed."""
    h, w = tokens.shape[1], tokens.shape[2]
    if kind == "learn":
        return resample_grid(pos_embed, (h, w), trained_grid, num_prefix, rule)
    return POS_EMBEDS[kind]((h, w), num_prefix, pos_embed.shape[-1], device=pos_embed.device).to(pos_embed.dtype)


@torch.fx.wrap
def _check_input_size(x: torch.Tensor, img_hw: tuple, patch_hw: tuple, dynamic_size: bool, dynamic_pad: bool) -> None:
    H, W = x.shape[-2], x.shape[-1]
    if not dynamic_size and (H, W) != img_hw:
        raise ValueError(
            f"input size {H}x{W} does not match img_size {img_hw}; "
            "resize the input or build the model with dynamic_img_size=true"
        )
    if not dynamic_pad and (H % patch_hw[0] or W % patch_hw[1]):  # the strided conv would drop the remainder
        patch = patch_hw[0] if patch_hw[0] == patch_hw[1] else patch_hw
        raise ValueError(
            f"input size {H}x{W} is not a multiple of patch_size {patch}; crop or resize it, or build the "
            "model with dynamic_img_pad=true to pad it"
        )


# ---- the config, read into each layer's arguments -----------------------------------------------------
# The layers take what they use (dim, num_heads, norm_layer, ...), as timm's and dinov2's; these read ViTConfig.


def _norm(cfg: ViTConfig, switch: bool = True):
    """The config's norm layer (norm_layer, norm_eps), or None where `switch` is off."""
    return norm_layer(cfg.norm_layer, cfg.norm_eps) if switch else None


def build_block(cfg: ViTConfig, layer: int, drop_path: float, block: type[nn.Module] | None = None) -> nn.Module:
    """Block `layer` of `cfg` (block_fn's class, or `block`), its attention and MLP from the config's tables."""
    cls, D, act = block or BLOCKS[cfg.block_fn], cfg.embed_dim, ACTIVATIONS[cfg.act_layer]
    heads = dict(qkv_bias=cfg.qkv_bias, qk_norm=_norm(cfg, cfg.qk_norm), proj_bias=cfg.proj_bias,
                 attn_drop=cfg.attn_drop_rate, proj_drop=cfg.proj_drop_rate, layer=layer)  # fmt: skip
    scale = dict(norm_layer=_norm(cfg), init_values=cfg.init_values, drop_path=drop_path)
    if cls.fused:  # ViT-22B's parallel blocks: one input projection for attention and MLP (its width by mlp_ratio)
        return cls(D, cfg.num_heads, mlp_hidden=int(cfg.mlp_ratio * D), act_layer=act, **heads, **scale)
    kv = cfg.num_kv_heads[layer] if isinstance(cfg.num_kv_heads, tuple) else cfg.num_kv_heads
    separate = dict(qkv_bias_separate=True) if cfg.qkv_bias_separate else {}  # (attn_layer 'eva''s: config.py)
    attn = partial(ATTENTIONS[cfg.attn_layer], D, cfg.num_heads, qkv_fused=cfg.qkv_fused, num_kv_heads=kv,
                   scale_norm=_norm(cfg, cfg.scale_attn_norm), num_prefix_tokens=cfg.num_prefix_tokens,
                   rotate_half=cfg.rope_rotate_half, **heads, **separate)  # fmt: skip
    mlp = partial(MLPS[cfg.mlp_layer], D, cfg.mlp_hidden, act_layer=act, norm_layer=_norm(cfg, cfg.scale_mlp_norm),
                  bias=cfg.proj_bias, drop=cfg.proj_drop_rate)  # fmt: skip
    eva = dict(attn_only_layer_scale=cfg.attn_only_layer_scale) if issubclass(cls, EvaBlock) else {}
    return cls(D, attn_layer=attn, mlp_layer=mlp, **scale, **eva)


def rope_spec(cfg: ViTConfig) -> RopeSpec:
    """config.py's rope fields as the values a RoPE table is computed from (model/rope.py)."""
    ref = as_hw(cfg.rope_ref_feat_shape, "rope_ref_feat_shape") if cfg.rope_ref_feat_shape is not None else None
    periods = tuple(cfg.rope_period_range) if cfg.rope_period_range is not None else None
    offset = 0.0 if cfg.rope == "mixed" else float(cfg.rope_grid_offset)  # (timm's mixed RoPE has none)
    return RopeSpec(cfg.rope, cfg.embed_dim // cfg.num_heads, float(cfg.rope_temperature), ref, offset,
                    cfg.rope_grid_indexing, cfg.rope_rotate_half, cfg.rope_normalize_coords, periods,
                    cfg.rope_shift_coords, cfg.rope_jitter_coords, cfg.rope_rescale_coords)  # fmt: skip


def _naflex_embeds(cfg: ViTConfig) -> NaFlexEmbeds:
    pos = NaFlexPos(cfg.pos_embed, cfg.pos_embed_interp_mode, cfg.pos_embed_ar_preserving, cfg.pos_embed_antialias,
                    cfg.pos_embed_align_corners, cfg.pos_embed_use_grid_sample)  # fmt: skip
    return NaFlexEmbeds(
        cfg.embed_dim,
        cfg.patch_hw,
        cfg.in_chans,
        pos=pos,
        pos_grid=pos_grid(cfg),
        class_token=cfg.class_token,
        reg_tokens=cfg.reg_tokens,
        bias=not cfg.pre_norm,
        norm_layer=_norm(cfg, cfg.embed_norm),
        pos_drop=cfg.pos_drop_rate,
        dynamic_img_pad=cfg.dynamic_img_pad,
    )


# ---- the model -------------------------------------------------------------------------------------


class ViT(TimmAPI, nn.Module):
    """Patches (B, C, H, W) -> tokens (B, N, D) with prefix tokens and position embedding -> blocks -> norm ->
    pooled (B, D) -> logits (B, K). Built from its config alone; timm's model API comes from TimmAPI."""

    def __init__(self, cfg: ViTConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """`device` and `dtype` as timm's factory arguments (None: torch's defaults, a `with torch.device(...)`
        included). The layers are laid out on the meta device and then materialised and initialised by
        `init_weights`, the call that initialises a model built on 'meta' after `to_empty`: the same seed gives the
        same values either way. On 'meta' nothing is allocated nor initialised."""
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self._build(cfg)
        number_draw_sites(self)  # (the draw sites' keys within drawn_by_rows: copies keep them)
        self.pretrained_cfg = self._default_pretrained_cfg(cfg)  # replaced by the weights' (convert.weights)
        self.register_load_state_dict_pre_hook(_resample_pos_embed_on_load)
        self.to(dtype or torch.get_default_dtype())
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def _build(self, cfg: ViTConfig) -> None:
        D = cfg.embed_dim
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.grad_checkpointing = cfg.grad_checkpointing  # timm's set_grad_checkpointing switches it too

        # Registration order matches timm's, so state_dict() lists keys in the same order.
        if cfg.naflex:  # NaFlex: patches, prefix tokens and the position table in one module (model/naflex.py)
            self.embeds = _naflex_embeds(cfg)
            self.patch_embed = self.cls_token = self.reg_token = self.pos_embed = None
        else:
            self._build_patch_embed(cfg)
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.distilled else None  # DeiT
        self.pos_drop = Dropout(cfg.pos_drop_rate)
        self.patch_drop = (
            PatchDropout(cfg.patch_drop_rate, self.num_prefix_tokens) if cfg.patch_drop_rate else nn.Identity()
        )
        rope = dict(
            depth=cfg.depth, num_heads=cfg.num_heads, grid_size=cfg.grid_size, dynamic_img_size=cfg.dynamic_img_size
        )
        rope["num_prefix"] = cfg.num_prefix_tokens  # (the rows its blocks' turns leave as they are)
        self.rope = Rope(rope_spec(cfg), **rope) if cfg.rope else None  # rotary position embedding (model/rope.py)
        self.norm_pre = _norm(cfg)(D) if cfg.pre_norm else nn.Identity()
        # Stochastic depth grows linearly with depth (timm's torch.linspace, float32 included).
        dpr = torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu").tolist()
        dpr = [cfg.drop_path_rate] * cfg.depth if cfg.drop_path_uniform else dpr  # (DINOv2's drop_path_uniform)
        self.blocks = nn.Sequential(*[build_block(cfg, i, dpr[i]) for i in range(cfg.depth)])
        self.norm = _norm(cfg)(D) if cfg.final_norm and not cfg.use_fc_norm else nn.Identity()
        self.attn_pool = self._attn_pool(cfg) if cfg.global_pool == "map" else None
        self.fc_norm = _norm(cfg)(D) if cfg.final_norm and cfg.use_fc_norm else nn.Identity()
        self.head_drop = Dropout(cfg.drop_rate)
        self.head = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        if cfg.distilled:  # DeiT's second head, on the distillation token
            self.head_dist = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.distilled_training = False  # distilled: training returns both heads' logits (timm's switch)

    @staticmethod
    def _attn_pool(cfg: ViTConfig) -> AttentionPool:
        """SigLIP's 'map' head: its own heads and MLP ratio, else the blocks'."""
        heads, ratio = cfg.attn_pool_num_heads or cfg.num_heads, cfg.attn_pool_mlp_ratio or cfg.mlp_ratio
        act, mlp_norm = ACTIVATIONS[cfg.act_layer], _norm(cfg, cfg.scale_mlp_norm)
        return AttentionPool(cfg.embed_dim, heads, ratio, norm_layer=_norm(cfg), act_layer=act, mlp_norm_layer=mlp_norm)

    def _build_patch_embed(self, cfg: ViTConfig) -> None:
        D = cfg.embed_dim
        self.patch_embed = PatchEmbed(
            cfg.img_hw,
            cfg.patch_hw,
            cfg.in_chans,
            D,
            bias=not cfg.pre_norm,
            norm_layer=_norm(cfg, cfg.embed_norm),
            dynamic_img_pad=cfg.dynamic_img_pad,
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        pos_embed = POS_EMBEDS[cfg.pos_embed](cfg.grid_size, cfg.pos_prefix_rows, D)  # (1, rows, D) or None
        if cfg.pos_embed == "learn":
            self.pos_embed = nn.Parameter(pos_embed)
        elif pos_embed is not None:  # fixed: a buffer (nothing to train), under timm's key
            self.register_buffer("pos_embed", pos_embed)
        else:
            self.pos_embed = None

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """Initialise every parameter and buffer in place by `cfg.weight_init` (init.py), as the constructor does:
        also a model built on the meta device once `to_empty` has materialised it. timm's arguments: `mode` another
        scheme (the config follows; '' keeps the config's), `needs_reset` False to keep what the layers hold and
        apply the scheme's rules only."""
        if mode and mode != self.cfg.weight_init:
            self.cfg = self.cfg.replace(weight_init=mode)
        init.init_weights(self, reset=needs_reset)

    # ---- forward ---------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, N, D): patches, prefix tokens, position embedding."""
        return self.embed_with_rope(x)[0]

    def embed_with_rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images -> (tokens (B, N, D), the RoPE table of their patches, or None): what the blocks take. With patch
        dropout the table keeps the kept patches' rows (model/rope.py: keep_rows)."""
        cfg = self.cfg
        _check_input_size(x, cfg.img_hw, cfg.patch_hw, cfg.dynamic_img_size or cfg.naflex, cfg.dynamic_img_pad)
        if cfg.naflex:  # any size: the position and RoPE tables at this batch's grid (padded up with dynamic_img_pad)
            (ph, pw), (H, W) = cfg.patch_hw, x.shape[-2:]
            rope = self.rope.at((-(-H // ph), -(-W // pw))) if self.rope is not None else None
            return self._drop_patches(self.embeds(x), rope)
        x = self.patch_embed(x)  # (B, h, w, D)
        rope = self.rope(x) if self.rope is not None else None  # this grid's
        pos = self.pos_embed
        if pos is not None and cfg.dynamic_img_size:  # this input's grid, from its shape
            pos = _pos_embed_at(pos, x, cfg.pos_embed, cfg.grid_size, cfg.pos_prefix_rows, cfg.pos_embed_resample)
        x = x.flatten(1, 2)  # (B, h*w, D)
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        if pos is None:
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        elif cfg.embeds_prefix:  # original ViT: rows for the prefix tokens too; concat then add
            x = torch.cat(prefix + [x], dim=1) if prefix else x
            x = x + pos
        else:  # patches only (DeiT-III, big_vision): add then concat
            x = x + pos
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        return self._drop_patches(self.pos_drop(x), rope)

    def _drop_patches(self, x: torch.Tensor, rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if rope is not None and isinstance(self.patch_drop, PatchDropout) and self.training:
            x, keep = self.patch_drop.forward_with_kept(x)
            return self.norm_pre(x), keep_rows(rope, keep)
        return self.norm_pre(self.patch_drop(x)), rope

    def _block(
        self,
        blk: nn.Module,
        x: torch.Tensor,
        rows: int | None = None,
        attn_mask: torch.Tensor | None = None,
        i: int = 0,
        rope: torch.Tensor | None = None,
    ):
        """Block `i`, recomputed in the backward pass where gradient checkpointing says: true every block, N every N-th
        (blocks N-1, 2N-1, ...: the others keep their activations), selective every block's cheap ops. `rope`: the
        model's RoPE table (embed_with_rope), of which mixed RoPE's block `i` takes its own."""
        if rope is not None and self.rope.per_block:
            rope = rope[i]
        mode = self.grad_checkpointing
        if not mode or not torch.is_grad_enabled():
            return blk(x, rows, attn_mask, rope)
        if mode in (True, "selective") or (i + 1) % mode == 0:
            return recompute_region(blk)(x, rows, attn_mask, mode == "selective", rope)
        return blk(x, rows, attn_mask, rope)

    def embed_naflex(self, patches: torch.Tensor, patch_coord: torch.Tensor, patch_valid: torch.Tensor) -> tuple:
        """NaFlex's dict -> tokens (B, prefix + N, D), the patches' validity (B, N) after patch dropout, the
        attention mask of the padded sequences (B, 1, N', N') and the RoPE table of each image's grid (or None)."""
        x = self.embeds(patches, patch_coord)
        rope = naflex_rope(self.rope, patch_coord, x.dtype) if self.rope is not None else None
        if self.training and self.cfg.patch_drop_rate:
            x, patch_valid, keep = drop_patches(x, patch_valid, self.cfg.patch_drop_rate, self.num_prefix_tokens)
            rope = keep_rows(rope, keep, batched=True) if rope is not None else None
        return self.norm_pre(x), patch_valid, attention_mask(patch_valid, self.num_prefix_tokens, x.dtype), rope

    def _tokens(self, x, attn_mask=None, last_rows=None, patch_coord=None, patch_valid=None) -> tuple:
        """(final normed tokens, patch validity or None) of images, or of NaFlex patches with their coordinates."""
        if not self.cfg.naflex and (isinstance(x, dict) or isinstance(patch_coord, torch.Tensor)):
            raise ValueError("NaFlex patches (a dict, or patch_coord) need a model built with naflex=true")
        if isinstance(x, dict):
            x, patch_coord, patch_valid = (x.get(k) for k in NAFLEX_KEYS)
        if self.cfg.naflex and patch_coord is not None:
            x, patch_valid, mask, rope = self.embed_naflex(x, patch_coord, patch_valid)
            attn_mask = mask if attn_mask is None else attn_mask
        else:
            x, rope = self.embed_with_rope(x)
        rope = self.rope.for_blocks(rope) if rope is not None else None  # once for every block (model/rope.py)
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, x, last_rows if i == len(self.blocks) - 1 else None, attn_mask, i, rope)
        return self.norm(x), patch_valid if self.cfg.naflex else None  # (traced: an argument is a proxy)

    def forward_features(
        self, x, attn_mask: torch.Tensor | None = None, last_rows: int | None = None, patch_coord=None, patch_valid=None
    ) -> torch.Tensor | dict:
        """Images -> final normed tokens (B, N, D); with `last_rows`, the last block computes and returns
        only the first `last_rows` tokens (B, last_rows, D). NaFlex's dict (or patches with `patch_coord` and
        `patch_valid`) -> {'patches': tokens, 'patch_valid': validity} as timm's."""
        x, valid = self._tokens(x, attn_mask, last_rows, patch_coord, patch_valid)
        return x if valid is None else {"patches": x, "patch_valid": valid}

    def forward_head(self, x, pre_logits: bool = False, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (B, N, D) -> logits (B, K); pooled features (B, D) with pre_logits. With `patch_valid` (B, N -
        prefix) (or forward_features' NaFlex dict) the pools read the valid patches only."""
        if isinstance(x, dict):
            x, patch_valid = x["patches"], x["patch_valid"]
        if self.cfg.distilled:
            return self._distilled_head(x, pre_logits)
        pool = self.cfg.global_pool
        if pool == "token":
            x = x[:, 0]
        elif pool:  # over the patch tokens (timm's global_pool_nlc), or every token with pool_include_prefix
            x = self._pool(x, pool, patch_valid)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def _pool(self, x: torch.Tensor, pool: str, valid: torch.Tensor | None) -> torch.Tensor:
        n, include = self.num_prefix_tokens, self.cfg.pool_include_prefix
        valid = valid if self.cfg.naflex else None
        tokens = x if include else x[:, n:]
        if valid is not None and include and n:  # the prefix tokens are always valid
            valid = torch.cat([valid.new_ones(valid.shape[0], n), valid], dim=1)
        if pool == "map":
            mask = None if valid is None else attention_mask(valid, 0, x.dtype, queries=1)
            return self.attn_pool(tokens, mask)
        return POOLS[pool](tokens) if valid is None else masked_pool(tokens, valid, pool)

    def _distilled_head(self, x: torch.Tensor, pre_logits: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """DeiT: the class token's head and the distillation token's, averaged; (class, distillation) logits apart
        when training with `distilled_training` (the distillation loss reads the second)."""
        x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
        if pre_logits:
            return (x + x_dist) / 2
        x, x_dist = self.head(x), self.head_dist(x_dist)
        if self.distilled_training and self.training:
            return x, x_dist
        return (x + x_dist) / 2

    def forward(self, x, attn_mask: torch.Tensor | None = None, patch_coord=None, patch_valid=None) -> torch.Tensor:
        """Images (B, C, H, W) -> logits; with naflex=true also NaFlex's dict, or patches with `patch_coord` and
        `patch_valid` (model/naflex.py)."""
        # A class-token head reads row 0 only (and DeiT's the distillation token's, row 1): the last block skips the
        # other rows' work, about 3/4 of a block (the same logits as timm's to ~1e-6; experiments/throughput).
        rows = 1 + int(self.cfg.distilled) if self.cfg.global_pool == "token" else None
        x, valid = self._tokens(x, attn_mask, rows, patch_coord, patch_valid)
        return self.forward_head(x, patch_valid=valid)

    # ---- looking inside --------------------------------------------------------------------------
    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every block's attention probabilities, [(B, H, N, N)] * depth (dropout off)."""
        maps = []
        x, rope = self.embed_with_rope(x)
        for i, blk in enumerate(self.blocks):
            table = rope[i] if rope is not None and self.rope.per_block else rope
            maps.append(blk.attention_map(x, table))
            x = blk(x, None, None, table)
        return maps


def _resample_pos_embed_on_load(module: ViT, state_dict: dict, prefix: str, *args) -> None:
    """Weights trained at another resolution: resample their pos_embed to this model's grid (as
    timm's checkpoint filter does), or take this model's own fixed sin-cos table."""
    key = prefix + "pos_embed"
    if key not in state_dict or module.pos_embed is None:
        return
    theirs, ours = state_dict[key], module.pos_embed
    if theirs.shape == ours.shape or theirs.ndim != 3 or theirs.shape[-1] != ours.shape[-1]:
        return  # same grid, or a mismatch that load_state_dict reports itself
    if module.cfg.pos_embed != "learn":  # fixed: recomputed, never resampled as a grid
        state_dict[key] = ours.detach().clone()
        return
    cfg = module.cfg
    state_dict[key] = resample_pos_embed(theirs, cfg.grid_size, None, cfg.pos_prefix_rows, cfg.pos_embed_resample)
