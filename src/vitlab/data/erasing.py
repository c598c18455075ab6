"""Random erasing on the device, as timm's RandomErasing draws it (`erasing_boxes`) and fills it (`erase`), a batch at
a time: transforms.DeviceTransform runs it after normalisation. Its draws come from a generator, or from the Rows of
a global batch (data/seeded.py): drawn for all of it, this process's rows kept."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vitlab.data.seeded import Rows, rows_of

ERASE_SCALE, ERASE_RATIO, ERASE_ATTEMPTS = (0.02, 1 / 3), (0.3, 1 / 0.3), 10  # timm's (and torchvision's)


def erasing_boxes(
    n: int, hw: Sequence[int], p: float, generator: torch.Generator | Rows | None = None, count: int = 1
) -> torch.Tensor:
    """(n, count, 4) int64 boxes (top, left, height, width) as timm's RandomErasing draws them: an image is erased
    with probability `p`, with k boxes (1 to `count`, uniformly); each box has up to 10 tries for an area of
    2-33% of the image over k and an aspect ratio of 0.3-3.3 that fits; a box not drawn, or without a fit, has
    height and width 0. `generator`: or the Rows of a global batch (data/seeded.py): its boxes drawn, these rows'
    kept."""
    generator, start, total = rows_of(generator, n)
    if total != n:  # (drawn for the global batch)
        return erasing_boxes(total, hw, p, generator, count)[start : start + n]
    H, W = int(hw[0]), int(hw[1])
    chosen = torch.rand(n, generator=generator) < p
    k = torch.randint(1, count + 1, (n,), generator=generator) if count > 1 else torch.ones(n, dtype=torch.long)
    share = H * W / k[:, None, None]  # (n, 1, 1)
    area = share * torch.empty(n, count, ERASE_ATTEMPTS).uniform_(*ERASE_SCALE, generator=generator)
    log_ratio = torch.empty(n, count, ERASE_ATTEMPTS).uniform_(*map(math.log, ERASE_RATIO), generator=generator)
    h = torch.sqrt(area * log_ratio.exp()).round().long()
    w = torch.sqrt(area / log_ratio.exp()).round().long()
    fits = (h < H) & (w < W)
    first = fits.long().argmax(-1, keepdim=True)  # the first try that fits (0 when none does)
    h, w = h.gather(-1, first).squeeze(-1), w.gather(-1, first).squeeze(-1)
    keep = chosen[:, None] & fits.any(-1) & (torch.arange(count) < k[:, None])
    h, w = torch.where(keep, h, 0), torch.where(keep, w, 0)
    top = (torch.rand(n, count, generator=generator) * (H - h + 1)).long()
    left = (torch.rand(n, count, generator=generator) * (W - w + 1)).long()
    return torch.stack([top, left, h, w], -1)


def erase(
    x: torch.Tensor, boxes: torch.Tensor, mode: str = "const", generator: torch.Generator | Rows | None = None
) -> torch.Tensor:
    """Fill each image's boxes ((B, K, 4) top, left, height, width) of a (B, C, H, W) batch, box after box as
    timm does, with zeros (`const`), one normal colour a box (`rand`) or normal noise (`pixel`); the colours
    and the noise's seed are drawn from `generator` (or the Rows of a global batch: the colours of all of it drawn,
    these rows' kept; the noise of each image from a seed of its own)."""
    keyed = isinstance(generator, Rows)
    generator, start, total = rows_of(generator, len(x))
    rows = torch.arange(x.shape[-2], device=x.device)
    cols = torch.arange(x.shape[-1], device=x.device)
    top, left, h, w = (boxes[..., k, None] for k in range(4))  # (B, K, 1) each
    in_rows = (rows >= top) & (rows < top + h)  # (B, K, H)
    in_cols = (cols >= left) & (cols < left + w)  # (B, K, W)
    masks = in_rows[..., :, None] & in_cols[..., None, :]  # (B, K, H, W)
    if mode == "const":
        return x.masked_fill(masks.any(1, keepdim=True), 0.0)
    if mode == "pixel" and not keyed:
        seed = int(torch.randint(2**62, (), generator=generator))
        noise = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(seed), device=x.device)
        return torch.where(masks.any(1, keepdim=True), noise, x)
    if mode == "pixel":  # each erased image's noise from a seed of its own, whichever process holds it
        seeds = torch.randint(2**62, (total,), generator=generator)[start : start + len(x)].tolist()
        x = x.clone()
        for i in masks.flatten(1).any(1).nonzero().flatten().tolist():  # (one draw an erased image)
            noise = torch.randn(x.shape[1:], generator=torch.Generator(x.device).manual_seed(seeds[i]), device=x.device)
            x[i] = torch.where(masks[i].any(0, keepdim=True), noise, x[i])
        return x
    colours = torch.randn(total, boxes.shape[1], x.shape[1], generator=generator)[start : start + len(x)]
    colours = colours.to(x.device, non_blocking=True)
    for j in range(boxes.shape[1]):  # later boxes paint over earlier ones
        x = torch.where(masks[:, j, None], colours[:, j, :, None, None], x)
    return x
