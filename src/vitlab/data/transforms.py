"""Train and eval transforms, built from plain arguments so configs drive them, in two halves:

- per image, in the loader's workers (torchvision v2): decode has happened; geometry and colour
  (random-resized-crop or DeiT III's simple crop, shift, flip, an auto-augment policy, colour jitter,
  grayscale, blur; eval's resize and crop, as timm's crop modes, its resize in PIL) run on uint8 (C, H, W) and
  the images stay uint8, so a batch crosses to the device at a quarter of float32's bytes and the workers do no
  float arithmetic.
  timm's auto-augment policies (`rand-m9-mstd0.5-inc1`, `augmix-m5-w4-d2`, `3a`, `v0`, ...) are timm's own
  code, on the PIL image of the uint8 one (PIL images are uint8 too);
- per batch, on the device (`DeviceTransform`): uint8 to float32 in [0, 1], normalisation, and
  random erasing as timm's (modes const/rand/pixel, up to `count` boxes), drawn per image and applied to
  the whole batch at once.

Their settings are the dataclasses `TrainTransform` and `EvalTransform` (the `data.train_transform` /
`data.eval_transform` groups of conf/data/*.yaml; a test keeps the YAML keys and these fields equal).
No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

from vitlab.data.crop_modes import CROP_MODES, PIL_FILTERS, ResizeCrop
from vitlab.data.erasing import erase, erasing_boxes
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, check_range, from_mapping, is_number

TORCHVISION_AUGMENTS = ("randaugment", "trivialaugment")
TIMM_POLICIES = ("rand-", "augmix-", "3a", "v0", "original")  # how timm's policy strings start (timm.data.auto_augment)
ERASING_MODES = ("const", "rand", "pixel")  # timm's RandomErasing: zeros, one normal colour a box, normal noise
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
    simple_crop: bool = False  # DeiT III's: resize the short side to img_size, random crop with 4 pixels' reflection
    shift: int = 0  # pad by `shift` pixels and crop back at the native size (small images)
    hflip: float = 0.5
    auto_augment: str | None = None  # torchvision's 'randaugment' | 'trivialaugment', or a timm policy string
    rand_augment_magnitude: int = 9  # torchvision's RandAugment's (a timm string carries its own: m9)
    color_jitter: float | tuple[float, ...] | None = None  # brightness, contrast, saturation[, hue]; one number: x3
    color_jitter_prob: float = 1.0
    grayscale_prob: float = 0.0
    gaussian_blur_prob: float = 0.0  # kernel 23, sigma 0.1-2 (timm's)
    random_erasing: float = 0.0  # chance an image is erased (on the device, after normalisation)
    erasing_mode: str = "const"  # const | rand | pixel (timm's re_mode; DeiT: pixel)
    erasing_count: int = 1  # boxes an image: 1 to this many, their area shared (timm's re_count)
    interpolation: str = "bicubic"

    def __post_init__(self):
        key = "data.train_transform"
        aa = self.auto_augment
        if aa is not None and aa not in TORCHVISION_AUGMENTS:
            timm_policy(aa, (224, 224), (0.5, 0.5, 0.5), "bilinear")  # a one-line error for a bad string
        for name in ("hflip", "random_erasing", "color_jitter_prob", "grayscale_prob", "gaussian_blur_prob"):
            check_range(f"{key}.{name}", getattr(self, name), 0, 1)
        if self.erasing_mode not in ERASING_MODES:
            raise UserError(f"{key}.erasing_mode {self.erasing_mode!r} is not one of {list(ERASING_MODES)}")
        if not isinstance(self.erasing_count, int) or self.erasing_count < 1:
            raise UserError(f"{key}.erasing_count {self.erasing_count!r} must be a number of boxes >= 1")
        cj = self.color_jitter
        if cj is not None:
            cj = tuple(cj) if isinstance(cj, (list, tuple)) else (cj,) * 3
            if len(cj) not in (3, 4) or not all(is_number(c) and c >= 0 for c in cj):
                raise UserError(
                    f"{key}.color_jitter {self.color_jitter!r} must be a number >= 0 (brightness, contrast and "
                    "saturation) or [brightness, contrast, saturation] or [..., hue], or null"
                )
            object.__setattr__(self, "color_jitter", cj)
        if self.simple_crop and self.random_resized_crop is not None:
            raise UserError(
                f"{key}.simple_crop=true replaces random-resized-crop: set {key}.random_resized_crop=null with it"
            )
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
    """`data.eval_transform`: fit each image to img_size as `crop_mode` says (CROP_MODES), from img_size / crop_pct."""

    crop_pct: float = 0.875
    crop_mode: str = "center"
    interpolation: str = "bicubic"

    def __post_init__(self):
        key = "data.eval_transform"
        check_range(f"{key}.crop_pct", self.crop_pct, 0, 1, low_open=True)
        if self.crop_mode not in CROP_MODES:
            raise UserError(f"{key}.crop_mode {self.crop_mode!r} is not one of {list(CROP_MODES)}")
        if self.interpolation not in PIL_FILTERS:
            raise UserError(f"{key}.interpolation {self.interpolation!r} is not one of {list(PIL_FILTERS)}")


def timm_policy(name: str, img_hw: Sequence[int], mean: Sequence[float], interpolation: str):
    """timm's auto-augment transform for the policy string `name` (on PIL images), with the settings timm's
    `transforms_imagenet_train` gives it: translations up to 45% of the image, the data's mean as the fill."""
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
    from timm.data.transforms import str_to_pil_interp

    fill = tuple(min(255, round(255 * m)) for m in mean)
    hparams = {
        "translate_const": int(min(img_hw) * 0.45),
        "img_mean": fill if len(fill) > 1 else fill[0],
        "interpolation": str_to_pil_interp(interpolation),
    }
    try:
        if not isinstance(name, str) or not name.startswith(TIMM_POLICIES):
            raise AssertionError
        if name.startswith("rand"):
            return rand_augment_transform(name, hparams)
        if name.startswith("augmix"):
            return augment_and_mix_transform(name, hparams | {"translate_pct": 0.3})
        return auto_augment_transform(name, hparams)
    except (AssertionError, KeyError, ValueError):
        raise UserError(
            f"data.train_transform.auto_augment {name!r} is not one of {list(TORCHVISION_AUGMENTS)} (torchvision's) "
            "or a timm policy string (rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, 3a, v0, original: timm.data.auto_augment)"
        ) from None


class _OnPIL:
    """A transform of PIL images (timm's policies) on a uint8 (C, H, W) image: through PIL and back, uint8 both."""

    def __init__(self, op):
        self.op = op

    def __call__(self, img):
        return T.functional.to_image(self.op(T.functional.to_pil_image(img)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.op!r})"


class ColorJitter(T.ColorJitter):
    """torchvision's ColorJitter, the same draws and the same uint8 pixels, at half its time on a uint8 RGB image
    (0.37 against 0.70 ms at 224 px on one core): torchvision converts to float32 and back once per adjustment;
    here the image is converted once, and each adjustment truncates in place where torchvision's cast to uint8
    would (exact: uint8 values are whole float32s). Hue, float and 1-channel images take torchvision's path."""

    def transform(self, inpt, params):
        if not isinstance(inpt, torch.Tensor) or inpt.dtype != torch.uint8 or inpt.shape[-3] != 3:
            return super().transform(inpt, params)
        x = inpt.to(torch.float32)
        for fn_id in params["fn_idx"].tolist():  # torchvision's random order, drawn in make_params
            b, c = params["brightness_factor"], params["contrast_factor"]
            s, h = params["saturation_factor"], params["hue_factor"]
            if fn_id == 0 and b is not None:
                x.mul_(b).clamp_(0, 255).trunc_()
            elif fn_id == 1 and c is not None:  # blended with the mean of the (floored) grayscale image
                mean = _gray(x).floor_().mean(dim=(-3, -2, -1), keepdim=True)
                x.mul_(c).add_(mean, alpha=1.0 - c).clamp_(0, 255).trunc_()
            elif fn_id == 2 and s is not None:  # blended with the (floored) grayscale image, taken before the mul_
                gray = _gray(x).floor_()
                x.mul_(s).add_(gray, alpha=1.0 - s).clamp_(0, 255).trunc_()
            elif fn_id == 3 and h is not None:
                x = T.functional.adjust_hue(x.to(torch.uint8), h).to(torch.float32)
        out = x.to(torch.uint8)
        return tv_tensors.wrap(out, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else out


def _gray(x: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) float32 -> (..., 1, H, W): torchvision's rgb_to_grayscale weights, in its order of operations."""
    r, g, b = x.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(dim=-3)


def train_transform(img_size: int | Sequence[int], mean: Sequence[float] = (0.5, 0.5, 0.5), **settings) -> T.Compose:
    """The per-image training pipeline of `TrainTransform(**settings)`: a PIL image or uint8 tensor in,
    a uint8 (C, H, W) tensor of img_size out, in timm's order (crop, flip, policy, colour). Normalisation and
    random erasing follow on the device (`DeviceTransform`). `mean` (the data's) fills what timm's policies
    uncover."""
    t = from_mapping(TrainTransform, settings, "data.train_transform")
    hw, mode = as_hw(img_size, "data.img_size"), _interp(t.interpolation)
    ops: list = [T.ToImage()]
    if t.shift:
        ops.append(Shift(t.shift))
    if t.random_resized_crop:
        ops.append(T.RandomResizedCrop(hw, scale=t.random_resized_crop, interpolation=mode, antialias=True))
    elif t.simple_crop:  # DeiT III's augment.py: Resize(img_size), RandomCrop(img_size, padding=4, reflect)
        ops.append(T.Resize(min(hw), interpolation=mode, antialias=True))
        ops.append(T.RandomCrop(hw, padding=4, padding_mode="reflect", pad_if_needed=True))
    else:
        ops.append(_ResizeIfNeeded(hw, mode))
    if t.hflip:
        ops.append(T.RandomHorizontalFlip(t.hflip))
    return T.Compose(ops + policy_ops(t, hw, mean))


def policy_ops(t: TrainTransform, hw: tuple[int, int], mean: Sequence[float]) -> list:
    """The per-image ops after the crop and flip, on uint8 (C, H, W): the policy (auto_augment), colour jitter,
    grayscale and blur; `hw` sizes timm's policies (their translations), `mean` fills what they uncover. NaFlex's
    training (data/naflex.py) runs them on each image at its own size."""
    ops: list = []
    mode = _interp(t.interpolation)
    # Auto-augment's rotations and shears run on tensors, where torchvision has no bicubic (timm
    # uses bilinear there too).
    aa_mode = InterpolationMode.NEAREST if mode == InterpolationMode.NEAREST else InterpolationMode.BILINEAR
    if t.auto_augment == "randaugment":
        ops.append(T.RandAugment(magnitude=t.rand_augment_magnitude, interpolation=aa_mode))
    elif t.auto_augment == "trivialaugment":
        ops.append(T.TrivialAugmentWide(interpolation=aa_mode))
    elif t.auto_augment is not None:
        ops.append(_OnPIL(timm_policy(t.auto_augment, hw, mean, t.interpolation)))
    if t.color_jitter is not None:  # applied whenever set (timm leaves it out beside a policy other than 3a)
        ops.append(T.RandomApply([ColorJitter(*t.color_jitter)], p=t.color_jitter_prob))
    if t.grayscale_prob:
        ops.append(T.RandomGrayscale(t.grayscale_prob))
    if t.gaussian_blur_prob:
        ops.append(T.RandomApply([T.GaussianBlur(kernel_size=23)], p=t.gaussian_blur_prob))
    return ops


def eval_transform(img_size: int | Sequence[int], mean: Sequence[float] = (0.5, 0.5, 0.5), **settings) -> T.Compose:
    """The per-image evaluation (and prediction) pipeline of `EvalTransform(**settings)`: uint8 out, as
    `train_transform`; `mean` (the data's) is the colour crop_mode=border pads with."""
    t = from_mapping(EvalTransform, settings, "data.eval_transform")
    return T.Compose(
        [T.ToImage(), ResizeCrop(as_hw(img_size, "data.img_size"), t.crop_pct, t.crop_mode, t.interpolation, mean)]
    )


def timm_eval_cfg(
    img_size: int | Sequence[int], channels: int, mean: Sequence[float], std: Sequence[float], **settings
) -> dict[str, Any]:
    """`eval_transform(img_size, mean, **settings)` and the normalisation by `mean`/`std` after it, in the names of
    timm's pretrained_cfg: timm's resolve_data_config and create_transform make the same tensor of an image from it
    (pixel for pixel: tests/data/test_transforms.py), so a model exported with it is fed as vitlab feeds it."""
    t = from_mapping(EvalTransform, settings, "data.eval_transform")
    return {
        "input_size": (channels, *as_hw(img_size, "data.img_size")),
        "interpolation": t.interpolation,
        "crop_pct": t.crop_pct,
        "crop_mode": t.crop_mode,
        "mean": tuple(mean),
        "std": tuple(std),
    }


class DeviceTransform:
    """The per-batch half, where the batch already is (the GPU in training): uint8 (B, C, H, W) to
    float32 in [0, 1], normalised with `mean`/`std`, then, when training, random erasing as timm's
    RandomErasing does it after normalisation: with probability `random_erasing` an image gets 1 to `count`
    boxes (area 2-33% shared among them, aspect 0.3-3.3), filled by `mode`: `const` zeros, `rand` one normal
    colour a box, `pixel` normal noise. The same arithmetic as torchvision's ToDtype(scale=True) and Normalize
    on each image; the boxes and colours are drawn on the CPU from `generator`, and the noise on the device
    from a seed drawn there, so a checkpoint that saves its state resumes the same draws."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        random_erasing: float = 0.0,
        mode: str = "const",
        count: int = 1,
        size: Sequence[int] | None = None,
        interpolation: str = "bicubic",
    ):
        self.mean, self.std, self.random_erasing = list(mean), list(std), random_erasing
        self.mode, self.count = mode, count
        # A batch of another size is resized to `size` once normalised (torchvision's resize, antialiased): training
        # images kept on the device at their own size, shifted there before the resize (data/resident.py).
        self.size = tuple(size) if size is not None else None
        self.interpolation = _interp(interpolation)
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, train: bool, generator: torch.Generator | None = None, size: Sequence[int] | None = None
    ) -> torch.Tensor:
        """`size`: this batch's, instead of `size` (training at several sizes, data/sizes.py)."""
        if x.dtype != torch.uint8:
            raise TypeError(f"DeviceTransform takes uint8 batches, got {x.dtype}")
        if x.device not in self._stats:  # copied to the device once, not per step (a copy waits for the device)
            stats = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1).to(x.device) for v in (self.mean, self.std))
            self._stats[x.device] = tuple(stats)
        mean, std = self._stats[x.device]
        x = x.to(torch.float32).div_(255).sub_(mean).div_(std)
        size = tuple(size) if size is not None else self.size
        if size is not None and tuple(x.shape[-2:]) != size:
            x = T.functional.resize(x, list(size), interpolation=self.interpolation, antialias=True)
        if train and self.random_erasing:
            boxes = erasing_boxes(len(x), x.shape[-2:], self.random_erasing, generator, self.count)
            x = erase(x, boxes.to(x.device, non_blocking=True), self.mode, generator)
        return x


class _ResizeIfNeeded(T.Transform):
    """Resize to exactly (H, W); a no-op (no copy) when the image already has that size."""

    def __init__(self, hw: tuple[int, int], mode: InterpolationMode):
        super().__init__()
        self.resize = T.Resize(hw, interpolation=mode, antialias=True)
        self.hw = hw

    def forward(self, img):
        return img if tuple(img.shape[-2:]) == self.hw else self.resize(img)


class Shift(T.Transform):
    """Random translation by up to `pixels` in each direction, zero-filled (pad, then random crop)."""

    def __init__(self, pixels: int):
        super().__init__()
        self.pixels = pixels

    def forward(self, img):
        h, w = img.shape[-2:]
        return T.RandomCrop((h, w), padding=self.pixels)(img)
