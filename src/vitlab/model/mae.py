"""Masked autoencoding (He et al. 2021, "Masked Autoencoders Are Scalable Vision Learners";
facebookresearch/mae `models_mae.py`) around our ViT: the encoder sees a random quarter of each image's patches,
a light decoder fills the rest in with a shared mask token and its own fixed position embedding, and the loss is
the (per-patch normalised) pixel error on the masked patches only.

The encoder is the ViT itself (its patch embedding, prefix tokens, position embedding, blocks and final norm: its
checkpoint is a ViT checkpoint plus `decoder.*`); masking drops patch tokens as `patch_drop` does, but keeps the
order that puts them back. No Lightning, no Hydra.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vitlab.model.blocks import Block
from vitlab.model.config import ViTConfig
from vitlab.model.draws import random_order
from vitlab.model.posemb import posemb_sincos_2d, posemb_sincos_2d_mae
from vitlab.model.rope import keep_rows
from vitlab.model.vit import ViT, build_block
from vitlab.utils.errors import UserError
from vitlab.utils.values import check_range, from_mapping


@dataclass(frozen=True)
class MAEConfig:
    """conf/objective/mae.yaml (objective=mae); MAE's ViT-B recipe: mask 0.75, decoder 512 wide, 8 deep, 16 heads."""

    mask_ratio: float = 0.75
    norm_pix_loss: bool = True  # the target: each patch's pixels normalised by their own mean and variance
    decoder_embed_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16

    def __post_init__(self):
        check_range("objective.mask_ratio", self.mask_ratio, 0, 1, low_open=True, high_open=True)
        for key in ("decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"objective.{key} {value!r} must be a whole number >= 1")
        if self.decoder_embed_dim % self.decoder_num_heads:
            raise UserError(
                f"objective.decoder_embed_dim {self.decoder_embed_dim} is not divisible by objective.decoder_num_heads "
                f"{self.decoder_num_heads}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> MAEConfig:
        return from_mapping(cls, values, "objective=mae")

    def kept(self, num_patches: int) -> int:
        """How many patches the encoder sees: int(N * (1 - mask_ratio)) as MAE's random_masking (r 0.9, N 196: 19),
        at least one."""
        return max(1, int(num_patches * (1 - self.mask_ratio)))


# ---- masking and targets ---------------------------------------------------------------------------
MASKING = 1 << 20  # the masks' key among a step's draws (model/draws.py; the model's draw sites count from 0)


def random_masking(n: int, num_patches: int, keep: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image random masking: (the kept patches' indices (n, keep), the order that puts the shuffled patches
    back (n, num_patches)). Drawn from torch's generator (checkpointed: a resumed run masks as the uninterrupted
    one), or in a training step of a global order by each image's row of the global batch (model/draws.py), the
    same on any number of processes."""
    shuffle = random_order(n, num_patches, device, MASKING)
    return shuffle[:, :keep], shuffle.argsort(dim=1)


def patchify(images: torch.Tensor, patch_hw: tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, ph * pw * C), patches in row-major order, pixels as MAE's `patchify` orders them."""
    b, c, h, w = images.shape
    ph, pw = patch_hw
    x = images.reshape(b, c, h // ph, ph, w // pw, pw)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // ph) * (w // pw), ph * pw * c)


def unpatchify(patches: torch.Tensor, patch_hw: tuple[int, int], grid: tuple[int, int], chans: int) -> torch.Tensor:
    """The inverse of `patchify`: (B, N, ph * pw * C) -> (B, C, H, W)."""
    (ph, pw), (gh, gw) = patch_hw, grid
    x = patches.reshape(patches.shape[0], gh, gw, ph, pw, chans)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(patches.shape[0], chans, gh * ph, gw * pw)


def pixel_target(images: torch.Tensor, patch_hw: tuple[int, int], norm_pix: bool) -> torch.Tensor:
    target = patchify(images, patch_hw)
    if norm_pix:  # MAE's norm_pix_loss: unbiased variance, eps 1e-6
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    return target


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean squared error per patch, averaged over the masked patches only (mask: 1 = removed)."""
    per_patch = (pred.float() - target.float()).pow(2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum()


# ---- encoder and decoder ---------------------------------------------------------------------------
def encode_visible(vit: ViT, images: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ViT on `keep` random patches of each image (and its prefix tokens): (latent (B, prefix + keep, D) after
    the final norm, mask (B, N) with 1 on the removed patches, restore (B, N))."""
    x, rope = vit.embed_with_rope(images)  # patch_drop must be off: this masking takes its place
    prefix, patches = x[:, : vit.num_prefix_tokens], x[:, vit.num_prefix_tokens :]
    n, num_patches = patches.shape[:2]
    kept, restore = random_masking(n, num_patches, keep, patches.device)
    x = torch.cat([prefix, patches.gather(1, kept.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))], dim=1)
    rope = keep_rows(rope, kept) if rope is not None else None  # the kept patches' rows of the RoPE table
    for i, blk in enumerate(vit.blocks):
        x = vit._block(blk, x, i=i, rope=rope)
    mask = torch.ones(n, num_patches, device=images.device)
    mask[:, :keep] = 0
    return vit.norm(x), mask.gather(1, restore), restore


class MAEDecoder(nn.Module):
    """MAE's decoder: the encoder's tokens projected to its width, a mask token in every removed place, a fixed
    2-D sin-cos position embedding (zeros for the prefix tokens; MAE's frequencies when the encoder's is
    pos_embed=sincos2d_mae, else big_vision's, as vitlab's decoder had before), pre-norm blocks, and a linear
    prediction of each patch's pixels. Its parameter names are MAE's (`decoder_embed`, `mask_token`, ...)."""

    def __init__(self, encoder: ViTConfig, cfg: MAEConfig):
        super().__init__()
        self.num_prefix_tokens = encoder.num_prefix_tokens
        block_cfg = decoder_block_config(encoder, cfg)
        self.decoder_embed = nn.Linear(encoder.embed_dim, cfg.decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.decoder_embed_dim))
        self.encoder_cfg = encoder  # (what the fixed table follows)
        self.register_buffer("decoder_pos_embed", decoder_pos_table(encoder, cfg.decoder_embed_dim), persistent=False)
        self.decoder_blocks = nn.ModuleList(build_block(block_cfg, 0, 0.0, Block) for _ in range(cfg.decoder_depth))
        self.decoder_norm = nn.LayerNorm(cfg.decoder_embed_dim, eps=1e-6)
        ph, pw = encoder.patch_hw
        self.decoder_pred = nn.Linear(cfg.decoder_embed_dim, ph * pw * encoder.in_chans)
        self._init_weights()

    def _init_weights(self) -> None:  # MAE's: xavier-uniform linears, zero biases, N(0, 0.02) mask token
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, latent: torch.Tensor, restore: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(B, prefix + kept, D) encoder tokens -> (B, N, ph * pw * C) predicted pixels of every patch; `grid`: the
        images' patch grid when it is not the encoder config's (dynamic_img_size), its fixed table computed there."""
        x = self.decoder_embed(latent)
        p = self.num_prefix_tokens
        n, num_patches = restore.shape
        masked = self.mask_token.to(x.dtype).expand(n, num_patches - (x.shape[1] - p), -1)
        patches = torch.cat([x[:, p:], masked], dim=1)
        patches = patches.gather(1, restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # back in image order
        table = self.decoder_pos_embed
        if grid is not None and tuple(grid) != self.encoder_cfg.grid_size:
            (ph, pw), enc = self.encoder_cfg.patch_hw, self.encoder_cfg
            table = decoder_pos_table(enc.replace(img_size=[grid[0] * ph, grid[1] * pw]), x.shape[-1]).to(x.device)
        x = torch.cat([x[:, :p], patches], dim=1) + table.to(x.dtype)
        for blk in self.decoder_blocks:
            x = blk(x)
        return self.decoder_pred(self.decoder_norm(x))[:, p:]


def decoder_block_config(encoder: ViTConfig, cfg: MAEConfig) -> ViTConfig:
    """The decoder's blocks (model/blocks.py's pre-norm Block): the encoder's config at the decoder's width and depth,
    MLP ratio 4 without LayerScale or dropout, as MAE's; and without what belongs to the encoder alone: its RoPE (the
    decoder's positions are its fixed table), its MLP's width (mlp_hidden_dim), EVA's separate q/k/v."""
    rope_off = {f.name: f.default for f in dataclasses.fields(ViTConfig) if f.name.startswith("rope")}
    attn = "attn" if encoder.attn_layer == "eva" else encoder.attn_layer
    return dataclasses.replace(
        encoder, **rope_off, embed_dim=cfg.decoder_embed_dim, depth=cfg.decoder_depth,
        num_heads=cfg.decoder_num_heads, drop_path_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, init_values=None,
        mlp_ratio=4.0, mlp_hidden_dim=None, mlp_layer="mlp", attn_layer=attn, qkv_fused=True, qkv_bias_separate=False,
    )  # fmt: skip


def decoder_pos_table(encoder: ViTConfig, dim: int) -> torch.Tensor:
    """The decoder's fixed table (1, prefix + N, dim): MAE's with an encoder of pos_embed=sincos2d_mae, else zeros for
    the prefix rows and big_vision's for the patches."""
    if encoder.pos_embed == "sincos2d_mae":
        return posemb_sincos_2d_mae(encoder.grid_size, dim, encoder.num_prefix_tokens)
    prefix = torch.zeros(1, encoder.num_prefix_tokens, dim)
    return torch.cat([prefix, posemb_sincos_2d(encoder.grid_size, dim)], dim=1)


def flops_per_image(encoder: ViTConfig, cfg: MAEConfig) -> int:
    """Forward FLOPs of one image (multiply-add = 2; each block as ViTConfig.block_flops counts it, the encoder's
    attention, MLP and SwiGLU included): the patch embedding of every patch, the encoder's blocks on the prefix and
    kept tokens, the decoder's blocks on every token, its projection in and its pixel prediction out."""
    d, dd, patches = encoder.embed_dim, cfg.decoder_embed_dim, encoder.num_patches
    ph, pw = encoder.patch_hw
    n_enc, n_dec = encoder.num_prefix_tokens + cfg.kept(patches), encoder.num_tokens()
    embed = 2 * patches * ph * pw * encoder.in_chans * d
    enc = encoder.depth * encoder.block_flops(n_enc, n_enc)
    dec = (
        cfg.decoder_depth * decoder_block_config(encoder, cfg).block_flops(n_dec, n_dec)
        + 2 * n_enc * d * dd
        + 2 * patches * dd * ph * pw * encoder.in_chans
    )
    return embed + enc + dec


def mae_forward(
    vit: ViT, decoder: MAEDecoder, images: torch.Tensor, cfg: MAEConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, predicted pixels (B, N, ph * pw * C), mask (B, N)) of a batch, as MAE's `forward`."""
    (ph, pw), (h, w) = vit.cfg.patch_hw, images.shape[-2:]
    grid = (h // ph, w // pw)  # this batch's (the config's, or another under dynamic_img_size)
    latent, mask, restore = encode_visible(vit, images, cfg.kept(math.prod(grid)))
    pred = decoder(latent, restore, grid)
    return masked_mse(pred, pixel_target(images, vit.cfg.patch_hw, cfg.norm_pix_loss), mask), pred, mask
