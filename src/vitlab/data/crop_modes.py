"""Evaluation's resize and crop as timm's `transforms_imagenet_eval` makes them, by crop mode, on uint8 (C, H, W)
tensors: the geometry of `data.eval_transform` (its settings: data/transforms.py's EvalTransform). No Hydra, OmegaConf
or Lightning here."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from PIL import Image
from torchvision.transforms import v2 as T

# How evaluation fits an image to img_size (timm's `crop_mode`, named in each pretrained config): `center` resizes the
# shorter side to img_size / crop_pct and crops the centre (aspect kept: timm's default, DINO's, DINOv2's, MAE's);
# `squash` resizes both sides to img_size / crop_pct (aspect lost) and crops; `border` fits the longer side to
# img_size / crop_pct and pads with the data's mean colour (nothing lost at crop_pct 1).
CROP_MODES = ("center", "squash", "border")
# Evaluation resizes through PIL (as timm, DINO and DINOv2 do), so it takes PIL's filters.
PIL_FILTERS = {n: Image.Resampling[n.upper()] for n in ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")}


class ResizeCrop:
    """Evaluation's resize and crop of a uint8 (C, H, W) image (or a batch of them, each on its own), pixel for pixel
    timm's `transforms_imagenet_eval` on the PIL image: the resize runs in PIL, since torchvision's uint8 tensor
    resize rounds otherwise (off by up to 17 levels in a bicubic upsampling, measured); crop and pad are exact on
    tensors. An image already of the size it would be resized to is not resized (nor copied)."""

    def __init__(self, hw: tuple[int, int], crop_pct: float, crop_mode: str, interpolation: str, mean: Sequence[float]):
        self.hw, self.crop_pct, self.crop_mode, self.interpolation = hw, crop_pct, crop_mode, interpolation
        self.fill = [round(255 * m) for m in mean]  # timm's border fill: the mean colour in 0..255

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        hw = tuple(img.shape[-2:])
        size = resized_hw(hw, self.hw, self.crop_pct, self.crop_mode)
        if size == hw == self.hw:
            return img
        if img.ndim == 4:  # images held in memory, transformed a chunk at a time (data/resident.py)
            return torch.stack([self(x) for x in img]) if len(img) else img
        if size != hw:
            pil = T.functional.to_pil_image(img).resize(size[::-1], PIL_FILTERS[self.interpolation])
            img = T.functional.to_image(pil)
        if self.crop_mode == "border":
            return center_crop_or_pad(img, self.hw, self.fill)
        return img if tuple(img.shape[-2:]) == self.hw else T.functional.center_crop(img, list(self.hw))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hw}, crop_pct={self.crop_pct}, {self.crop_mode}, {self.interpolation})"


def resized_hw(hw: tuple[int, int], target: tuple[int, int], crop_pct: float, crop_mode: str) -> tuple[int, int]:
    """The size evaluation resizes an (h, w) image to before its crop, as timm computes it: the target over crop_pct
    rounded down; `center` with a square target is torchvision's Resize(int) (the shorter side to it, the longer
    truncated), `center` with another target and `border` are timm's ResizeKeepRatio (the shorter, resp. longer,
    side's ratio; both sides rounded)."""
    scale = tuple(math.floor(s / crop_pct) for s in target)
    if crop_mode == "squash":
        return scale
    (h, w), (sh, sw) = hw, scale
    if crop_mode == "center" and sh == sw:
        short, long = min(h, w), max(h, w)
        new_long = int(sh * long / short)
        return (sh, new_long) if h <= w else (new_long, sh)
    ratios = (h / sh, w / sw)
    ratio = max(ratios) if crop_mode == "border" else min(ratios)
    return round(h / ratio), round(w / ratio)


def center_crop_or_pad(img: torch.Tensor, hw: tuple[int, int], fill: Sequence[int]) -> torch.Tensor:
    """timm's CenterCropOrPad: pad a side shorter than the target with `fill` (the odd pixel after), then crop
    the centre."""
    (th, tw), (h, w) = hw, img.shape[-2:]
    if th > h or tw > w:
        left, top = max(tw - w, 0) // 2, max(th - h, 0) // 2
        right, bottom = max(tw - w, 0) - left, max(th - h, 0) - top
        padded = torch.empty((*img.shape[:-2], h + top + bottom, w + left + right), dtype=img.dtype)
        padded[...] = torch.tensor(fill, dtype=img.dtype).view(-1, 1, 1)
        padded[..., top : top + h, left : left + w] = img
        img = T.functional.to_image(padded)
    return img if tuple(img.shape[-2:]) == hw else T.functional.center_crop(img, list(hw))
