"""Position embeddings and their resampling, and the patch filters' (FlexiViT): pure functions of tensors, and
the table of position embeddings a config picks from (POS_EMBEDS).

Fixed tables (1-D sinusoid, big_vision's and MAE's 2-D sin-cos) are recomputed at any size; learned ones are resampled
bicubically on their grid by one of two rules (POS_EMBED_RESAMPLE): timm's `resample_abs_pos_embed` (the default), or
DINO's and DINOv2's `interpolate_pos_encoding`, which their weights were trained and evaluated with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def posemb_sincos_1d(length: int, dim: int, temperature: float = 10_000.0, device=None) -> torch.Tensor:
    """Fixed 1-D sinusoid of "Attention Is All You Need" (Sec. 3.5), sin and cos interleaved as T2T-ViT's
    `get_sinusoid_encoding`: (1, length, dim), row i, channels 2j and 2j+1 = sin, cos of i / temperature^(2j/dim)."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    omega = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)  # (dim/2,)
    angles = pos * omega  # (length, dim/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[None]


def posemb_sincos_2d(grid_size: tuple[int, int], dim: int, temperature: float = 10_000.0, device=None) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding as big_vision's `posemb_sincos_2d`: (1, H*W, dim), channels [sin x, cos x, sin y,
    cos y] with frequencies 1 / temperature^(i / (dim/4 - 1)), i < dim/4, in float32."""
    return _sincos_2d(grid_size, dim, max(dim // 4 - 1, 1), temperature, torch.float32, device)


def posemb_sincos_2d_mae(grid_size: tuple[int, int], dim: int, prefix: int = 1, device=None) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding as MAE's `get_2d_sincos_pos_embed` (facebookresearch/mae util/pos_embed.py):
    (1, prefix + H*W, dim), zero rows for the prefix tokens, then the same channel layout as big_vision's with
    frequencies 1 / 10000^(i / (dim/4)), computed in float64 as MAE's numpy code and rounded to float32."""
    table = _sincos_2d(grid_size, dim, dim // 4, 10_000.0, torch.float64, device).float()
    return torch.cat([torch.zeros(1, prefix, dim, device=device), table], dim=1)


def _sincos_2d(grid_size, dim: int, denominator: float, temperature: float, dtype, device) -> torch.Tensor:
    h, w = grid_size
    kw = dict(dtype=dtype, device=device)
    y, x = torch.meshgrid(torch.arange(h, **kw), torch.arange(w, **kw), indexing="ij")  # x varies fastest
    omega = 1.0 / temperature ** (torch.arange(dim // 4, **kw) / denominator)  # (dim/4,)
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)[None]


# config.py's pos_embed -> the table for a (h, w) grid, (1, prefix + h*w, D) with `prefix` rows for the class and
# register tokens (sincos2d: patches only; sincos2d_mae: zeros): zeros that the model learns, a fixed sinusoid, or
# None ('none').
POS_EMBEDS = {
    "learn": lambda grid, prefix, dim, device=None: torch.zeros(1, prefix + grid[0] * grid[1], dim, device=device),
    "sincos1d": lambda grid, prefix, dim, device=None: posemb_sincos_1d(prefix + grid[0] * grid[1], dim, device=device),
    "sincos2d": lambda grid, prefix, dim, device=None: posemb_sincos_2d(grid, dim, device=device),
    "sincos2d_mae": lambda grid, prefix, dim, device=None: posemb_sincos_2d_mae(grid, dim, prefix, device=device),
    "none": lambda grid, prefix, dim, device=None: None,
    "factorized": lambda grid, prefix, dim, device=None: None,  # NaFlex's two axis tables: model/naflex.py builds them
}


# How a learned table is resampled to another grid (the config's pos_embed_resample, one of POS_EMBED_RESAMPLE):
# - "timm": timm's resample_abs_pos_embed, bicubic with antialias to the exact grid;
# - "dino": DINO's vision_transformer.py and DINOv2's models/vision_transformer.py interpolate_pos_encoding (DINOv2 with
#   interpolate_offset=0.1, interpolate_antialias=False, its default and its hub's non-register models): bicubic
#   without antialias at the scale factor (n + 0.1) / old, the table as it is at its own grid. (DINOv2's register
#   models use offset 0 and antialias: timm's rule.)
DINO_OFFSET = 0.1  # DINO's "small number to avoid floating point error in the interpolation" (dino issue #8)


def resample_pos_embed(
    posemb: torch.Tensor,  # (1, prefix + h*w, D)
    new_size: Sequence[int],
    old_size: Sequence[int] | None = None,
    num_prefix_tokens: int = 1,
    rule: str = "timm",
) -> torch.Tensor:
    """Resample the patch rows of a position embedding to a new grid (in fp32), keeping the prefix rows, by `rule`
    (POS_EMBED_RESAMPLE; "timm": exactly as timm's `resample_abs_pos_embed`). Without `old_size` the rows are read
    as the grid of the new one's aspect ratio (square for a square model, as timm assumes)."""
    new_size = (int(new_size[0]), int(new_size[1]))
    n_old = posemb.shape[1] - num_prefix_tokens
    old_size = old_size or grid_like(n_old, new_size)
    old_size = (int(old_size[0]), int(old_size[1]))
    if old_size == new_size:
        return posemb
    return resample_grid(posemb, new_size, old_size, num_prefix_tokens, rule)


def grid_like(n: int, like: Sequence[int]) -> tuple[int, int]:
    """The (h, w) with h * w = n whose aspect ratio is closest to `like`'s: the grid of a pos_embed saved
    without its size. Refused when even the closest is more than 2x off (likely not the same images)."""
    ratio = like[0] / like[1]
    h = min((h for h in range(1, n + 1) if n % h == 0), key=lambda h: abs(math.log(h * h / n / ratio)))
    if abs(math.log(h * h / n / ratio)) > math.log(2.0):
        raise ValueError(f"pos_embed has {n} patch rows, no grid near the aspect ratio of {tuple(like)}; give its size")
    return h, n // h


def resample_grid(posemb: torch.Tensor, new_size, old_size, num_prefix_tokens: int, rule: str = "timm") -> torch.Tensor:
    # timm's rule has no shortcut for new_size == old_size (bicubic at scale 1 is exact), so traced sizes stay
    # symbolic; DINO's scale factor is not 1 there, and its code returns the table unchanged.
    if rule == "dino" and tuple(new_size) == tuple(old_size):
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim = posemb.shape[-1]
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)  # (1, D, h, w)
    if rule == "dino":
        scale = ((new_size[0] + DINO_OFFSET) / old_size[0], (new_size[1] + DINO_OFFSET) / old_size[1])
        grid = F.interpolate(grid, scale_factor=scale, mode="bicubic")  # (their output: floor(n + 0.1) = n rows)
    else:
        grid = F.interpolate(grid, size=new_size, mode="bicubic", antialias=True)
    grid = grid.permute(0, 2, 3, 1).flatten(1, 2).to(posemb.dtype)
    return torch.cat([prefix, grid], dim=1) if num_prefix_tokens else grid


def resample_patch_embed(weight: torch.Tensor, new_size: Sequence[int]) -> torch.Tensor:
    """Patch filters (D, C, p, p) for another patch size, by FlexiViT's pseudo-inverse resize (Beyer et al.
    2023, Eq. 4; timm's `resample_patch_embed`): the new filter w' minimises |<x, w> - <resize(x), w'>| over
    patches x, so tokens of resized patches keep their values."""
    old = tuple(weight.shape[-2:])
    new = (int(new_size[0]), int(new_size[1]))
    if old == new:
        return weight
    n_old = old[0] * old[1]
    basis = torch.eye(n_old, dtype=torch.float32, device=weight.device).reshape(n_old, 1, *old)
    resize = F.interpolate(basis, size=new, mode="bicubic", antialias=True).reshape(n_old, -1)  # (n_old, n_new)
    pinv = torch.linalg.pinv(resize)  # (n_new, n_old)
    w = weight.float().flatten(2) @ pinv.T  # (D, C, n_new)
    return w.reshape(*weight.shape[:2], *new).to(weight.dtype)
