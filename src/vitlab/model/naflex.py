"""NaFlex: images at their own aspect ratio and size (NaViT, Dehghani et al. 2023; SigLIP 2's NaFlex; timm's
naflexvit): the embedding a config picks with `naflex=true`, the attention mask of padded sequences, and masked
pooling. Parameter names are timm's (`embeds.proj`, `embeds.cls_token`, `embeds.reg_token`, `embeds.pos_embed`
(1, h, w, D) or `embeds.pos_embed_y` / `pos_embed_x`), so timm's naflexvit weights load as they are; each operation
follows timm's NaFlexEmbeds in its order, so logits agree with timm's to float rounding.

Inputs: images (B, C, H, W) of any size (divisible by the patch, or padded with dynamic_img_pad), or NaFlex's
dict: `patches` (B, N, ph*pw*C) flattened in (ph, pw, C) order, `patch_coord` (B, N, 2) each patch's (y, x) on its
image's grid, `patch_valid` (B, N) False for padding. An image's patches come first, row-major; the position table
is resampled to each image's (h, w) grid (max coordinate + 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model.draws import Dropout, random_order
from vitlab.model.layers import NormLayer, optional_norm
from vitlab.model.rope import Rope

NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")


class NaFlexPos(NamedTuple):
    """How the position table is kept and resampled to each image's grid (config.py's pos_embed and NaFlex's
    pos_embed_* fields, read by model/vit.py)."""

    kind: str  # learn | factorized (NaViT's: one table per axis) | none
    interp_mode: str = "bicubic"  # F.interpolate's and grid_sample's mode
    ar_preserving: bool = False  # resample to a square of the longer side, crop top-left
    antialias: bool = True  # when the table is shrunk
    align_corners: bool = False
    use_grid_sample: bool = False  # sample the table at each patch's coordinates


def patchify(x: torch.Tensor, patch_hw: tuple[int, int], pad: bool = False) -> tuple[torch.Tensor, tuple[int, int]]:
    """Images (B, C, H, W) -> patches (B, h*w, ph*pw*C) in (ph, pw, C) order, row-major over the grid, and the grid
    (h, w); with `pad`, zero-padded right and bottom to a multiple of the patch (timm's batch_patchify)."""
    B, C, H, W = x.shape
    ph, pw = patch_hw
    if pad and (H % ph or W % pw):
        x = F.pad(x, (0, (pw - W % pw) % pw, 0, (ph - H % ph) % ph))
        H, W = x.shape[-2:]
    h, w = H // ph, W // pw
    patches = x.view(B, C, h, ph, w, pw).permute(0, 2, 4, 3, 5, 1)  # (B, h, w, ph, pw, C)
    return patches.reshape(B, h * w, ph * pw * C), (h, w)


def grid_sizes(patch_coord: torch.Tensor) -> list[tuple[int, int]]:
    """Each image's grid (h, w): its largest coordinates + 1 (B, N, 2) -> [(h, w)] * B."""
    hw = patch_coord.amax(dim=1) + 1
    return [(int(h), int(w)) for h, w in hw.tolist()]


def attention_mask(valid: torch.Tensor, num_prefix: int, dtype: torch.dtype, queries: int | None = None):
    """The additive mask (B, 1, N, N) of padded sequences: a pair attends where query and key are both valid (timm's
    create_attention_mask, symmetric); with `queries`, (B, 1, queries, N) on the keys alone (the attention pool).
    Prefix tokens are always valid. Masked pairs get dtype's lowest value, not -inf: a padded query's row stays a
    finite (uniform) softmax, so nothing downstream turns NaN."""
    valid = valid.bool()
    if num_prefix:
        valid = torch.cat([valid.new_ones(valid.shape[0], num_prefix), valid], dim=1)
    B, N = valid.shape
    if queries is None:
        allowed = (valid.unsqueeze(-1) & valid.unsqueeze(1)).unsqueeze(1)
    else:
        allowed = valid[:, None, None, :].expand(B, 1, queries, N)
    mask = torch.zeros_like(allowed, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def masked_pool(x: torch.Tensor, valid: torch.Tensor, kind: str) -> torch.Tensor:
    """avg / max / avgmax over the valid tokens (B, N, D) -> (B, D) (timm's global_pool_naflex)."""
    weight = valid.to(x.dtype)
    mean = (x * weight.unsqueeze(-1)).sum(dim=1) / weight.sum(dim=1, keepdim=True).clamp(min=1)
    if kind == "avg":
        return mean
    peak = x.masked_fill(~valid.bool().unsqueeze(-1), torch.finfo(x.dtype).min).amax(dim=1)
    return peak if kind == "max" else 0.5 * (mean + peak)


def drop_patches(x: torch.Tensor, valid: torch.Tensor, p: float, num_prefix: int):
    """Patch dropout on a NaFlex batch: the kept patches of each image (as layers.PatchDropout draws them), their
    validity and their indices, (B, prefix + kept, D), (B, kept) and (B, kept)."""
    prefix, x = x[:, :num_prefix], x[:, num_prefix:]
    L = x.shape[1]
    keep = random_order(x.shape[0], L, x.device)[:, : max(1, int(L * (1.0 - p)))]
    x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([prefix, x], dim=1), valid.gather(1, keep), keep


def naflex_rope(rope: Rope, patch_coord: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The RoPE table of a NaFlex batch, each image's at its own grid in its first h*w rows (row-major), zero on the
    padding (timm's NaFlexVit._generate_rope_naflex): (B, 1, N, 2*Dh), mixed (depth, B, H, N, 2*Dh)."""
    B, N = patch_coord.shape[:2]
    by_size: dict[tuple[int, int], list[int]] = {}
    for b, size in enumerate(grid_sizes(patch_coord)):
        by_size.setdefault(size, []).append(b)
    tables = {size: rope.at(size).to(dtype) for size in by_size}
    first = next(iter(tables.values()))  # (N', C) or (depth, H, N', C)
    if rope.per_block:
        out = first.new_zeros(first.shape[0], B, first.shape[1], N, first.shape[-1])
    else:
        out = first.new_zeros(B, N, first.shape[-1])
    for size, rows in by_size.items():
        n = min(N, size[0] * size[1])
        if rope.per_block:
            out[:, rows, :, :n] = tables[size][:, None, :, :n]
        else:
            out[rows, :n] = tables[size][:n]
    return out if rope.per_block else out.unsqueeze(1)


class NaFlexEmbeds(nn.Module):
    """Patches -> tokens (B, prefix + N, D): Linear projection, optional norm, the position table resampled to each
    image's grid (patches only), then the class and register tokens in front (timm's NaFlexEmbeds)."""

    def __init__(
        self,
        dim: int,
        patch_size: tuple[int, int],
        in_chans: int,
        *,
        pos: NaFlexPos,
        pos_grid: tuple[int, int],
        class_token: bool = True,
        reg_tokens: int = 0,
        bias: bool = True,
        norm_layer: NormLayer | None = None,
        pos_drop: float = 0.0,
        dynamic_img_pad: bool = False,
    ):
        """`pos_grid`: the learned table's grid; `bias`: the projection's (none before CLIP's pre-norm)."""
        super().__init__()
        (ph, pw), h, w = patch_size, *pos_grid
        self.pos, self.dynamic_img_pad = pos, dynamic_img_pad
        self.patch_size = (ph, pw)
        # Registration order is timm's, so state_dict() lists keys in the same order.
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, dim)) if reg_tokens else None
        self.proj = nn.Linear(ph * pw * in_chans, dim, bias=bias)
        self.norm = optional_norm(norm_layer, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, h, w, dim)) if pos.kind == "learn" else None
        if pos.kind == "factorized":
            self.pos_embed_y = nn.Parameter(torch.zeros(1, h, dim))
            self.pos_embed_x = nn.Parameter(torch.zeros(1, w, dim))
        self.pos_drop = Dropout(pos_drop)

    def reset_parameters(self) -> None:  # timm's: tokens normal 1e-6, tables normal 0.02
        for tok in (self.cls_token, self.reg_token):
            if tok is not None:
                nn.init.normal_(tok, std=1e-6)
        for name in ("pos_embed", "pos_embed_y", "pos_embed_x"):
            if isinstance(getattr(self, name, None), nn.Parameter):
                nn.init.normal_(getattr(self, name), std=0.02)

    def forward(self, x: torch.Tensor, patch_coord: torch.Tensor | None = None) -> torch.Tensor:
        """Images (B, C, H, W), or patches (B, N, ph*pw*C) with their coordinates -> tokens (B, prefix + N, D)."""
        grid = None
        if patch_coord is None:
            x, grid = patchify(x, self.patch_size, pad=self.dynamic_img_pad)
        x = self.norm(self.proj(x.flatten(2)))
        if self.pos.kind != "none":
            x = x + self._positions(x, grid, patch_coord)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        x = torch.cat(prefix + [x], dim=1) if prefix else x
        return self.pos_drop(x)

    # ---- position embedding ------------------------------------------------------------------------
    def _positions(self, x: torch.Tensor, grid, patch_coord) -> torch.Tensor:
        """What is added to the patch tokens x (B, N, D): the table at `grid` (images), else per image at its grid
        from `patch_coord` (zero on padding), by grid_sample at each coordinate with pos_embed_use_grid_sample."""
        factorized = self.pos.kind == "factorized"
        if grid is not None:
            return (self._factorized if factorized else self._learned)(grid, x.dtype)
        if self.pos.use_grid_sample:
            return (self._factorized_sampled if factorized else self._learned_sampled)(x, patch_coord)
        pos = x.new_zeros(x.shape)
        by_size: dict[tuple[int, int], list[int]] = {}
        for b, size in enumerate(grid_sizes(patch_coord)):
            by_size.setdefault(size, []).append(b)
        for size, rows in by_size.items():  # the first h*w tokens of each image, row-major (as timm's)
            table = (self._factorized if factorized else self._learned)(size, x.dtype)
            n = min(x.shape[1], table.shape[1])
            pos[rows, :n] = table[0, :n]
        return pos

    def _learned(self, size, dtype) -> torch.Tensor:
        """The (1, h, w, D) table at grid `size` as (1, h*w, D): resampled (to a square of the longer side, then
        cropped top-left, with pos_embed_ar_preserving) unless it is the table's own grid."""
        pos, table = self.pos, self.pos_embed
        h0, w0 = table.shape[1:3]
        if tuple(size) == (h0, w0):
            return table.reshape(1, h0 * w0, -1).to(dtype)
        target = (max(size), max(size)) if pos.ar_preserving else tuple(size)
        table = F.interpolate(
            table.permute(0, 3, 1, 2).float(),
            size=target,
            mode=pos.interp_mode,
            align_corners=pos.align_corners,
            antialias=pos.antialias,
        )[:, :, : size[0], : size[1]]
        return table.flatten(2).transpose(1, 2).to(dtype)

    def _factorized(self, size, dtype) -> torch.Tensor:
        """NaViT's factorized table: a row table and a column table, each resampled linearly, summed (1, h*w, D)."""
        h, w = size
        lengths = (max(h, w),) * 2 if self.pos.ar_preserving else (h, w)

        def axis(table: torch.Tensor, length: int) -> torch.Tensor:
            if length == table.shape[1]:
                return table.to(dtype)
            table = F.interpolate(table.permute(0, 2, 1).float(), size=length, mode="linear", align_corners=False)
            return table.permute(0, 2, 1).to(dtype)

        y = axis(self.pos_embed_y, lengths[0])[:, :h]
        x = axis(self.pos_embed_x, lengths[1])[:, :w]
        return (y.unsqueeze(2) + x.unsqueeze(1)).flatten(1, 2)

    def _learned_sampled(self, x: torch.Tensor, patch_coord: torch.Tensor) -> torch.Tensor:
        """The table sampled at each patch's normalised coordinate (timm's grid_sample path), (B, N, D)."""
        pos = self.pos
        shapes = patch_coord.amax(dim=1) + 1  # (B, 2)
        if pos.ar_preserving:
            shapes = shapes.amax(dim=1, keepdim=True).expand_as(shapes)
        coord = patch_coord.float()
        if pos.align_corners:
            grid = 2.0 * coord / (shapes[:, None, :] - 1).clamp(min=1) - 1.0
        else:
            grid = (2.0 * coord + 1.0) / shapes[:, None, :] - 1.0
        table = self.pos_embed.permute(0, 3, 1, 2).expand(x.shape[0], -1, -1, -1).float()
        pos = F.grid_sample(
            table,
            grid.flip(-1).unsqueeze(2),  # (B, N, 1, (x, y))
            mode=pos.interp_mode,
            align_corners=pos.align_corners,
            padding_mode="border",
        ).to(x.dtype)  # (B, D, N, 1)
        return pos.squeeze(-1).transpose(1, 2)

    def _factorized_sampled(self, x: torch.Tensor, patch_coord: torch.Tensor) -> torch.Tensor:
        """Both axis tables resampled per image by an affine grid_sample (timm's), read at each coordinate."""
        B, _, D = x.shape
        shapes = patch_coord.amax(dim=1) + 1
        if self.pos.ar_preserving:
            longest = shapes.amax(dim=1)
            size_y = size_x = longest.amax()
            scale_y = scale_x = size_x / longest
        else:
            size_y, size_x = shapes.amax(0)
            scale_x, scale_y = size_x / shapes[:, 1], size_y / shapes[:, 0]

        def axis(table: torch.Tensor, scale: torch.Tensor, length) -> torch.Tensor:  # (B, D, 1, length)
            table = table.permute(0, 2, 1).unsqueeze(2).expand(B, -1, -1, -1).float()
            theta = torch.zeros(B, 2, 3, device=x.device)
            theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1] = scale, scale - 1, 1
            grid = F.affine_grid(theta, (B, D, 1, length), align_corners=False)
            return F.grid_sample(table, grid, mode="bilinear", align_corners=False, padding_mode="border").to(x.dtype)

        pe_x, pe_y = axis(self.pos_embed_x, scale_x, size_x), axis(self.pos_embed_y, scale_y, size_y)
        b = torch.arange(B, device=x.device).unsqueeze(1)
        return pe_x[b, :, 0, patch_coord[..., 1]] + pe_y[b, :, 0, patch_coord[..., 0]]
