"""Class masks (one class index a pixel): reading them as mmseg does, an image's label from its mask, and the
evaluation geometry applied to an image and its mask together. No Hydra, OmegaConf or Lightning here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2 as T

from vitlab.data.crop_modes import ResizeCrop, center_crop_or_pad, resized_hw
from vitlab.utils.errors import UserError

IGNORE = 255  # mmseg's ignore_index: pixels of this label count in no loss and no metric


def read_mask(path: str | Path, reduce_zero_label: bool = False) -> torch.Tensor:
    """A mask file -> uint8 (H, W) class indices: a gray PNG's values, a palette PNG's indices (VOC's), as mmseg's
    LoadAnnotations reads them; with `reduce_zero_label` (ADE20k) 0 becomes 255 (ignored) and k becomes k - 1,
    mmseg's three lines on uint8."""
    try:
        with Image.open(path) as img:
            if img.mode not in ("L", "P"):
                raise UserError(
                    f"mask {str(path)!r} is of mode {img.mode}: a mask holds one class index a pixel (a PNG of mode "
                    "L or P)"
                )
            label = np.array(img, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:
        raise UserError(f"mask file {str(path)!r} cannot be decoded ({type(e).__name__}: {e})") from e
    if reduce_zero_label:  # mmseg's LoadAnnotations, in its order
        label[label == 0] = 255
        label = label - 1
        label[label == 254] = 255
    return torch.from_numpy(label)


def image_label(mask: torch.Tensor, background: int | None) -> int:
    """An image's label from its mask: its most frequent class, ignored pixels aside, and `background` aside where
    others are present (the ties to the lowest class); 0 when every pixel is ignored."""
    counts = torch.bincount(mask.flatten().long(), minlength=IGNORE + 1)[:IGNORE]
    if background is not None and background < len(counts) and counts.sum() > counts[background]:
        counts[background] = 0
    return int(counts.argmax())


class MaskResizeCrop:
    """Evaluation's resize and crop (data/crop_modes.py's ResizeCrop, `settings` as data.eval_transform gives them) of
    an image, and the same geometry for its mask: resized to the same size by the nearest label, cropped alike,
    padded with 255. The image is resized in PIL, so the mask is too, with PIL's nearest neighbour (each output pixel
    takes the source pixel under its centre, as PIL rounds it): torchvision's NEAREST, which tv_tensors.Mask's resize
    uses, takes the one at its top-left corner, and even its NEAREST_EXACT rounds a few rows otherwise than PIL (a
    label a row away from its pixel, measured)."""

    def __init__(self, hw: tuple[int, int], settings: dict, mean: Sequence[float]):
        s = {"crop_mode": "center", "interpolation": "bicubic"} | settings
        self.hw, self.crop_pct, self.crop_mode = hw, s["crop_pct"], s["crop_mode"]
        self.image = ResizeCrop(hw, s["crop_pct"], s["crop_mode"], s["interpolation"], mean)

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hw = tuple(image.shape[-2:])
        size = resized_hw(hw, self.hw, self.crop_pct, self.crop_mode)
        m = mask[None]  # (1, H, W)
        if size != hw:
            pil = T.functional.to_pil_image(m).resize(size[::-1], Image.Resampling.NEAREST)
            m = T.functional.pil_to_tensor(pil)
        if self.crop_mode == "border":
            m = center_crop_or_pad(m, self.hw, [IGNORE])
        elif tuple(m.shape[-2:]) != self.hw:
            m = T.functional.center_crop(m, list(self.hw))
        return self.image(image), m[0].as_subclass(torch.Tensor)
