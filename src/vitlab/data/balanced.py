"""`data.sampler=class_balanced`: a long tail's training images drawn with replacement, each image with probability
proportional to its class's count to the power -p (`data.sampler_balance`: `inverse`, p = 1, every class equally
likely; `sqrt`, p = 1/2, the square-root sampling of Mahajan et al. 2018 and Kang et al. 2020), the epoch as long as
the uniform sampler's. An image of several labels draws its rarest label's weight.

The draw is torch's WeightedRandomSampler, from a generator seeded by the run's seed and the epoch alone: every
process draws the same epoch, cut into global batches as data/seeded.py's GlobalOrder cuts the uniform order, and
takes its contiguous share of each, so a run resumed mid-epoch, on the same number of processes or another, draws the
same indices (issue 78). Over the
seeded loader path (TransformDataset) each index comes with its augmentation's seed (data/seeded.py), its place in
the epoch mixed in, so an image drawn twice is augmented two ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import WeightedRandomSampler

from vitlab.data.seeded import GlobalOrder
from vitlab.utils.errors import UserError
from vitlab.utils.seeds import mix

SAMPLERS = ("uniform", "class_balanced")
BALANCES = {"inverse": 1.0, "sqrt": 0.5}  # the power of 1 / class count


def check_samplers(sampler: str, balance: str, repeated_aug: int) -> tuple[str, str]:
    """The training sampler's settings (data.sampler, data.sampler_balance, and DeiT's data.repeated_aug), checked."""
    if repeated_aug < 0 or repeated_aug == 1:
        raise UserError(f"data.repeated_aug {repeated_aug} must be 0 (off) or a number of copies >= 2")
    if sampler not in SAMPLERS:
        raise UserError(f"data.sampler {sampler!r} is not one of {list(SAMPLERS)}")
    if balance not in BALANCES:
        raise UserError(f"data.sampler_balance {balance!r} is not one of {list(BALANCES)}")
    if sampler == "class_balanced" and repeated_aug:
        raise UserError(
            f"data.sampler=class_balanced draws images with replacement, and data.repeated_aug {repeated_aug} repeats "
            "each: choose one"
        )
    return sampler, balance


def image_weights(labels: torch.Tensor, power: float) -> torch.Tensor:
    """Each image's weight: its class's count ** -power; (N, C) multi-hot labels: its rarest label's (an image of no
    label: the commonest class's)."""
    if labels.ndim == 1:
        counts = torch.bincount(labels).double()
        return counts[labels].pow(-power)
    counts = labels.sum(0).double().clamp(min=1)
    per_class = counts.pow(-power)  # (C,)
    weights = (labels.double() * per_class).amax(1)
    return torch.where(weights > 0, weights, per_class.min())


class ClassBalancedOrder(GlobalOrder):
    """An epoch of len(dataset) weighted draws in a global order: process `rank` of `num_replicas` takes its
    contiguous share of each global batch; `keyed`: each draw with its augmentation's seed, its place mixed in."""

    def __init__(self, dataset: Any, weights: Sequence[float] | torch.Tensor, num_replicas: int, rank: int, seed: int,
                 batch_size: int, keyed: bool):  # fmt: skip
        super().__init__(dataset, num_replicas, rank, seed, batch_size, keyed)
        self.weights = torch.as_tensor(weights, dtype=torch.double)

    repeats = True  # (with replacement)

    def sequence(self) -> list[int]:
        generator = torch.Generator().manual_seed(mix(self.seed, self.epoch) % 2**63)
        return list(WeightedRandomSampler(self.weights, len(self.dataset), replacement=True, generator=generator))


def balanced_sampler(
    dataset: Any, balance: str, world: int, rank: int, seed: int, batch_size: int
) -> ClassBalancedOrder:
    """The sampler of `dataset` (a TransformDataset over a reader that lists its labels, or images on the device)."""
    from vitlab.data.folds import labels_of
    from vitlab.data.seeded import TransformDataset

    seeded = isinstance(dataset, TransformDataset)
    if seeded:
        labels = torch.as_tensor(labels_of(dataset.base))[torch.as_tensor(dataset.indices, dtype=torch.long)]
    else:
        labels = torch.as_tensor(labels_of(dataset)).cpu()
    return ClassBalancedOrder(dataset, image_weights(labels, BALANCES[balance]), world, rank, seed, batch_size, seeded)


def long_tail(indices: Sequence[int], labels: Sequence[int], ratio: float, seed: int) -> list[int]:
    """`indices` cut to an exponential long tail (Cao et al. 2019's CIFAR-LT): class c of C keeps
    n_max * ratio ** (-c / (C - 1)) of its images (at least one), the first class all, chosen by `seed`."""
    if not ratio >= 1:
        raise UserError(f"data.imbalance {ratio!r} must be >= 1 (the largest class's images per the smallest's)")
    by_class: dict[int, list[int]] = {}
    for i in indices:
        by_class.setdefault(int(labels[i]), []).append(i)
    classes = sorted(by_class)
    n_max = max(len(v) for v in by_class.values())
    generator = torch.Generator().manual_seed(seed)
    kept = []
    for rank, c in enumerate(classes):
        keep = max(1, int(n_max * ratio ** (-rank / max(1, len(classes) - 1))))
        order = torch.randperm(len(by_class[c]), generator=generator)[:keep]
        kept += [by_class[c][i] for i in order.tolist()]
    return sorted(kept)
