"""Train and eval transforms, built from plain arguments so configs drive them, in two halves:

- per image, in the loader's workers (torchvision v2): decode has happened; geometry and colour
  (random-resized-crop, shift, flip, RandAugment, TrivialAugment; eval's resize and center crop) run
  on uint8 (C, H, W) and the images stay uint8, so a batch crosses to the device at a quarter of
  float32's bytes and the workers do no float arithmetic;
- per batch, on the device (`DeviceTransform`): uint8 to float32 in [0, 1], normalisation, and
  random erasing, drawn per image and applied to the whole batch at once.

Their settings are the dataclasses `TrainTransform` and `EvalTransform` (the `data.train_transform` /
`data.eval_transform` groups of conf/data/*.yaml; a test keeps the YAML keys and these fields equal).
No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

from vitlab.errors import UserError
from vitlab.model.config import as_hw
from vitlab.settings import check_at_least, check_range, from_mapping, is_number

AUTO_AUGMENTS = (None, "randaugment", "trivialaugment")
INTERPOLATIONS = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}


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


def train_transform(img_size: int | Sequence[int], **settings) -> T.Compose:
    """The per-image training pipeline of `TrainTransform(**settings)`: a PIL image or uint8 tensor in,
    a uint8 (C, H, W) tensor of img_size out. Normalisation and random erasing follow on the device
    (`DeviceTransform`)."""
    t = from_mapping(TrainTransform, settings, "data.train_transform")
    hw, mode = as_hw(img_size, "data.img_size"), _interp(t.interpolation)
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
    return T.Compose(ops)


def eval_transform(img_size: int | Sequence[int], **settings) -> T.Compose:
    """The per-image evaluation (and prediction) pipeline of `EvalTransform(**settings)`: uint8 out, as
    `train_transform`."""
    t = from_mapping(EvalTransform, settings, "data.eval_transform")
    hw, mode = as_hw(img_size, "data.img_size"), _interp(t.interpolation)
    ops: list = [T.ToImage()]
    if t.crop_pct < 1.0:
        ops += [T.Resize([int(s / t.crop_pct) for s in hw], interpolation=mode, antialias=True), T.CenterCrop(hw)]
    else:
        ops.append(_ResizeIfNeeded(hw, mode))
    return T.Compose(ops)


class DeviceTransform:
    """The per-batch half, where the batch already is (the GPU in training): uint8 (B, C, H, W) to
    float32 in [0, 1], normalised with `mean`/`std`, then, when training, random erasing with
    probability `random_erasing` per image (torchvision's RandomErasing: area 2-33%, aspect 0.3-3.3,
    erased to 0 after normalisation). The same arithmetic as torchvision's ToDtype(scale=True) and
    Normalize on each image; the erased boxes are drawn on the CPU from `generator`, so a checkpoint
    that saves its state resumes the same draws."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], random_erasing: float = 0.0):
        self.mean, self.std, self.random_erasing = list(mean), list(std), random_erasing
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"DeviceTransform takes uint8 batches, got {x.dtype}")
        if x.device not in self._stats:  # copied to the device once, not per step (a copy waits for the device)
            stats = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1).to(x.device) for v in (self.mean, self.std))
            self._stats[x.device] = tuple(stats)
        mean, std = self._stats[x.device]
        x = x.to(torch.float32).div_(255).sub_(mean).div_(std)
        if train and self.random_erasing:
            boxes = erasing_boxes(len(x), x.shape[-2:], self.random_erasing, generator)
            x = erase(x, boxes.to(x.device, non_blocking=True))
        return x


ERASE_SCALE, ERASE_RATIO, ERASE_ATTEMPTS = (0.02, 0.33), (0.3, 3.3), 10  # torchvision's RandomErasing


def erasing_boxes(n: int, hw: Sequence[int], p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n, 4) int64 boxes (top, left, height, width) as torchvision's RandomErasing draws them, one per
    image: erased with probability `p`; up to 10 tries for a box of 2-33% of the area and aspect ratio
    0.3-3.3 that fits; an image without one (or not chosen) gets height and width 0."""
    H, W = int(hw[0]), int(hw[1])
    chosen = torch.rand(n, generator=generator) < p
    area = H * W * torch.empty(n, ERASE_ATTEMPTS).uniform_(*ERASE_SCALE, generator=generator)
    log_ratio = torch.empty(n, ERASE_ATTEMPTS).uniform_(*map(math.log, ERASE_RATIO), generator=generator)
    h = torch.sqrt(area * log_ratio.exp()).round().long()
    w = torch.sqrt(area / log_ratio.exp()).round().long()
    fits = (h < H) & (w < W)
    first = fits.long().argmax(1, keepdim=True)  # the first try that fits (0 when none does)
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    keep = chosen & fits.any(1)
    h, w = torch.where(keep, h, 0), torch.where(keep, w, 0)
    top = (torch.rand(n, generator=generator) * (H - h + 1)).long()
    left = (torch.rand(n, generator=generator) * (W - w + 1)).long()
    return torch.stack([top, left, h, w], 1)


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Zero each image's box ((B, 4) top, left, height, width) of a (B, C, H, W) batch in one pass."""
    rows = torch.arange(x.shape[-2], device=x.device)
    cols = torch.arange(x.shape[-1], device=x.device)
    top, left, h, w = (boxes[:, k, None] for k in range(4))  # (B, 1) each
    in_rows = (rows >= top) & (rows < top + h)  # (B, H)
    in_cols = (cols >= left) & (cols < left + w)  # (B, W)
    return x.masked_fill(in_rows[:, None, :, None] & in_cols[:, None, None, :], 0.0)


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
