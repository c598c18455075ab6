"""Rotary position embeddings (RoPE) of the patch tokens: the table of config.py's `rope` choices (ROPES below) and
how attention applies them. The choices and their checks are in rope_config.py (no torch).

A RoPE table holds, for each patch, the sines and cosines of the angles its queries' and keys' channel pairs are
rotated by: (N, 2*Dh), [sin | cos], one angle per pair, the pairs interleaved ([f0, f0, f1, f1, ...]) or, with
rope_rotate_half, in two halves ([f0, f1, ..., f0, f1, ...]). Each pair's angle is position x frequency, a quarter
of the head's channels per axis. Axial and DINOv3 tables are the same for every head and block; mixed RoPE's
frequencies are learned per block and head, (depth, H, N, 2*Dh). The class and register tokens are not rotated.
Every step (grid, frequencies, float32 sin/cos, layout) follows timm.layers.pos_embed_sincos in its order of
operations, so the tables equal timm's bit for bit.
Shapes: B batch, H heads, N patches, Dh head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class RopeSpec(NamedTuple):
    """What a table is computed from (config.py's rope fields, read by model/vit.py), as plain values (FX records
    them in its graph)."""

    kind: str
    head_dim: int
    temperature: float
    ref: tuple[int, int] | None
    offset: float
    indexing: str
    rotate_half: bool
    normalize: str
    periods: tuple[float, float] | None
    shift: float | None
    jitter: float | None
    rescale: float | None


def rope_grid(shape, spec: RopeSpec, device=None) -> torch.Tensor:  # (h, w, 2) float32 positions
    """Each patch's two coordinates: its row and column indices (+ rope_grid_offset; rescaled so that the grid spans
    rope_ref_feat_shape, EVA02's), or DINOv3's patch centres in [-1, 1]. 'xy' lists (column, row) instead."""
    shape, ref = list(shape), spec.ref and list(spec.ref)
    if spec.indexing == "xy":
        shape, ref = shape[::-1], ref and ref[::-1]
    if spec.kind == "dinov3":  # patch centres, normalised by each side (or the shorter / longer one), then to [-1, 1]
        denom = shape if spec.normalize == "separate" else [(min if spec.normalize == "min" else max)(shape)] * 2
        t = [
            (torch.arange(s, device=device).to(torch.float32) + 0.5 + spec.offset) / d
            for s, d in zip(shape, denom, strict=True)
        ]  # fmt: skip  (timm's arange(0.5, s): the same values)
    else:
        t = [torch.arange(s, device=device, dtype=torch.int64).to(torch.float32) + spec.offset for s in shape]
        if ref:
            t = [x / f * r for x, f, r in zip(t, shape, ref, strict=True)]
    grid = torch.stack(torch.meshgrid(t, indexing=spec.indexing), dim=-1).to(torch.float32)
    return 2.0 * grid - 1.0 if spec.kind == "dinov3" else grid


def augment_coords(coords: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """DINOv3's training-time augmentations of the positions (..., 2), one draw for every patch of the batch: a shift
    U(-s, s) per axis, a log-uniform scale per axis in [1/J, J], then one for both in [1/R, R] (timm's order)."""
    axes, kw = coords.shape[-1], dict(device=coords.device, dtype=coords.dtype)
    if spec.shift is not None:
        coords = coords + torch.empty(axes, **kw).uniform_(-float(spec.shift), float(spec.shift))
    if spec.jitter is not None:
        j = math.log(float(spec.jitter))
        coords = coords * torch.empty(axes, **kw).uniform_(-j, j).exp()
    if spec.rescale is not None:
        r = math.log(float(spec.rescale))
        coords = coords * torch.empty(1, **kw).uniform_(-r, r).exp()
    return coords


def _layout(x: torch.Tensor, rotate_half: bool) -> torch.Tensor:  # (..., Dh/2) -> (..., Dh)
    return torch.cat([x, x], dim=-1) if rotate_half else x.repeat_interleave(2, -1)


def _sin_cos(angles: torch.Tensor, rotate_half: bool) -> torch.Tensor:  # (..., Dh/2) -> (..., 2*Dh)
    return torch.cat([_layout(angles.sin(), rotate_half), _layout(angles.cos(), rotate_half)], dim=-1)


def axial_bands(head_dim: int, temperature: float) -> torch.Tensor:  # (Dh/4,)
    """Axial RoPE's frequencies 1 / temperature^(i / (Dh/4)), i < Dh/4 (timm's freq_bands, step 1)."""
    n = head_dim // 4
    return 1.0 / (temperature ** (torch.arange(0, n, 1, dtype=torch.int64).to(torch.float32) / n))


def dinov3_periods(spec: RopeSpec) -> torch.Tensor:  # (Dh/4,)
    """DINOv3's periods: temperature^(2i / (Dh/2)), or geometric from the min to the max period."""
    n = spec.head_dim // 4
    if spec.periods is not None:
        lo, hi = spec.periods
        return lo * ((hi / lo) ** torch.linspace(0, 1, n, dtype=torch.float32))
    return spec.temperature ** (2.0 * torch.arange(n, dtype=torch.float32) / (spec.head_dim // 2))


def mixed_freqs(head_dim: int, depth: int, num_heads: int, temperature: float) -> torch.Tensor:
    """RoPE-Mixed's initial frequencies (2, depth, H, Dh/2): magnitudes 1 / temperature^(4i / Dh) along a random
    direction per block and head, and the perpendicular one (Heo et al. 2024, Eq. 9; timm's init_random_2d_freqs)."""
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim))[None, None]
    angles = torch.rand(depth, num_heads, 1, dtype=torch.float32) * 2 * torch.pi
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=0)


def rope_table(shape, spec: RopeSpec, augment: bool = False, freqs: torch.Tensor | None = None, device=None):
    """The table of a (h, w) grid: (N, 2*Dh) [sin | cos] in float32, or mixed RoPE's (depth, H, N, 2*Dh) from its
    frequencies `freqs` (in their dtype). `augment`: DINOv3's coordinate augmentations (training)."""
    coords = rope_grid(shape, spec, freqs.device if freqs is not None else device)  # (h, w, 2)
    if spec.kind == "dinov3":
        coords = coords.flatten(0, -2)  # (N, 2)
    if augment:
        coords = augment_coords(coords, spec)
    if spec.kind == "axial":
        pos = coords.unsqueeze(-1) * axial_bands(spec.head_dim, spec.temperature).to(coords.device)  # (h, w, 2, Dh/4)
        sin = _layout(pos.sin().flatten(-2).flatten(0, -2), spec.rotate_half)
        return torch.cat([sin, _layout(pos.cos().flatten(-2).flatten(0, -2), spec.rotate_half)], dim=-1)
    if spec.kind == "dinov3":
        periods = dinov3_periods(spec).to(coords.device)
        return _sin_cos((2 * math.pi * coords[:, :, None] / periods[None, None, :]).flatten(1), spec.rotate_half)
    coords = coords.reshape(-1, 2)  # mixed: angle = x f_x + y f_y, per block and head
    t_x, t_y, f = coords[:, 0].contiguous(), coords[:, 1].contiguous(), freqs.float()
    angles = t_x.unsqueeze(-1) * f[0].unsqueeze(-2) + t_y.unsqueeze(-1) * f[1].unsqueeze(-2)  # (depth, H, N, Dh/2)
    return _sin_cos(angles, False).to(freqs.dtype)


class Rope(nn.Module):
    """The model's RoPE table for the patch tokens (B, h, w, D) of a batch: `forward` -> (N, 2*Dh), or (depth, H, N,
    2*Dh) for mixed RoPE (`per_block`). Without dynamic_img_size the table of the config's grid is kept (a buffer,
    not saved: timm's cache); with it every batch's grid is computed, as timm's; in training the DINOv3 augmentations
    draw new positions for each batch. Mixed RoPE's learned frequencies are its one parameter, `freqs` (timm's key
    rope.freqs)."""

    def __init__(
        self,
        spec: RopeSpec,
        *,
        depth: int,
        num_heads: int,
        grid_size: tuple[int, int],
        dynamic_img_size: bool = False,
        num_prefix: int = 0,
    ):
        """`grid_size`: the patch grid whose table is kept; `depth`, `num_heads`: mixed RoPE's frequencies' axes;
        `num_prefix`: the tokens before the patches, which the blocks' turns leave as they are."""
        super().__init__()
        self.spec, self.depth, self.num_heads, self.num_prefix = spec, depth, num_heads, num_prefix
        self.grid_size, self.dynamic_img_size = tuple(grid_size), dynamic_img_size
        self.per_block = spec.kind == "mixed"
        self.augments = any(v is not None for v in (spec.shift, spec.jitter, spec.rescale))
        if self.per_block:
            self.freqs = nn.Parameter(torch.empty(2, depth, num_heads, spec.head_dim // 2))
        cached = None if self.per_block else torch.empty(math.prod(grid_size), 2 * spec.head_dim)
        self.register_buffer("cached", cached, persistent=False)
        # the kept table's turns (turns() as real pairs (prefix + N, Dh/2, 2)): built with it, not every forward
        kept = None if self.per_block else torch.empty(num_prefix + math.prod(grid_size), spec.head_dim // 2, 2)
        self.register_buffer("cached_turns", kept, persistent=False)

    def reset_parameters(self) -> None:  # init.py resets every layer (after to_empty too)
        with torch.no_grad():
            if self.per_block:
                self.freqs.copy_(mixed_freqs(self.spec.head_dim, self.depth, self.num_heads, self.spec.temperature))
            else:
                self.cached.copy_(rope_table(self.grid_size, self.spec))
                self.cached_turns.copy_(torch.view_as_real(self._turns(self.cached)))

    def set_grid(self, grid_size: tuple[int, int]) -> None:
        """Another image or patch size (ViT.set_input_size): the kept table and its turns recomputed for its grid."""
        self.grid_size = tuple(grid_size)
        if not self.per_block:
            self.cached = rope_table(self.grid_size, self.spec, device=self.cached.device).to(self.cached.dtype)
            self.cached_turns = torch.view_as_real(self._turns(self.cached)).to(self.cached_turns.dtype)

    def _turns(self, table: torch.Tensor) -> torch.Tensor:
        return turns(table, self.num_prefix, self.spec.rotate_half)

    def for_blocks(self, table: torch.Tensor) -> torch.Tensor:
        """What the blocks' attention takes of a table of this model's (forward, at, keep_rows): run eagerly its
        complex turns (the kept grid's kept ones), so that each block only multiplies; compiled or exported the
        table itself (model/attention.py rotates by either)."""
        return _blocks_table(table, self.num_prefix, self.spec.rotate_half, self.cached, self.cached_turns)

    def at(self, grid: tuple[int, int]) -> torch.Tensor:
        """The table of a (h, w) grid given as numbers (NaFlex: an image's grid, from its size or its patches'
        coordinates): the kept one at the kept grid, else computed (float32, as timm's get_embed)."""
        augment = self.training and self.augments
        if self.per_block:
            return rope_table(grid, self.spec, augment, self.freqs)
        if augment or tuple(grid) != self.grid_size:
            return rope_table(grid, self.spec, augment, device=self.cached.device)
        return self.cached

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens (B, h, w, D)
        augment = self.training and self.augments
        if self.per_block:
            return _table_at(tokens, self.spec, augment, self.freqs)
        if augment or self.dynamic_img_size:
            return _table_at(tokens, self.spec, augment, self.cached, self.grid_size)  # float32, as timm's
        return self.cached


@torch.fx.wrap  # FX records one call: the grid comes from the input's shape
def _table_at(tokens: torch.Tensor, spec: RopeSpec, augment: bool, like: torch.Tensor, kept=None) -> torch.Tensor:
    """The table of the tokens' grid; the kept one (`like`, of grid `kept`) where the grid is that grid and nothing
    is drawn (timm rebuilds it every forward: the same values). Symbolic sizes (export, compile) take the computation:
    a comparison would fix the size."""
    grid = (tokens.shape[1], tokens.shape[2])
    eager = type(grid[0]) is int and type(grid[1]) is int and not torch.compiler.is_compiling()
    if eager and kept is not None and not augment and grid == tuple(kept) and like.dtype == torch.float32:
        return like
    freqs = like if spec.kind == "mixed" else None
    return rope_table(grid, spec, augment, freqs, device=like.device)


@torch.fx.wrap  # FX records one call: the choice is made when the graph runs
def _blocks_table(table: torch.Tensor, num_prefix: int, rotate_half: bool, kept, kept_turns) -> torch.Tensor:
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return table
    if table is kept and kept_turns.dtype in (torch.float32, torch.float64):
        return torch.view_as_complex(kept_turns)
    return turns(table, num_prefix, rotate_half)


# ---- applying a table --------------------------------------------------------------------------------


def rotate_pairs(xs: tuple[torch.Tensor, ...], table: torch.Tensor, num_prefix: int, rotate_half: bool) -> tuple:
    """Each of `xs` (queries and keys, (B, H, prefix + N, Dh)) rotated by one table, prepared once for all: x cos +
    swap(x) (sign . sin), where swap exchanges each pair (a, b) -> (b, a) and the sign (-, +) of the rotation
    (a, b) -> (-b, a) sits in the table, so a head costs one copy, two products and a sum (timm's: a negation and
    a copy, the same products and sum, and a concatenation). The prefix rows get cos 1 and sin 0, so the prefix
    tokens come out as they went in (x * 1 + 0) with no concatenation. Each value equals timm's apply_rot_embed_cat's
    bit for bit (a product with the sign moved is the same float)."""
    sin, cos = table.chunk(2, -1)
    if rotate_half:
        s1, s2 = sin.chunk(2, -1)
        sin = torch.cat([-s1, s2], dim=-1)
    else:
        sin = torch.stack([-sin[..., ::2], sin[..., 1::2]], -1).flatten(-2)
    if num_prefix:
        sin, cos = F.pad(sin, (0, 0, num_prefix, 0)), F.pad(cos, (0, 0, num_prefix, 0), value=1.0)
    return tuple((x * cos + _swap(x, rotate_half) * sin).to(x.dtype) for x in xs)


def rotate(xs: tuple[torch.Tensor, ...], table: torch.Tensor, num_prefix: int, rotate_half: bool) -> tuple:
    """Queries and keys (B, H, prefix + N, Dh) rotated as attention rotates them: by a table's complex turns (`turns`:
    what the model hands its blocks when it runs eagerly), each channel pair (a, b) one complex number a + ib times
    its angle's cos + i sin, one kernel a tensor where rotate_pairs takes four; by a real table [sin | cos] (compiled
    or exported, where real operations fuse and ONNX expresses them), rotate_pairs. Both are timm's
    apply_rot_embed_cat: the complex product's real part a cos - b sin and imaginary part b cos + a sin, each product
    rounded before the sum (bit for bit where the products are vectorised, as at a head of 64)."""
    if not table.is_complex():
        return rotate_pairs(xs, table, num_prefix, rotate_half)
    return tuple(_turned(x, table, rotate_half) for x in xs)


def turns(table: torch.Tensor, num_prefix: int, rotate_half: bool) -> torch.Tensor:
    """A table (..., N, 2*Dh) [sin | cos] as one complex number cos + i sin per channel pair, (..., prefix + N, Dh/2),
    complex64 (complex128 from float64), the prefix rows 1 (left as they are). Each pair's angle is read once: its two
    channels hold the same one in every RoPE table."""
    sin, cos = table.chunk(2, -1)
    pick = (lambda t: t[..., : t.shape[-1] // 2]) if rotate_half else (lambda t: t[..., ::2])
    real = torch.float64 if table.dtype == torch.float64 else torch.float32
    out = torch.complex(pick(cos).to(real), pick(sin).to(real))
    if num_prefix:
        out = torch.cat([out.new_ones(*out.shape[:-2], num_prefix, out.shape[-1]), out], dim=-2)
    return out


def _turned(x: torch.Tensor, turns: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    """`x` (..., Dh) rotated: its pairs (interleaved neighbours, or the two halves) times `turns`, computed in
    float32 at least (a bfloat16 query meets timm's float32 table in float32 too) and returned in x's dtype."""
    real = torch.float64 if torch.float64 in (x.dtype, turns.real.dtype) else torch.float32
    turns = turns.to(torch.complex128 if real == torch.float64 else torch.complex64)
    if rotate_half:
        a, b = x.to(real).chunk(2, dim=-1)
        out = torch.view_as_real(torch.complex(a, b) * turns)  # (..., Dh/2, 2)
        return torch.cat([out[..., 0], out[..., 1]], dim=-1).to(x.dtype)
    pairs = x.to(real).unflatten(-1, (-1, 2))  # (..., Dh/2, 2): a view of the projection's output where it can be
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # (view_as_complex reads whole pairs: even strides)
    return torch.view_as_real(torch.view_as_complex(pairs) * turns).flatten(-2).to(x.dtype)


def _swap(x: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    """Each channel pair (a, b) -> (b, a): the halves of the head, or interleaved neighbours."""
    if rotate_half:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x2, x1], dim=-1)
    return torch.stack([x[..., 1::2], x[..., ::2]], -1).flatten(-2)  # (flip(-1) is twice as slow on the CPU)


def keep_rows(table: torch.Tensor, keep: torch.Tensor, batched: bool = False) -> torch.Tensor:
    """The table's rows of the kept patches `keep` (B, n) of each image (patch dropout, MAE's masking): (N, 2*Dh) ->
    (B, 1, n, 2*Dh); mixed (depth, H, N, 2*Dh) -> (depth, B, H, n, 2*Dh). `batched`: a table with its batch axis
    already, (B, 1, N, 2*Dh) or (depth, B, H, N, 2*Dh) (NaFlex's, one grid per image)."""
    if not batched:
        table = table.unsqueeze(-3) if table.ndim == 2 else table  # (1, N, C) or (depth, H, N, C)
        table = table.unsqueeze(-4)  # a batch axis before the heads
        table = table.expand(*table.shape[:-4], keep.shape[0], *table.shape[-3:])
    shape = list(table.shape)
    shape[-2] = keep.shape[1]
    index = keep[:, None, :, None] if table.ndim == 4 else keep[None, :, None, :, None]
    return table.gather(-2, index.expand(shape))


ROPES = {"axial": Rope, "mixed": Rope, "dinov3": Rope}  # config.py's rope ('' none); built with (spec, ...)
