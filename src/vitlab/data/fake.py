"""Synthetic images and labels for benchmarks and tests: random uint8 images of the model's size,
each one a pure function of (seed, index), so epochs and processes agree without storing them."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from vitlab.data.image_module import ImageDataModule
from vitlab.data.seeded import TransformDataset
from vitlab.utils.errors import UserError


class RandomImages(Dataset):
    """`n` random uint8 images of `hw` with random labels, each drawn from `seed` and its index: the same every read."""

    def __init__(self, n: int, channels: int, hw: tuple[int, int], num_classes: int, seed: int):
        self.n, self.shape, self.num_classes, self.seed = n, (channels, *hw), num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        img = torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g)
        return img, int(torch.randint(0, self.num_classes, (), generator=g))


class FakeDataModule(ImageDataModule):
    """`data=fake`: random images and labels of any size, class count and number, for benchmarks and tests."""

    eval_crop_pct = 1.0

    def __init__(
        self,
        num_classes: int = 10,
        channels: int = 3,
        num_train: int = 1024,
        num_val: int = 256,
        num_test: int = 256,
        seed: int = 0,
        **kwargs,
    ):
        if num_classes < 1 or channels < 1:
            raise UserError(f"data.num_classes {num_classes} and data.channels {channels} must be >= 1")
        kwargs["mean"] = kwargs.get("mean") or (0.5,) * channels
        kwargs["std"] = kwargs.get("std") or (0.5,) * channels
        super().__init__(num_classes=num_classes, channels=channels, **kwargs)
        self.class_names = [f"class_{i}" for i in range(num_classes)]
        self.sizes, self.seed = (num_train, num_val, num_test), seed
        self.native_hw = self.img_hw

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        sets = [
            RandomImages(n, self.channels, self.img_hw, self.num_classes, self.seed + k)
            for k, n in enumerate(self.sizes)
        ]
        self.train_set = TransformDataset(sets[0], self.train_tf)
        self.val_set = TransformDataset(sets[1], self.eval_tf)
        self.test_set = TransformDataset(sets[2], self.eval_tf)
