"""objective=dino's views cut from each whole decoded image, in the loader's workers, as DINO and DINOv2 cut them
(facebookresearch/dino main_dino.py DataAugmentationDINO, dinov2 data/augmentations.py): each view a
RandomResizedCrop of the image itself (torchvision's, its boxes drawn by `RandomResizedCrop.get_params`, bicubic and
antialiased, so a large crop shrunk to 96 px is filtered as PIL's resize filters it), then the flip, the colour
jitter, grayscale, blur and solarisation, in DINO's order and drawing as its transforms draw: torch's generator for the
crop, flip, jitter and grayscale (torchvision's own transforms), Python's `random` for the blur and the solarisation
(DINO's utils.GaussianBlur and utils.Solarization). Views leave the workers as uint8 and are normalised on the device
(`multicrop.Views.normalised`), where iBOT's masks are drawn.

Data held on the device, or in memory at one small size (digits, CIFAR, fake), keeps the batched path of
data/multicrop.py: each image resized and centre-cropped to a square (`objective.crops.source_size`), the views cut
from that square on the device. `setup` picks the path for a data module and says which in one log line.
No Lightning or Hydra here.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import RandomResizedCrop as _RRC  # its get_params: the boxes v2's crop draws too
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from vitlab.data import transforms
from vitlab.data.multicrop import MultiCropConfig, Views
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


class Blur:
    """DINO's utils.GaussianBlur drawn as it draws (`random.random() <= p`, then the sigma `random.uniform`), applied
    as DINOv2's torchvision GaussianBlur(kernel 9): the blur the on-device path applies (data/multicrop.py)."""

    def __init__(self, p: float, sigma: tuple[float, float], kernel: int):
        self.p, self.sigma, self.kernel = p, sigma, kernel

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if not random.random() <= self.p:
            return img
        s = random.uniform(*self.sigma)
        return TF.gaussian_blur(img, [self.kernel, self.kernel], [s, s])


class Solarize:
    """DINO's utils.Solarization: `random.random() < p`, then PIL's ImageOps.solarize (values >= 128 inverted)."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return TF.solarize(img, 128) if random.random() < self.p else img


class ImageViews:
    """One image's views: `(uint8 (C, H, W) image) -> [global 1, global 2, local 1..N]` uint8 views, each cut from the
    whole image; `cut` also gives each view's box (x0, y0, x1, y1 in the image's pixels) and whether it was flipped."""

    def __init__(self, cfg: MultiCropConfig, global_size: int):
        self.cfg, self.global_size = cfg, int(cfg.global_size or global_size)
        c = cfg
        jitter = T.RandomApply([T.ColorJitter(*c.color_jitter)], p=c.color_jitter_prob)
        self.colour = T.Compose([jitter, T.RandomGrayscale(c.grayscale_prob)])
        # an op whose chance is 0 is left out, drawing nothing, as DINO's pipelines leave out solarisation but in
        # global 2: its draws stay DINO's
        self.after = [
            ([Blur(c.blur_prob[which], c.blur_sigma, c.blur_kernel)] if c.blur_prob[which] else [])
            + ([Solarize(c.solarize_prob[which])] if c.solarize_prob[which] else [])
            for which in range(3)
        ]

    def views(self) -> list[tuple[int, tuple[float, float], int]]:
        """(size, scale, which of the three settings) of each view, in order (multicrop.MultiCrop.views)."""
        c = self.cfg
        globals_ = [(self.global_size, c.global_scale, 0), (self.global_size, c.global_scale, 1)]
        return globals_ + [(c.local_size, c.local_scale, 2)] * c.local_crops

    def __call__(self, img: torch.Tensor) -> list[torch.Tensor]:
        return [view for view, _ in self.cut(img)]

    def cut(self, img: torch.Tensor) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        out = []
        for size, scale, which in self.views():
            top, left, h, w = _RRC.get_params(img, list(scale), list(self.cfg.ratio))
            view = TF.resized_crop(img, top, left, h, w, [size, size], InterpolationMode.BICUBIC, antialias=True)
            flipped = bool(torch.rand(1) < self.cfg.hflip)  # torchvision's RandomHorizontalFlip's draw
            view = TF.horizontal_flip(view) if flipped else view
            view = self.colour(view)
            for op in self.after[which]:
                view = op(view)
            out.append((view, {"box": [left, top, left + w, top + h], "size": [size, size], "flip": flipped}))
        return out


def whole_image_views(dm: Any) -> bool:
    """Whether `dm` (an ImageDataModule) cuts objective=dino's views from each whole image in its workers: photos of
    their own sizes, read from files (an image folder) or streamed (shards); not data held in memory at one size."""
    return bool(dm.decodes_files or not dm.can_reside)


def setup(dm: Any, settings: Mapping[str, Any]) -> tuple[Views, Any]:
    """objective=dino's views for the data module `dm`: the device-side `Views` (normalisation, iBOT's masks, and the
    crops themselves on the on-device path) and the training images' per-image transform; one log line says which."""
    views = Views(settings, dm.mean, dm.std)
    name = type(dm).__name__
    if whole_image_views(dm):
        if views.crop.cfg.source_size is not None:
            raise UserError(
                f"objective.crops.source_size {views.crop.cfg.source_size} squares images whose views are cut on the "
                f"device (digits, CIFAR, fake); {name} cuts them from each whole image: drop it"
            )
        if dm.on_device is True:
            raise UserError(
                f"data.on_device=true, but objective=dino cuts the views of {name}'s images from each whole image "
                "in the loader's workers; set data.on_device=auto or false"
            )
        log.info(
            "objective=dino's views: cut from each whole decoded image in the loader's workers (RandomResizedCrop "
            "of the image, bicubic, antialiased: DINO's DataAugmentationDINO), normalised on the device"
        )
        return views, ImageViews(views.crop.cfg, views.crop.global_size)
    s = views.crop.source_size
    log.info(
        "objective=dino's views: cut on the device from each image resized and centre-cropped to a %dx%d square "
        "(objective.crops.source_size), a batch at a time (%s holds its images at one size)",
        s,
        s,
        name,
    )
    return views, transforms.eval_transform(s, dm.mean, crop_pct=1.0)


def square_box(hw: tuple[int, int], source_size: int, box: list[float]) -> list[float]:
    """A box (x0, y0, x1, y1) in the on-device path's square of `source_size` as a box in the pixels of the image
    (height, width `hw`) it was resized and centre-cropped from (the shorter side to the square's, then its centre)."""
    short = min(hw)
    scale = short / source_size
    x_off, y_off = (hw[1] - short) / 2, (hw[0] - short) / 2
    x0, y0, x1, y1 = box
    return [x_off + x0 * scale, y_off + y0 * scale, x_off + x1 * scale, y_off + y1 * scale]
