"""The training order and the random draws of its augmentation, kept apart from the processes that carry them:
`GlobalOrder` (each epoch's global batches, each process its contiguous share; `RepeatOrder`: DeiT's repeated
augmentation), `TransformDataset` (an image's random transforms drawn from generators seeded with one number), the
samplers that hand each index out with its number (`GlobalOrder(keyed=True)`), `Rows` (what a
batch draws on the device: its global batch's draws, this process's rows of them) and what loader workers run at
their start."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from vitlab.utils.seeds import mix
from vitlab.utils.signals import ignore_stop_signals


class TransformDataset(Dataset):
    """(image, label) pairs of `base`, restricted to `indices`, with `transform` applied to the image.

    In training it is handed (seed, index) pairs (`GlobalOrder(keyed=True)`): the image's random transforms then draw
    from torch's, Python's and numpy's generators seeded with that number alone. An image is augmented the same way
    whichever worker prepares it, however many workers there are and whatever they prepared before, so a resumed run,
    whose workers start anew and whose loader drops what they had prefetched, augments exactly as the uninterrupted
    one."""

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
    with reseeding() as reseed:
        reseed(seed)
        return transform(img)


@contextmanager
def reseeding() -> Iterator[Callable[[int], None]]:
    """Within it, `reseed(seed)` seeds torch's (CPU), Python's and numpy's generators with `seed` alone, as often as
    the caller draws anew (8 us); in the training process they are put back once at the end (45 us): its own draws
    (dropout, MixUp) go on after it."""
    saved = None
    if get_worker_info() is None:
        saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
    try:
        yield _reseed
    finally:
        if saved is not None:
            torch.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])


def _reseed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # (torch.manual_seed would also seed every GPU: 70 us an image)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # timm's RandAugment and AugMix draw from numpy too


class GlobalOrder(DistributedSampler):
    """The training order of a run, whatever number of processes carries it: each epoch a permutation of the whole
    set from (seed, epoch) (DistributedSampler's, so one process sees the order it always saw); the epoch's global
    batches are its consecutive slices of `batch_size x num_replicas` (a last partial one dropped), and each process
    takes its contiguous share of each, rows [rank x batch_size, (rank + 1) x batch_size). A global batch is then the
    same images in the same rows on 1, 2 or 4 processes, and a run resumes on another count at its global position
    (`start`: (epoch, the global batches of it already trained)). `keyed`: each index handed out with the seed of its
    augmentation this epoch, (seed, index) pairs for TransformDataset, from the run's seed, the epoch and the image
    alone."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, batch_size: int, keyed: bool = False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.batch_size, self.keyed = batch_size, keyed
        self.start: tuple[int, int] | None = None

    @property
    def batches(self) -> int:
        """Global batches an epoch."""
        return len(self.dataset) // (self.batch_size * self.num_replicas)

    def __len__(self) -> int:
        return self.batches * self.batch_size

    def sequence(self) -> list[int]:
        """The epoch's order, the global batches its consecutive slices."""
        return torch.randperm(
            len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()

    repeats = False  # whether the sequence may hold an image more than once: then each copy's seed mixes its place in

    def key(self, place: int, i: int) -> int:
        """The seed of image `i`'s augmentation at `place` in the epoch's sequence."""
        return mix(self.seed, self.epoch, i, place) if self.repeats else mix(self.seed, self.epoch, i)

    def __iter__(self):
        order = self.sequence()
        b, whole = self.batch_size, self.batch_size * self.num_replicas
        skip = self.start[1] if self.start is not None and self.start[0] == self.epoch else 0
        for k in range(skip, self.batches):
            first = k * whole + self.rank * b
            for place in range(first, first + b):
                yield (self.key(place, order[place]), order[place]) if self.keyed else order[place]


class Rows(NamedTuple):
    """A training batch's random draws made for its whole global batch, in every process alike: `generator` seeded
    from (seed, epoch, batch) (`batch_rows`), each draw made for `total` images and this process's rows kept,
    [start, start + its batch). Draws made so depend on the image's place in the global batch, never on the process
    that holds it."""

    generator: torch.Generator
    start: int
    total: int


def batch_rows(seed: int, epoch: int, batch: int, rank: int, rows: int, processes: int, stream: int = 0) -> Rows:
    """The Rows of global batch `batch` of `epoch` for the process `rank` of `processes`, each with `rows` images;
    `stream` tells apart the draws of different parts of a step (augmentation 0, the model's 1)."""
    return Rows(torch.Generator().manual_seed(mix(seed, epoch, batch, stream)), rank * rows, rows * processes)


def rows_of(generator: torch.Generator | Rows | None, n: int) -> tuple[torch.Generator | None, int, int]:
    """(generator, start, total) for a draw of `n` images: a plain generator draws for its `n` alone."""
    return tuple(generator) if isinstance(generator, Rows) else (generator, 0, n)


class RepeatOrder(GlobalOrder):
    """DeiT's repeated augmentation (data.repeated_aug) in a global order: each epoch the sequence timm's
    RepeatAugSampler deals out on one process (a permutation seeded by the epoch, each image `num_repeats` times in a
    row, as many as timm selects), cut into global batches, each process its contiguous share. Each global batch holds
    the images timm's would on any count (under DDP timm strides the sequence over the processes: the same global
    batches, dealt otherwise), and a run resumes on another count at its global position. `keyed`: a copy's seed from
    the run's seed, the epoch, the image and the copy's place in the sequence, so no two copies are augmented alike
    (plain indices: data held on the device, whose copies are augmented there by their rows)."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, batch_size: int, num_repeats: int,
                 keyed: bool = False):  # fmt: skip
        super().__init__(dataset, num_replicas, rank, seed, batch_size, keyed)
        self.timms = RepeatAugSampler(dataset, num_replicas=1, rank=0, shuffle=True, num_repeats=num_repeats)

    repeats = True

    @property
    def batches(self) -> int:
        return len(self.timms) // (self.batch_size * self.num_replicas)

    def sequence(self) -> list[int]:
        self.timms.set_epoch(self.epoch)
        return list(self.timms)


def init_worker(worker_id: int) -> None:
    ignore_stop_signals()  # Ctrl-C or a scheduler's SIGTERM to the process group: the main process decides
