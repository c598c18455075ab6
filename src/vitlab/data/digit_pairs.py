"""`data=digit_pairs`: an embedded multi-label set (objective.multilabel=true), no network. Each image is one of
data=segmentation's canvases (data/canvas.py: scikit-learn's 8x8 digits, a small one and a large one pasted at
random places on a noisy background, each split with its own digits, all fixed by `split_seed`), labelled by the
digits on it: the classes 0-9 whose pixels its mask holds (one label where both digits are the same or the large one
covers the small one, else two).
"""

from __future__ import annotations

import torch

from vitlab.data.canvas import MEAN, SPLITS, STD, make_split
from vitlab.data.image_module import ImageDataModule
from vitlab.data.resident import ArrayImages
from vitlab.data.seeded import TransformDataset
from vitlab.utils.errors import UserError


def digit_labels(masks: torch.Tensor) -> torch.Tensor:
    """(N, S, S) canvas masks (0 background, d + 1 digit d) -> (N, 10) int64 multi-hot rows of the digits shown."""
    shown = torch.zeros(len(masks), 11, dtype=torch.long)
    shown.scatter_(1, masks.flatten(1).long(), 1)
    return shown[:, 1:]


class DigitPairsDataModule(ImageDataModule):
    """Canvases of two digits, each labelled by the digits on it (several labels an image)."""

    num_classes = 10
    class_names = [str(d) for d in range(10)]
    eval_crop_pct = 1.0  # the canvases resized whole
    multilabel = True  # objective.multilabel=true reads it (training.objectives.classification)

    def __init__(self, canvas_size: int = 32, canvases: tuple[int, int, int] = (1024, 256, 256), split_seed: int = 0,
                 channels: int = 3, mean=None, std=None, multilabel: bool = True, **kwargs):  # fmt: skip
        if not multilabel:
            raise UserError("data=digit_pairs has several labels an image: train it with objective.multilabel=true")
        if channels not in MEAN:
            raise UserError(f"data.channels {channels} must be 1 (gray) or 3 (RGB)")
        if len(canvases) != 3 or any(not isinstance(n, int) or n < 1 for n in canvases):
            raise UserError(f"data.canvases {list(canvases)} must be [train, val, test] counts >= 1")
        if canvas_size < 16:
            raise UserError(f"data.canvas_size {canvas_size} must be >= 16 (two digits of half and 3/4 its side)")
        mean, std = mean if mean is not None else MEAN[channels], std if std is not None else STD[channels]
        super().__init__(channels=channels, mean=mean, std=std, **kwargs)
        self.canvas_size, self.canvases, self.split_seed = canvas_size, tuple(canvases), split_seed
        self.native_hw = (canvas_size, canvas_size)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        made = {}
        for split, count in zip(SPLITS, self.canvases, strict=True):
            images, masks = make_split(split, count, self.canvas_size, self.channels, self.split_seed)
            made[split] = ArrayImages(images, digit_labels(masks))
        self.train_set = TransformDataset(made["train"], self.train_tf)
        self.val_set = TransformDataset(made["val"], self.eval_tf)
        self.test_set = TransformDataset(made["test"], self.eval_tf)
        self.class_counts = dict(zip(self.class_names, made["train"].labels.sum(0).tolist(), strict=True))
        self.splits = {split: f"{n:,} canvases of two digits ({split}'s own digits, split_seed {self.split_seed})"
                       for split, n in zip(SPLITS, self.canvases, strict=True)}  # fmt: skip
