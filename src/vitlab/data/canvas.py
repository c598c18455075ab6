"""`data=segmentation`'s embedded default: scikit-learn's 8x8 digits (bundled, no network) pasted on small canvases,
each digit's pixels labelled with its class (digit + 1) and the rest background (class 0), so the segmentation
probe (vitlab.eval task=segmentation) runs offline and in tests.

Each canvas (`size` x `size`, 32 by default) has a dark background of its own colour with a little noise, a small
digit (half the canvas wide) and a large one (three quarters) pasted over it, each at a random place in a bright
colour of its own (gray with `channels=1`). A digit's pixels are those whose ink is at least half its full value,
after the bilinear upscaling. The digits of each split are their own (70/15/15 of the 1,797, by `split_seed`), and
everything is drawn from generators seeded with `split_seed` alone: the same canvases in every process and run.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

CLASS_NAMES = ["background", *(str(d) for d in range(10))]  # mask label = index: background 0, digit d is d + 1
SPLITS = ("train", "val", "test")
DIGIT_SHARES = (0.70, 0.15, 0.15)  # of the 1,797 digits, per split

# The canvases' mean and std per channel, of their [0, 1] values (measured over the default training canvases): the
# normalisation of data=segmentation without a data_dir.
MEAN = {1: (0.3127,), 3: (0.3118, 0.3129, 0.3092)}
STD = {1: (0.2287,), 3: (0.2262, 0.2265, 0.2298)}


def _upscaled(images: torch.Tensor, px: int) -> np.ndarray:
    """(N, 8, 8) ink 0..16 -> (N, px, px) ink in [0, 1], bilinear."""
    x = F.interpolate(images[:, None].float() / 16.0, size=(px, px), mode="bilinear", align_corners=False)
    return x[:, 0].clamp_(0, 1).numpy()


def _paste(img: np.ndarray, mask: np.ndarray, ink: np.ndarray, label: int, colour: np.ndarray, rng) -> None:
    """Blend one digit's `ink` (px, px) in `colour` into `img` (C, S, S) at a random place; its pixels of half ink or
    more become `label` in `mask` (S, S)."""
    px, size = ink.shape[0], img.shape[-1]
    top, left = (int(v) for v in rng.integers(0, size - px + 1, 2))
    window = (slice(None), slice(top, top + px), slice(left, left + px))
    img[window] = img[window] * (1 - ink) + colour[:, None, None] * ink
    mask[top : top + px, left : left + px][ink >= 0.5] = label


def make_split(split: str, count: int, size: int, channels: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` canvases of `split` (its own digits): uint8 images (N, channels, size, size) and uint8 masks
    (N, size, size), class 0 background and d + 1 for digit d."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    cuts = np.cumsum([round(s * len(order)) for s in DIGIT_SHARES])[:-1]
    pool = np.split(order, cuts)[SPLITS.index(split)]
    images = torch.from_numpy(digits.images[pool])
    small, large = _upscaled(images, size // 2), _upscaled(images, size * 3 // 4)
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    out = np.empty((count, channels, size, size), np.float64)
    masks = np.zeros((count, size, size), np.uint8)
    for i in range(count):
        background = rng.uniform(0, 0.35, channels)
        out[i] = background[:, None, None] + rng.normal(0, 0.03, (channels, size, size))
        for inks in (small, large):
            j = int(rng.integers(len(pool)))
            _paste(out[i], masks[i], inks[j], int(digits.target[pool[j]]) + 1, rng.uniform(0.6, 1.0, channels), rng)
    pixels = np.clip(np.rint(out * 255), 0, 255).astype(np.uint8)
    return torch.from_numpy(pixels), torch.from_numpy(masks)
