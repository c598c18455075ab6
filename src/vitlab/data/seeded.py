"""The loader path's seeded per-image augmentation: `TransformDataset` (an image's random transforms drawn from
generators seeded with one number), the samplers that hand each index out with its number (`SeededSampler`,
`RepeatSeededSampler`: DeiT's repeated augmentation) and what loader workers run at their start."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from vitlab.utils.signals import ignore_stop_signals


class TransformDataset(Dataset):
    """(image, label) pairs of `base`, restricted to `indices`, with `transform` applied to the image.

    In training it is handed (seed, index) pairs (`SeededSampler`): the image's random transforms then draw from
    torch's, Python's and numpy's generators seeded with that number alone. An image is augmented the same way whichever
    worker prepares it, however many workers there are and whatever they prepared before, so a resumed run, whose
    workers start anew and whose loader drops what they had prefetched, augments exactly as the uninterrupted one."""

    def __init__(self, base: Any, transform, indices: Sequence[int] | None = None):
        self.base, self.transform = base, transform
        self.indices = list(range(len(base))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | tuple[int, int]):
        return self.get(key, self.transform)

    def get(self, key: int | tuple[int, int], transform):
        """Item `key` through `transform` (data/sizes.py: the transform of its batch's size)."""
        if isinstance(key, int):
            img, label = self.base[self.indices[key]]
            return transform(img), label
        seed, i = key
        img, label = self.base[self.indices[i]]
        return seeded(seed, transform, img), label


def seeded(seed: int, transform, img):
    """`transform(img)` with torch's, Python's and numpy's generators seeded with `seed` alone (data/streamed.py
    augments each streamed image so too)."""
    # Without loader workers this runs in the training process, whose own draws (dropout, MixUp) go on after it.
    saved = None
    if get_worker_info() is None:
        saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
    torch.default_generator.manual_seed(seed)  # (torch.manual_seed would also seed every GPU: 70 us an image)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # timm's RandAugment and AugMix draw from numpy too
    try:
        return transform(img)
    finally:
        if saved is not None:
            torch.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])


class SeededSampler(DistributedSampler):
    """A DistributedSampler (one permutation per epoch from the seed and the epoch, this process's share of it)
    that hands each index out with the seed of its augmentation this epoch: (seed, index) pairs for
    TransformDataset. The seed depends on the run's seed, the epoch and the image only."""

    def __iter__(self):
        for i in super().__iter__():
            yield mix(self.seed, self.epoch, i), i


class RepeatSampler(RepeatAugSampler, DistributedSampler):
    """timm's RepeatAugSampler, DeiT's repeated augmentation (each image `num_repeats` times an epoch, its copies
    dealt to different processes), in timm's order (a permutation seeded by the epoch), so it covers the data as
    timm's does. It is also a DistributedSampler (its methods are all RepeatAugSampler's), so that Lightning uses it
    as it is under DDP instead of sharding its output again. Plain indices: for data on the device
    (data/resident.py), whose copies are augmented there, a batch at a time."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, num_repeats: int):
        RepeatAugSampler.__init__(
            self, dataset, num_replicas=num_replicas, rank=rank, shuffle=True, num_repeats=num_repeats
        )
        self.seed, self.drop_last = seed, False


class RepeatSeededSampler(RepeatSampler):
    """RepeatSampler handing out (seed, index) pairs as SeededSampler does. A copy's seed depends on the run's seed,
    the epoch, the image and the copy's place in the epoch, so no two copies are augmented alike."""

    def __iter__(self):
        for k, i in enumerate(super().__iter__()):
            yield mix(self.seed, self.epoch, i, self.rank + k * self.num_replicas), i


def mix(*numbers: int) -> int:
    """A 63-bit seed from `numbers` (splitmix64 steps): neighbouring inputs give unrelated seeds."""
    h = 0
    for n in numbers:
        h = (h ^ n) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ h >> 30) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ h >> 27) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1


def init_worker(worker_id: int) -> None:
    ignore_stop_signals()  # Ctrl-C or a scheduler's SIGTERM to the process group: the main process decides
