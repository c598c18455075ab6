"""task=linear with linear.augment=true: the linear heads train, as DINOv2's eval/linear.py trains them, on features
recomputed at every step from augmented training images (data/transforms.py make_classification_train_transform:
RandomResizedCrop(224, scale (0.08, 1), bicubic) then a horizontal flip with probability 0.5; here at the model's
image size), through the frozen model with no gradient. Validation and test features stay the cached ones (DINOv2
evaluates on its eval transform).

Each process takes its own batch of every step from its share of the shuffled infinite stream (linear.sharded_stream,
DINOv2's ShardedInfiniteSampler) and extracts its features; rank 0 gathers them (torch.distributed) and takes the
step on all of them together, which is DDP's step on the averaged gradients. An image's crop and flip are drawn from
a seed of (linear.seed, step, rank, position) alone, so a run is repeatable whatever the loader's workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from vitlab.data import transforms
from vitlab.data.seeded import TransformDataset
from vitlab.evaluation.features import Layers, _gather_to_rank0, _world
from vitlab.evaluation.linear import Schedule, sharded_stream
from vitlab.utils.errors import UserError

# DINOv2's make_classification_train_transform (torchvision's RandomResizedCrop default scale), at our image size.
DINOV2_TRAIN_TRANSFORM = {"random_resized_crop": (0.08, 1.0), "hflip": 0.5, "interpolation": "bicubic"}


class _Keys:
    """An endless batch sampler: for each step, this process's `batch_size` (augmentation seed, image index) keys."""

    def __init__(self, n: int, s: Schedule, rank: int):
        self.n, self.s, self.rank = n, s, rank

    def __iter__(self):
        s, stream = self.s, sharded_stream(self.n, self.s.seed, self.rank, self.s.world, self.s.batch_size)
        for step in range(s.iterations):
            first = ((s.seed * s.iterations + step) * s.world + self.rank) * s.batch_size
            yield [((first + j) % 2**63, int(i)) for j, i in enumerate(next(stream))]

    def __len__(self) -> int:
        return self.s.iterations


def augmented_view(datamodule) -> TransformDataset:
    """The training images (as the frozen-feature tasks see the split) under DINOv2's training transform."""
    view = datamodule.eval_view("train")
    if not isinstance(view, TransformDataset):
        raise UserError(
            f"linear.augment=true crops and flips the training images one by one, and {type(datamodule).__name__}'s "
            "are not held as single images (streamed shards?); use linear.augment=false"
        )
    tf = transforms.train_transform(datamodule.img_size, datamodule.mean, **DINOV2_TRAIN_TRANSFORM)
    return TransformDataset(view.base, tf, view.indices)


@torch.no_grad()
def augmented_batches(model, datamodule, layers: Layers, device: torch.device, s: Schedule) -> Iterator[tuple]:
    """For each of the `s.iterations` steps: in rank 0, the (features, labels) of every process's augmented batch
    (world x batch_size rows, on `device`); (None, None) in the others. Every process must draw as many."""
    rank, world = _world()
    if world != s.world:
        raise RuntimeError(f"the schedule is for {s.world} processes and {world} run")
    dataset = augmented_view(datamodule)
    workers = datamodule.num_workers if datamodule.num_workers is not None else 0
    loader = DataLoader(dataset, batch_sampler=_Keys(len(dataset), s, rank), num_workers=workers)
    model.eval().to(device)
    for batch in loader:
        x, y = datamodule.device_transform(datamodule.transfer_batch_to_device(batch, device, 0), train=False)
        f = layers.extract(model, x).float()
        parts = _gather_to_rank0(f, y.to(device).long(), s.batch_size, world)
        if rank > 0:
            yield None, None
            continue
        feats = torch.from_numpy(np.concatenate([p[0] for p in parts])).to(device)
        yield feats, torch.from_numpy(np.concatenate([p[1] for p in parts])).to(device)
