"""Train and eval transforms (torchvision v2), built from plain arguments so configs drive them.

Every dataset hands over uint8 image tensors (C, H, W) or PIL images; the pipelines end in float32
normalised tensors of the model's img_size. Their settings are the dataclasses `TrainTransform` and
`EvalTransform` (the `data.train_transform` / `data.eval_transform` groups of conf/data/*.yaml; a test
keeps the YAML keys and these fields equal). No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

from vitlab.errors import UserError
from vitlab.settings import check_at_least, check_range, from_mapping, is_number

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


@dataclass(frozen=True)
class TrainTransform:
    """`data.train_transform`: the augmentation of training images (defaults: ImageNet's recipe)."""

    random_resized_crop: tuple[float, float] | None = (0.08, 1.0)  # area scale range; None: no crop
    shift: int = 0  # pad by `shift` pixels and crop back at the native size (small images)
    hflip: float = 0.5
    auto_augment: str | None = None  # 'randaugment' | 'trivialaugment'
    rand_augment_magnitude: int = 9
    random_erasing: float = 0.0
    interpolation: str = "bicubic"

    def __post_init__(self):
        key = "data.train_transform"
        if self.auto_augment not in AUTO_AUGMENTS:
            raise UserError(f"{key}.auto_augment {self.auto_augment!r} is not one of {list(AUTO_AUGMENTS)}")
        for name in ("hflip", "random_erasing"):
            check_range(f"{key}.{name}", getattr(self, name), 0, 1)
        crop = self.random_resized_crop
        if crop is not None:
            if len(crop) != 2 or not all(is_number(c) for c in crop) or not 0.0 < crop[0] <= crop[1] <= 1.0:
                raise UserError(
                    f"{key}.random_resized_crop {list(crop)} must be [min_scale, max_scale] with "
                    "0 < min_scale <= max_scale <= 1 (fractions of the image area), or null"
                )
            object.__setattr__(self, "random_resized_crop", tuple(crop))
        check_at_least(f"{key}.shift", self.shift)
        check_at_least(f"{key}.rand_augment_magnitude", self.rand_augment_magnitude)
        _interp(self.interpolation)


@dataclass(frozen=True)
class EvalTransform:
    """`data.eval_transform`: resize to img_size / crop_pct, then center-crop img_size."""

    crop_pct: float = 0.875
    interpolation: str = "bicubic"

    def __post_init__(self):
        check_range("data.eval_transform.crop_pct", self.crop_pct, 0, 1, low_open=True)
        _interp(self.interpolation)


def train_transform(
    img_size: int | Sequence[int], mean: Sequence[float], std: Sequence[float], **settings
) -> T.Compose:
    """The training pipeline for `TrainTransform(**settings)`, ending in normalised float32 images."""
    t = from_mapping(TrainTransform, settings, "data.train_transform")
    hw, mode = image_hw(img_size), _interp(t.interpolation)
    ops: list = [T.ToImage()]
    if t.shift:
        ops.append(_Shift(t.shift))
    if t.random_resized_crop:
        ops.append(T.RandomResizedCrop(hw, scale=t.random_resized_crop, interpolation=mode, antialias=True))
    else:
        ops.append(_ResizeIfNeeded(hw, mode))
    if t.hflip:
        ops.append(T.RandomHorizontalFlip(t.hflip))
    # Auto-augment's rotations and shears run on tensors, where torchvision has no bicubic (timm
    # uses bilinear there too).
    aa_mode = InterpolationMode.NEAREST if mode == InterpolationMode.NEAREST else InterpolationMode.BILINEAR
    if t.auto_augment == "randaugment":
        ops.append(T.RandAugment(magnitude=t.rand_augment_magnitude, interpolation=aa_mode))
    elif t.auto_augment == "trivialaugment":
        ops.append(T.TrivialAugmentWide(interpolation=aa_mode))
    ops += [T.ToDtype(torch.float32, scale=True), T.Normalize(list(mean), list(std))]
    if t.random_erasing:
        ops.append(T.RandomErasing(t.random_erasing, value=0))
    return T.Compose(ops)


def eval_transform(img_size: int | Sequence[int], mean: Sequence[float], std: Sequence[float], **settings) -> T.Compose:
    """The evaluation (and prediction) pipeline for `EvalTransform(**settings)`."""
    t = from_mapping(EvalTransform, settings, "data.eval_transform")
    hw, mode = image_hw(img_size), _interp(t.interpolation)
    ops: list = [T.ToImage()]
    if t.crop_pct < 1.0:
        ops += [T.Resize([int(s / t.crop_pct) for s in hw], interpolation=mode, antialias=True), T.CenterCrop(hw)]
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
