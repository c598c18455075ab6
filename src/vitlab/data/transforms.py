"""Train and eval transforms (torchvision v2), built from plain arguments so configs drive them.

Every dataset hands over uint8 image tensors (C, H, W) or PIL images; the pipelines end in float32
normalised tensors of the model's img_size. No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

from vitlab.errors import UserError

AUTO_AUGMENTS = (None, "randaugment", "trivialaugment")
INTERPOLATIONS = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}


def image_hw(img_size: int | Sequence[int]) -> tuple[int, int]:
    """An img_size (int, or [H, W]) as (H, W)."""
    return (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))


def _interp(name: str) -> InterpolationMode:
    if name not in INTERPOLATIONS:
        raise UserError(
            f"interpolation {name!r} (data.train_transform / data.eval_transform) is not one of {list(INTERPOLATIONS)}"
        )
    return INTERPOLATIONS[name]


def train_transform(
    img_size: int | Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    random_resized_crop: Sequence[float] | None = (0.08, 1.0),  # area scale range; None: no crop
    shift: int = 0,  # pad by `shift` pixels and crop back at the native size (small images)
    hflip: float = 0.5,
    auto_augment: str | None = None,  # 'randaugment' | 'trivialaugment'
    rand_augment_magnitude: int = 9,
    random_erasing: float = 0.0,
    interpolation: str = "bicubic",
) -> T.Compose:
    key = "data.train_transform"
    if auto_augment not in AUTO_AUGMENTS:
        raise UserError(f"{key}.auto_augment {auto_augment!r} is not one of {list(AUTO_AUGMENTS)}")
    for name, p in (("hflip", hflip), ("random_erasing", random_erasing)):
        if not 0.0 <= p <= 1.0:
            raise UserError(f"{key}.{name} {p} must be a probability in [0, 1]")
    if random_resized_crop and (
        len(random_resized_crop) != 2 or not 0.0 < random_resized_crop[0] <= random_resized_crop[1] <= 1.0
    ):
        raise UserError(
            f"{key}.random_resized_crop {list(random_resized_crop)} must be [min_scale, max_scale] with "
            "0 < min_scale <= max_scale <= 1 (fractions of the image area), or null"
        )
    if shift < 0:
        raise UserError(f"{key}.shift {shift} must be >= 0 pixels")
    hw, mode = image_hw(img_size), _interp(interpolation)
    ops: list = [T.ToImage()]
    if shift:
        ops.append(_Shift(shift))
    if random_resized_crop:
        ops.append(T.RandomResizedCrop(hw, scale=tuple(random_resized_crop), interpolation=mode, antialias=True))
    else:
        ops.append(_ResizeIfNeeded(hw, mode))
    if hflip:
        ops.append(T.RandomHorizontalFlip(hflip))
    # Auto-augment's rotations and shears run on tensors, where torchvision has no bicubic (timm
    # uses bilinear there too).
    aa_mode = InterpolationMode.NEAREST if mode == InterpolationMode.NEAREST else InterpolationMode.BILINEAR
    if auto_augment == "randaugment":
        ops.append(T.RandAugment(magnitude=rand_augment_magnitude, interpolation=aa_mode))
    elif auto_augment == "trivialaugment":
        ops.append(T.TrivialAugmentWide(interpolation=aa_mode))
    ops += [T.ToDtype(torch.float32, scale=True), T.Normalize(list(mean), list(std))]
    if random_erasing:
        ops.append(T.RandomErasing(random_erasing, value=0))
    return T.Compose(ops)


def eval_transform(
    img_size: int | Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    crop_pct: float = 0.875,  # resize to img_size / crop_pct, then center-crop img_size
    interpolation: str = "bicubic",
) -> T.Compose:
    if not 0.0 < crop_pct <= 1.0:
        raise UserError(f"data.eval_transform.crop_pct {crop_pct} must be in (0, 1]")
    hw, mode = image_hw(img_size), _interp(interpolation)
    ops: list = [T.ToImage()]
    if crop_pct < 1.0:
        ops += [T.Resize([int(s / crop_pct) for s in hw], interpolation=mode, antialias=True), T.CenterCrop(hw)]
    else:
        ops.append(_ResizeIfNeeded(hw, mode))
    ops += [T.ToDtype(torch.float32, scale=True), T.Normalize(list(mean), list(std))]
    return T.Compose(ops)


class _ResizeIfNeeded(T.Transform):
    """Resize to exactly (H, W); a no-op (no copy) when the image already has that size."""

    def __init__(self, hw: tuple[int, int], mode: InterpolationMode):
        super().__init__()
        self.resize = T.Resize(hw, interpolation=mode, antialias=True)
        self.hw = hw

    def forward(self, img):
        return img if tuple(img.shape[-2:]) == self.hw else self.resize(img)


class _Shift(T.Transform):
    """Random translation by up to `pixels` in each direction, zero-filled (pad, then random crop)."""

    def __init__(self, pixels: int):
        super().__init__()
        self.pixels = pixels

    def forward(self, img):
        h, w = img.shape[-2:]
        return T.RandomCrop((h, w), padding=self.pixels)(img)
