"""DINO's multi-crop views, made a whole batch at a time where the batch is (the GPU in training): 2 global crops and
N local crops of every image, each with DINO's augmentations (facebookresearch/dino main_dino.py DataAugmentationDINO,
dinov2 data/augmentations.py DataAugmentationDINO):

    global 1: RandomResizedCrop(global_size, global_scale, bicubic), flip 0.5, colour jitter (0.4, 0.4, 0.2, 0.1) with
              p 0.8, grayscale 0.2, Gaussian blur p 1.0
    global 2: the same, blur p 0.1, solarisation p 0.2
    local:    RandomResizedCrop(local_size, local_scale, bicubic), flip, jitter, grayscale, blur p 0.5

Every random choice of a view is drawn on the host from one torch.Generator (the data module's, checkpointed: a run
resumed mid-epoch makes the views it would have made) and applied to the batch at once: the crops by one bicubic
`grid_sample` (torchvision's resized crop on the crop's pixels, sampling across the crop's edge where torchvision
repeats it; no antialiasing when a local crop shrinks), the colour operations as torchvision.transforms.v2's kernels
(its ColorJitter's random order of brightness, contrast, saturation and hue, per image), the blur as torchvision's
GaussianBlur(kernel 9, sigma 0.1-2) (DINOv2's; DINO's PIL radius is the same sigma, computed by box filters), the
solarisation as PIL's (values >= 128/255 inverted). Images enter as float in [0, 1] and leave normalised.

This is the path of data held in memory at one size (digits, CIFAR, fake): the data module feeds it the images
un-augmented (the shorter side resized to `source_size` and centre-cropped to a square: data/image_views.py `setup`),
held on the device or from the loaders' workers. Photos of their own sizes (image folders, shards) are cut from each
whole image in the workers instead, as DINO's code cuts them (data/image_views.py), and only normalised here
(`Views.normalised`). `Views` adds iBOT's block masks of the global crops (dinov2 data/masking.py MaskingGenerator and
data/collate.py, drawn from a random.Random seeded from the same generator). No Lightning or Hydra here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv

from vitlab.data.seeded import Rows, rows_of
from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, check_range, from_mapping, is_number

GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights
SOLARIZE = 128 / 255  # PIL's ImageOps.solarize threshold on uint8, as a fraction
CROP_TRIES = 10  # torchvision's RandomResizedCrop.get_params


@dataclass(frozen=True)
class MultiCropConfig:
    """`objective.crops` (conf/objective/dino.yaml): DINO's defaults (main_dino.py's argparse and DataAugmentationDINO);
    DINOv2's scales are (0.32, 1) and (0.05, 0.32). Three-value settings are (global 1, global 2, local)."""

    global_size: int | None = None  # None: model.img_size
    source_size: int | None = None  # on-device path: each image squared at this size first; None: global_size
    local_size: int = 96
    local_crops: int = 8  # DINO's --local_crops_number
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.4)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    color_jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1)  # brightness, contrast, saturation, hue
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: tuple[float, float, float] = (1.0, 0.1, 0.5)
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    blur_kernel: int = 9
    solarize_prob: tuple[float, float, float] = (0.0, 0.2, 0.0)

    def __post_init__(self):
        key = "objective.crops"
        for name in ("global_scale", "local_scale", "ratio", "blur_sigma"):
            low, high = pair = tuple(getattr(self, name))
            if len(pair) != 2 or not all(is_number(v) for v in pair) or not 0 < low <= high:
                raise UserError(f"{key}.{name} {list(pair)} must be [low, high] with 0 < low <= high")
            object.__setattr__(self, name, (float(low), float(high)))
        for name in ("global_scale", "local_scale"):
            check_range(f"{key}.{name}", getattr(self, name)[1], 0, 1, low_open=True)
        for name in ("blur_prob", "solarize_prob"):
            values = tuple(getattr(self, name))
            if len(values) != 3:
                raise UserError(f"{key}.{name} {list(values)} must be three chances: global 1, global 2, local")
            for v in values:
                check_range(f"{key}.{name}", v, 0, 1)
            object.__setattr__(self, name, values)
        for name in ("hflip", "color_jitter_prob", "grayscale_prob"):
            check_range(f"{key}.{name}", getattr(self, name), 0, 1)
        cj = tuple(self.color_jitter)
        if len(cj) != 4 or not all(is_number(v) and v >= 0 for v in cj) or cj[3] > 0.5:
            raise UserError(
                f"{key}.color_jitter {list(cj)} must be [brightness, contrast, saturation, hue], hue <= 0.5"
            )
        object.__setattr__(self, "color_jitter", cj)
        check_at_least(f"{key}.local_crops", self.local_crops, 0)
        check_at_least(f"{key}.local_size", self.local_size, 1)
        for name in ("global_size", "source_size"):
            check_at_least(f"{key}.{name}", getattr(self, name), 1, optional=True)
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise UserError(f"{key}.blur_kernel {self.blur_kernel} must be an odd number of pixels")

    @classmethod
    def from_dict(cls, values) -> MultiCropConfig:
        return from_mapping(cls, values or {}, "objective.crops")


class MultiCrop:
    """The views of a batch: `(images in [0, 1] (B, C, H, W), generator) -> [global 1, global 2, local 1..N]`, each
    (B, C, size, size) and normalised with `mean` and `std`."""

    def __init__(self, cfg: MultiCropConfig, global_size: int, mean: Sequence[float], std: Sequence[float]):
        self.cfg, self.global_size = cfg, int(cfg.global_size or global_size)
        self.source_size = int(cfg.source_size or self.global_size)
        self.mean, self.std = list(mean), list(std)

    def views(self) -> list[tuple[int, tuple[float, float], int]]:
        """(size, scale, which of the three settings) of each view, in order."""
        c = self.cfg
        return [(self.global_size, c.global_scale, 0), (self.global_size, c.global_scale, 1)] + [
            (c.local_size, c.local_scale, 2)
        ] * c.local_crops

    def __call__(self, x: torch.Tensor, generator: torch.Generator | Rows | None = None) -> list[torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return [(self.view(x, size, scale, which, generator) - mean) / std for size, scale, which in self.views()]

    def view(
        self,
        x: torch.Tensor,
        size: int,
        scale: tuple[float, float],
        which: int,
        generator: torch.Generator | Rows | None,
    ) -> torch.Tensor:
        """One view of every image: its draws (host), then the crop, flip, jitter, grayscale, blur, solarisation.
        `generator`: or the Rows of a global batch (data/seeded.py): the view's draws made for all of it, these rows
        kept, so that an image's view is the same whichever process holds it."""
        generator, start, total = rows_of(generator, len(x))
        drawn = self.draw(total, x.shape[-2:], scale, which, generator)
        return self.apply(x, size, which, {k: v[start : start + len(x)] for k, v in drawn.items()})

    def draw(
        self, n: int, hw: Sequence[int], scale: tuple[float, float], which: int, generator: torch.Generator | None
    ) -> dict[str, torch.Tensor]:
        """A view's random choices for n images of `hw`, in their order; `boxes` (n, 4): top, left, height, width."""
        c = self.cfg
        d = {"boxes": resized_crop_boxes(n, hw, scale, c.ratio, generator)}
        d["flip"] = torch.rand(n, generator=generator) < c.hflip
        d["jitter"] = torch.rand(n, generator=generator) < c.color_jitter_prob
        d["factors"], d["order"] = jitter_params(n, c.color_jitter, generator)
        d["gray"] = torch.rand(n, generator=generator) < c.grayscale_prob
        d["blur"] = torch.rand(n, generator=generator) < c.blur_prob[which]
        d["sigma"] = torch.empty(n).uniform_(*c.blur_sigma, generator=generator)
        d["solarize"] = torch.rand(n, generator=generator) < c.solarize_prob[which]
        return d

    def apply(self, x: torch.Tensor, size: int, which: int, d: dict[str, torch.Tensor]) -> torch.Tensor:
        c, dev = self.cfg, x.device
        out = crop_resize(x, d["boxes"].to(dev), d["flip"].to(dev), size)
        if c.color_jitter_prob:
            out = torch.where(_rows(d["jitter"], dev), color_jitter(out, d["factors"].to(dev), d["order"].to(dev)), out)
        if c.grayscale_prob and out.shape[1] == 3:
            out = torch.where(_rows(d["gray"], dev), grayscale(out).expand_as(out), out)
        if c.blur_prob[which]:
            out = torch.where(_rows(d["blur"], dev), gaussian_blur(out, c.blur_kernel, d["sigma"].to(dev)), out)
        if c.solarize_prob[which]:
            out = torch.where(_rows(d["solarize"], dev), torch.where(out >= SOLARIZE, 1.0 - out, out), out)
        return out


def _rows(chosen: torch.Tensor, device: torch.device) -> torch.Tensor:
    return chosen.to(device).view(-1, 1, 1, 1)


def resized_crop_boxes(
    n: int, hw: Sequence[int], scale: tuple[float, float], ratio: tuple[float, float], generator=None
) -> torch.Tensor:
    """(n, 4) int64 boxes (top, left, height, width) as torchvision's RandomResizedCrop.get_params draws them: up to
    10 tries of an area in `scale` x the image's and a log-uniform aspect ratio in `ratio`, the first that fits taken
    at a uniform position; none fits: the centre crop of the image clamped to `ratio`."""
    H, W = int(hw[0]), int(hw[1])
    area = H * W * torch.empty(n, CROP_TRIES).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(n, CROP_TRIES).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = log_ratio.exp()
    w = torch.sqrt(area * aspect).round().long()
    h = torch.sqrt(area / aspect).round().long()
    fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = fits.long().argmax(-1, keepdim=True)
    h, w = h.gather(-1, first).squeeze(-1), w.gather(-1, first).squeeze(-1)
    top = (torch.rand(n, generator=generator) * (H - h + 1)).long()
    left = (torch.rand(n, generator=generator) * (W - w + 1)).long()
    in_ratio = W / H  # torchvision's fallback
    if in_ratio < min(ratio):
        fw, fh = W, int(round(W / min(ratio)))
    elif in_ratio > max(ratio):
        fw, fh = int(round(H * max(ratio))), H
    else:
        fw, fh = W, H
    found = fits.any(-1)
    h, w = torch.where(found, h, fh), torch.where(found, w, fw)
    top, left = torch.where(found, top, (H - fh) // 2), torch.where(found, left, (W - fw) // 2)
    return torch.stack([top, left, h, w], -1)


def crop_resize(x: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor, size: int) -> torch.Tensor:
    """Each image's box (top, left, height, width in pixels) resized to size x size, bicubic, mirrored where `flip`:
    output pixel j samples the crop at (j + 0.5) x crop / size - 0.5, as torchvision's resize of the cropped image."""
    H, W = x.shape[-2:]
    top, left, h, w = boxes.to(x.dtype).unbind(-1)
    sx = torch.where(flip, -w / W, w / W)
    zero = torch.zeros_like(sx)
    theta = torch.stack(
        [torch.stack([sx, zero, (2 * left + w) / W - 1], -1), torch.stack([zero, h / H, (2 * top + h) / H - 1], -1)],
        1,
    )
    grid = F.affine_grid(theta, [len(x), x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bicubic", padding_mode="border", align_corners=False).clamp_(0, 1)


def jitter_params(n: int, strength: Sequence[float], generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's ColorJitter draws per image: (n, 4) factors (brightness, contrast, saturation in
    [1 - s, 1 + s], hue in [-s, s]) and (n, 4) the order the four are applied in (a random permutation)."""
    b, c, s, hue = strength
    low = torch.tensor([max(0.0, 1 - b), max(0.0, 1 - c), max(0.0, 1 - s), -hue])
    high = torch.tensor([1 + b, 1 + c, 1 + s, hue])
    factors = low + (high - low) * torch.rand(n, 4, generator=generator)
    order = torch.rand(n, 4, generator=generator).argsort(-1)
    return factors, order


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, H, W): torchvision's rgb_to_grayscale of 3 channels, the image itself of 1."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (r * GRAY[0] + g * GRAY[1] + b * GRAY[2]).unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    return (x * ratio + other * (1.0 - ratio)).clamp_(0, 1)


def adjust(x: torch.Tensor, op: int, factor: torch.Tensor) -> torch.Tensor:
    """torchvision.transforms.v2.functional's adjust_brightness (0), _contrast (1), _saturation (2), _hue (3) of
    float images in [0, 1], each image by its own factor (B,)."""
    f = factor.view(-1, 1, 1, 1)
    if op == 0:
        return _blend(x, torch.zeros_like(x), f)
    if op == 1:
        return _blend(x, grayscale(x).mean(dim=(-3, -2, -1), keepdim=True), f)
    if x.shape[1] == 1:  # saturation and hue leave one channel as it is (PIL's, torchvision's)
        return x
    if op == 2:
        return _blend(x, grayscale(x), f)
    h, s, v = _rgb_to_hsv(x).unbind(dim=-3)
    h = (h + f.view(-1, 1, 1)).remainder(1.0)
    return _hsv_to_rgb(torch.stack((h, s, v), dim=-3))


def color_jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """torchvision's ColorJitter on each image: the four adjustments in the image's own `order`, by its `factors`
    (jitter_params). Each step computes every adjustment over the batch and keeps the one each image takes there."""
    for step in range(4):
        op_here = order[:, step]
        out = x
        for op in range(4):
            chosen = (op_here == op).view(-1, 1, 1, 1)
            out = torch.where(chosen, adjust(x, op, factors[:, op]), out)
        x = out
    return x


def gaussian_blur(x: torch.Tensor, kernel: int, sigma: torch.Tensor) -> torch.Tensor:
    """torchvision's gaussian_blur (reflect padding, its kernel) with each image's own sigma (B,)."""
    B, C, H, W = x.shape
    lim = (kernel - 1) / (2.0 * math.sqrt(2.0))
    t = torch.linspace(-lim, lim, steps=kernel, dtype=x.dtype, device=x.device)
    k1 = torch.softmax(-(t / sigma.to(x.dtype).view(-1, 1)).pow(2), dim=-1)  # (B, k)
    k2 = (k1[:, :, None] * k1[:, None, :]).repeat_interleave(C, 0).unsqueeze(1)  # (B*C, 1, k, k)
    pad = kernel // 2
    if pad >= min(H, W):
        raise UserError(f"objective.crops.blur_kernel {kernel} is too large for crops of {H}x{W}: make it smaller")
    out = F.pad(x.reshape(1, B * C, H, W), [pad] * 4, mode="reflect")
    return F.conv2d(out, k2, groups=B * C).view(B, C, H, W)


class Views:
    """The data module's multi-crop: `(batch in [0, 1], generator) -> (views, masks)`; masks (2 x B, patches) bool for
    iBOT's masked global crops (dinov2 collate_data_and_cast), drawn by a random.Random seeded from `generator`."""

    def __init__(self, settings: Mapping[str, Any], mean, std):
        cfg = MultiCropConfig.from_dict(settings["crops"])
        self.crop = MultiCrop(cfg, int(cfg.global_size or 0), mean, std)
        self.masks = dict(settings.get("masks") or {})

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None, crops: torch.Generator | Rows | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """`crops`: what the crops and masks draw from instead (the Rows of a global batch: the masks are drawn for
        the global batch, this process's rows kept); else the masks draw from `generator`."""
        views = self.crop(x, crops if crops is not None else generator)
        return views, self._masks(len(x), x.device, crops if isinstance(crops, Rows) else generator)

    def normalised(
        self, views: list[torch.Tensor], generator: torch.Generator | Rows | None
    ) -> tuple[list[torch.Tensor], Any]:
        """Views cut in the loader's workers (data/image_views.py), uint8 (B, C, size, size) each: normalised, with
        iBOT's masks drawn here as on the on-device path (from `generator`, or for the global batch of Rows)."""
        x = views[0]
        mean = torch.tensor(self.crop.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.crop.std, device=x.device).view(1, -1, 1, 1)
        out = [(v.to(torch.float32).div_(255) - mean) / std for v in views]
        return out, self._masks(len(x), x.device, generator)

    def _masks(self, n: int, device: torch.device, generator: torch.Generator | Rows | None) -> torch.Tensor | None:
        """The masks of the 2 x n global crops (crop-major, as dinov2 collates them); for Rows, drawn for the global
        batch's 2 x total crops and this process's rows of each crop kept (the same on any count of processes)."""
        p = self.masks.get("probability", 0.0)
        if not p:
            return None
        generator, start, total = rows_of(generator, n)
        size, patch = self.crop.global_size, self.masks["patch"]
        rng = random.Random(int(torch.randint(2**62, (), generator=generator)))
        masks = collate_masks(2 * total, (size // patch[0], size // patch[1]), p, tuple(self.masks["ratio"]), rng)
        masks = torch.cat([masks[start : start + n], masks[total + start : total + start + n]])
        return masks.to(device)


# ---- iBOT's masks ------------------------------------------------------------------------------------------------
def block_mask(
    hw: tuple[int, int], count: int, rng: random.Random, min_patches: int = 4, max_patches: float | None = None
) -> torch.Tensor:
    """dinov2 data/masking.py MaskingGenerator(input_size=hw, max_num_patches=...)(count): rectangles of 4 to
    `max_patches` patches (aspect 0.3 to 1/0.3) added until `count` patches are masked (or a try adds none), drawn
    from `rng` in the reference's order. (H, W) bool."""
    height, width = hw
    max_patches = count if max_patches is None else max_patches
    log_aspect = (math.log(0.3), math.log(1 / 0.3))
    mask = torch.zeros(height, width, dtype=torch.bool)
    masked = 0
    while masked < count:
        budget = min(count - masked, max_patches)
        delta = 0
        for _ in range(10):
            target = rng.uniform(min_patches, budget)
            aspect = math.exp(rng.uniform(*log_aspect))
            h, w = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if w < width and h < height:
                top, left = rng.randint(0, height - h), rng.randint(0, width - w)
                already = int(mask[top : top + h, left : left + w].sum())
                if 0 < h * w - already <= budget:
                    delta = h * w - already
                    mask[top : top + h, left : left + w] = True
                if delta > 0:
                    break
        if delta == 0:
            break
        masked += delta
    return mask


def collate_masks(
    images: int, hw: tuple[int, int], probability: float, ratio: tuple[float, float], rng: random.Random
) -> torch.Tensor:
    """dinov2 collate_data_and_cast's masks for `images` global crops: int(images x probability) of them masked, the
    i-th with a ratio drawn in the i-th of equal steps of `ratio`, the rest unmasked, shuffled. (images, H x W) bool."""
    n = hw[0] * hw[1]
    masked = int(images * probability)
    steps = torch.linspace(*ratio, masked + 1)
    masks = [
        block_mask(hw, int(n * rng.uniform(steps[i], steps[i + 1])), rng, max_patches=0.5 * n) for i in range(masked)
    ]
    masks += [block_mask(hw, 0, rng, max_patches=0.5 * n) for _ in range(masked, images)]
    rng.shuffle(masks)
    return torch.stack(masks).flatten(1)
