"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021).

Reads top to bottom: input helpers -> the model. Its components (the tables a config picks
from) live in layers.py and blocks.py. Parameter names are timm's, so timm checkpoints load as they are; the
computation follows timm's order of operations, so logits agree with timm's bit for bit on CPU in fp32.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim, P patch size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vitlab.model import init
from vitlab.model.blocks import BLOCKS
from vitlab.model.config import ViTConfig
from vitlab.model.layers import POOLS, AttentionPool, PatchDropout, PatchEmbed, norm
from vitlab.model.posemb import (
    posemb_sincos_1d,
    posemb_sincos_2d,
    resample_grid,
    resample_patch_embed,
    resample_pos_embed,
)

Size = int | Sequence[int]  # an int for squares, else (height, width)

# ---- inputs ----------------------------------------------------------------------------------------


@torch.fx.wrap  # FX records one call: the grid comes from the input's shape
def _pos_embed_at(pos_embed: torch.Tensor, tokens: torch.Tensor, kind: str, trained_grid, num_prefix: int):
    """The position embedding for the grid of `tokens` (B, h, w, D) (dynamic_img_size): a fixed table
    recomputed, a learned one resampled from its trained grid (as timm's resample_abs_pos_embed)."""
    h, w = tokens.shape[1], tokens.shape[2]
    if kind == "sincos2d":
        return posemb_sincos_2d((h, w), pos_embed.shape[-1], device=pos_embed.device).to(pos_embed.dtype)
    if kind == "sincos1d":
        return posemb_sincos_1d(num_prefix + h * w, pos_embed.shape[-1], device=pos_embed.device).to(pos_embed.dtype)
    return resample_grid(pos_embed, (h, w), trained_grid, num_prefix)


@torch.fx.wrap
def _check_input_size(x: torch.Tensor, img_hw, patch_hw, dynamic_size: bool, dynamic_pad: bool) -> None:
    H, W = x.shape[-2], x.shape[-1]
    if not dynamic_size and (H, W) != tuple(img_hw):
        raise ValueError(
            f"input size {H}x{W} does not match img_size {tuple(img_hw)}; "
            "resize the input or build the model with dynamic_img_size=true"
        )
    if not dynamic_pad and (H % patch_hw[0] or W % patch_hw[1]):  # the strided conv would drop the remainder
        patch = patch_hw[0] if patch_hw[0] == patch_hw[1] else tuple(patch_hw)
        raise ValueError(
            f"input size {H}x{W} is not a multiple of patch_size {patch}; crop or resize it, or build the "
            "model with dynamic_img_pad=true to pad it"
        )


# What timm's ViT weights expect of their inputs unless their pretrained config says otherwise (timm's `_cfg`).
DEFAULT_PRETRAINED_CFG = dict(
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=0.9, crop_mode="center", interpolation="bicubic"
)


# ---- the model -------------------------------------------------------------------------------------


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.embed_dim
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.grad_checkpointing = False

        # Registration order matches timm's, so state_dict() lists keys in the same order.
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        prefix_rows = cfg.num_prefix_tokens if cfg.embeds_prefix else 0
        if cfg.pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, prefix_rows + cfg.num_patches, D))
        elif cfg.pos_embed in ("sincos1d", "sincos2d"):  # fixed: a buffer (nothing to train), under timm's key
            self.register_buffer("pos_embed", self._fixed_pos_embed(cfg))
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.patch_drop = (
            PatchDropout(cfg.patch_drop_rate, self.num_prefix_tokens) if cfg.patch_drop_rate else nn.Identity()
        )
        self.norm_pre = norm(cfg, D) if cfg.pre_norm else nn.Identity()
        # Stochastic depth grows linearly with depth (timm's torch.linspace, float32 included).
        dpr = torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu").tolist()
        self.blocks = nn.Sequential(*[BLOCKS[cfg.block_fn](cfg, dpr[i], i) for i in range(cfg.depth)])
        self.norm = norm(cfg, D) if cfg.final_norm and not cfg.use_fc_norm else nn.Identity()
        self.attn_pool = AttentionPool(cfg) if cfg.global_pool == "map" else None
        self.fc_norm = norm(cfg, D) if cfg.final_norm and cfg.use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()

        self.pretrained_cfg = self._default_pretrained_cfg(cfg)  # replaced by the weights' (convert.timm)
        init.init_weights(self)
        self.register_load_state_dict_pre_hook(_resample_pos_embed_on_load)

    @staticmethod
    def _fixed_pos_embed(cfg: ViTConfig, device=None) -> torch.Tensor:
        if cfg.pos_embed == "sincos2d":
            return posemb_sincos_2d(cfg.grid_size, cfg.embed_dim, device=device)
        rows = (cfg.num_prefix_tokens if cfg.embeds_prefix else 0) + cfg.num_patches
        return posemb_sincos_1d(rows, cfg.embed_dim, device=device)

    def init_weights(self) -> None:
        """Re-initialise in place by `cfg.weight_init` (init.py's WEIGHT_INITS), as the constructor does."""
        init.init_weights(self)

    # ---- timm's model API (what timm.optim, timm.data and timm users call) ----------------------
    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    @property
    def num_features(self) -> int:  # width of forward_features' tokens and of the pooled features
        return self.cfg.embed_dim

    head_hidden_size = num_features  # no pre-logits layer: the head sees the pooled features

    @staticmethod
    def _default_pretrained_cfg(cfg: ViTConfig) -> dict:
        d = dict(DEFAULT_PRETRAINED_CFG, num_classes=cfg.num_classes, input_size=(cfg.in_chans, *cfg.img_hw))
        if cfg.in_chans != 3:
            d.update(mean=(0.5,) * cfg.in_chans, std=(0.5,) * cfg.in_chans)
        return dict(d, pool_size=None, fixed_input_size=not cfg.dynamic_img_size, first_conv="patch_embed.proj",
                    classifier="head")  # fmt: skip

    @property
    def default_cfg(self) -> dict:  # timm's older name of pretrained_cfg
        return self.pretrained_cfg

    @property
    def feature_info(self) -> list[dict]:
        """Every block's output as timm describes it: module name, channels, stride in pixels."""
        return [
            dict(module=f"blocks.{i}", num_chs=self.cfg.embed_dim, reduction=max(self.cfg.patch_hw))
            for i in range(len(self.blocks))
        ]

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth, as timm's: the embeddings, then each block, then the rest (timm.optim's
        layer-wise learning-rate decay reads this)."""
        return dict(
            stem=r"^cls_token|pos_embed|patch_embed|reg_token", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]
        )

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for `num_classes` (0: none, forward returns pooled features), and optionally another
        pooling ('' keeps every token); the attention pool can be removed, not added. The rest of the model is
        kept, and the config follows, so checkpoints record the change."""
        changes: dict = {"num_classes": num_classes}
        if global_pool is not None:
            if global_pool == "map" and self.attn_pool is None:
                raise ValueError("reset_classifier cannot add an attention pool ('map'); build a new model")
            if global_pool != "map":
                self.attn_pool = None
            changes["global_pool"] = global_pool
        self.cfg = self.cfg.replace(**changes, **self._built_norms())
        device = next(self.parameters()).device
        self.head = nn.Linear(self.cfg.embed_dim, num_classes, device=device) if num_classes > 0 else nn.Identity()

    def _built_norms(self) -> dict:
        """The config fields that describe the norms as built (the pooling no longer decides them)."""
        has_norm, has_fc_norm = not isinstance(self.norm, nn.Identity), not isinstance(self.fc_norm, nn.Identity)
        return dict(final_norm=has_norm or has_fc_norm, fc_norm=has_fc_norm)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.grad_checkpointing = enable

    def set_input_size(self, img_size: Size | None = None, patch_size: Size | None = None):
        """Another input resolution and/or patch size, as timm's: a learned pos_embed is resampled to the new
        grid, a fixed one recomputed; the patch filters are resampled to the new patch size (FlexiViT)."""
        old, changes = self.cfg, {}
        if img_size is not None:
            changes["img_size"] = img_size if isinstance(img_size, int) else list(img_size)
        if patch_size is not None:
            changes["patch_size"] = patch_size if isinstance(patch_size, int) else list(patch_size)
        new = old.replace(**changes)
        if new.patch_hw != old.patch_hw:
            conv, P = self.patch_embed.proj, new.patch_hw
            proj = nn.Conv2d(new.in_chans, new.embed_dim, P, P, bias=conv.bias is not None, device=conv.weight.device,
                             dtype=conv.weight.dtype)  # fmt: skip
            with torch.no_grad():
                proj.weight.copy_(resample_patch_embed(conv.weight, P))
                if conv.bias is not None:
                    proj.bias.copy_(conv.bias)
            self.patch_embed.proj, self.patch_embed.patch_size = proj, P
        if self.pos_embed is not None and new.grid_size != old.grid_size:
            if isinstance(self.pos_embed, nn.Parameter):
                prefix = self.num_prefix_tokens if new.embeds_prefix else 0
                pe = resample_pos_embed(self.pos_embed.detach(), new.grid_size, old.grid_size, prefix)
                self.pos_embed = nn.Parameter(pe, requires_grad=self.pos_embed.requires_grad)
            else:
                self.pos_embed = self._fixed_pos_embed(new, self.pos_embed.device).to(self.pos_embed.dtype)
        self.cfg = new
        self.pretrained_cfg["input_size"] = (new.in_chans, *new.img_hw)

    # ---- forward ---------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, N, D): patches, prefix tokens, position embedding."""
        cfg = self.cfg
        _check_input_size(x, cfg.img_hw, cfg.patch_hw, cfg.dynamic_img_size, cfg.dynamic_img_pad)
        x = self.patch_embed(x)  # (B, h, w, D)
        pos = self.pos_embed
        if pos is not None and cfg.dynamic_img_size:  # this input's grid, from its shape
            prefix_rows = self.num_prefix_tokens if cfg.embeds_prefix else 0
            pos = _pos_embed_at(pos, x, cfg.pos_embed, cfg.grid_size, prefix_rows)
        x = x.flatten(1, 2)  # (B, h*w, D)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if pos is None:
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        elif cfg.embeds_prefix:  # original ViT: rows for the prefix tokens too; concat then add
            x = torch.cat(prefix + [x], dim=1) if prefix else x
            x = x + pos
        else:  # patches only (DeiT-III, big_vision): add then concat
            x = x + pos
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        return self.norm_pre(self.patch_drop(self.pos_drop(x)))

    def _block(self, blk: nn.Module, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None):
        """One block, recomputed in the backward pass when gradient checkpointing is on."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(blk, x, rows, attn_mask, use_reentrant=False)
        return blk(x, rows, attn_mask)

    def forward_features(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, last_rows: int | None = None
    ) -> torch.Tensor:
        """Images -> final normed tokens (B, N, D); with `last_rows`, the last block computes and returns
        only the first `last_rows` tokens (B, last_rows, D)."""
        x = self.embed(x)
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, x, last_rows if i == len(self.blocks) - 1 else None, attn_mask)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, D) -> logits (B, K); pooled features (B, D) with pre_logits."""
        pool = self.cfg.global_pool
        if pool == "token":
            x = x[:, 0]
        elif pool:  # over the patch tokens (timm's global_pool_nlc), or every token with pool_include_prefix
            tokens = x if self.cfg.pool_include_prefix else x[:, self.num_prefix_tokens :]
            x = self.attn_pool(tokens) if pool == "map" else POOLS[pool](tokens)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # A class-token head reads row 0 only: the last block skips the other N - 1 rows' work, about
        # 3/4 of a block (the same logits as timm's to ~1e-6; experiments/throughput).
        rows = 1 if self.cfg.global_pool == "token" else None
        return self.forward_head(self.forward_features(x, attn_mask, last_rows=rows))

    # ---- looking inside --------------------------------------------------------------------------
    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: torch.Tensor | None = None,
    ):
        """timm's contract: block outputs at `indices` (an int n: the last n blocks; a list: those blocks,
        negative from the end; None: all), patch tokens as (B, D, h, w) ('NCHW') or (B, h*w, D) ('NLC'), with
        their prefix tokens as (tokens, prefix) pairs when `return_prefix_tokens`, each through the final norm
        when `norm`. Returns (final features, intermediates), the intermediates alone, or timm's dict.
        Checkpointed like forward_features when gradient checkpointing is on."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt {output_fmt!r} is not one of ['NCHW', 'NLC']")
        take, last = take_indices(len(self.blocks), indices)
        B, H, W = x.shape[0], x.shape[-2], x.shape[-1]
        blocks = self.blocks[: last + 1] if stop_early else self.blocks
        feats, x = [], self.embed(x)
        for i, blk in enumerate(blocks):
            x = self._block(blk, x, None, attn_mask)
            if i in take:
                feats.append(self.norm(x) if norm else x)
        n = self.num_prefix_tokens
        prefix, feats = [y[:, :n] for y in feats], [y[:, n:] for y in feats]
        if output_fmt == "NCHW":
            (ph, pw) = self.cfg.patch_hw
            h, w = (H + ph - 1) // ph, (W + pw - 1) // pw  # the padded grid with dynamic_img_pad
            feats = [y.reshape(B, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if output_dict:
            out = {"image_intermediates": feats}
            if n and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = self.norm(x)
            return out
        if n and return_prefix_tokens:
            feats = list(zip(feats, prefix, strict=True))
        return feats if intermediates_only else (self.norm(x), feats)

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks after the last of `indices` (and the final norm, the head), as timm's: a backbone
        for forward_intermediates. The config follows. Returns the kept indices."""
        take, last = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: last + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        self.cfg = self.cfg.replace(depth=last + 1, **self._built_norms())
        return take

    def intermediates_by_name(self, x: torch.Tensor, layers: Sequence[int | str] = (-1,)) -> dict[str, torch.Tensor]:
        """Named intermediate outputs, for layer-by-layer comparisons (convert/compare.py). `layers` holds block
        indices (negative count from the end) or names: 'patch_embed' (B, h*w, D) before prefix tokens and
        position embedding, 'embed' (B, N, D) the blocks' input, 'blocks.<i>', 'norm' (the final features)."""
        depth = len(self.blocks)
        valid = {"patch_embed", "embed", "norm"} | {f"blocks.{i}" for i in range(depth)}
        wanted = [f"blocks.{take_indices(depth, [n])[0][0]}" if isinstance(n, int) else n for n in layers]
        unknown = [n for n in wanted if n not in valid]
        if unknown:
            raise ValueError(f"unknown layer {unknown[0]!r}; use 'patch_embed', 'embed', 'blocks.<i>' or 'norm'")
        out = {"patch_embed": self.patch_embed(x).flatten(1, 2)} if "patch_embed" in wanted else {}
        out["embed"] = x = self.embed(x)
        for i, blk in enumerate(self.blocks):
            out[f"blocks.{i}"] = x = self._block(blk, x)
        out["norm"] = self.norm(x)
        return {name: out[name] for name in wanted}

    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every block's attention probabilities, [(B, H, N, N)] * depth (dropout off)."""
        maps = []
        x = self.embed(x)
        for blk in self.blocks:
            maps.append(blk.attention_map(x))
            x = blk(x)
        return maps


def take_indices(depth: int, indices: int | Sequence[int] | None) -> tuple[list[int], int]:
    """timm's `feature_take_indices`: None -> every block, an int n -> the last n, a list -> those (negative
    from the end); returns the absolute indices and the largest."""
    if indices is None:
        indices = depth
    if isinstance(indices, int):
        if not 0 < indices <= depth:
            raise ValueError(f"last-n {indices} is out of range (1 to {depth})")
        take = list(range(depth - indices, depth))
    else:
        take = [depth + i if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, take, strict=True) if not 0 <= t < depth]
        if bad:
            raise ValueError(f"block index {bad[0]} out of range for depth {depth}")
    return take, max(take)


def _resample_pos_embed_on_load(module: ViT, state_dict: dict, prefix: str, *args) -> None:
    """Weights trained at another resolution: resample their pos_embed to this model's grid (as
    timm's checkpoint filter does), or take this model's own fixed sin-cos table."""
    key = prefix + "pos_embed"
    if key not in state_dict or module.pos_embed is None:
        return
    theirs, ours = state_dict[key], module.pos_embed
    if theirs.shape == ours.shape or theirs.ndim != 3 or theirs.shape[-1] != ours.shape[-1]:
        return  # same grid, or a mismatch that load_state_dict reports itself
    if module.cfg.pos_embed in ("sincos1d", "sincos2d"):  # fixed: recomputed, never resampled as a grid
        state_dict[key] = ours.detach().clone()
        return
    n_prefix = module.num_prefix_tokens if module.cfg.embeds_prefix else 0
    state_dict[key] = resample_pos_embed(theirs, module.cfg.grid_size, None, n_prefix)
