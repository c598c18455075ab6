"""DINOv2's linear evaluation (dinov2/eval/linear.py), on frozen features: one linear classifier for every (feature
configuration, learning rate) pair, all trained at once on the same batches, the best chosen on the validation split
and only it scored on the test split.

The schedule is DINOv2's, number by number: a fixed number of iterations (epochs 10 x epoch_length 1,250 = 12,500),
not epochs over the data; batches of 128 per process drawn from its ShardedInfiniteSampler (a shuffled stream that
runs over the training images again and again, each process its own share); SGD momentum 0.9, weight decay 0; each
learning rate of the grid x (128 x processes) / 256; cosine annealing to 0 over the iterations
(CosineAnnealingLR(max_iter, eta_min=0), stepped after every iteration); each head Linear(D, classes) with weight
N(0, 0.01) and bias 0; the loss the sum of the heads' cross-entropies. DDP averages the heads' gradients over the
processes, which is one step on the processes' batches together: so a single process given every process's batch
(cached features) takes the very steps DINOv2's processes take.

The heads of a configuration are one tensor (L, C, D): a step is one matmul per configuration and a hand-written SGD
step, equal to torch.optim.SGD's (dampening 0, no Nesterov) with a learning rate per head. Plain torch, no Lightning.

Several labels an image (multi-hot (N, C) labels, objective.multilabel data), which DINOv2 does not evaluate: each
head's loss is a sigmoid binary cross-entropy a class, summed over the classes (a logit's gradient sigmoid - target,
on cross-entropy's scale, so the same learning-rate grid serves), and the head is chosen on the validation split's
mAP and scored on the test split by mAP over the classes and over every (image, class) pair (torchmetrics, as the
classifier's val/map and test/map).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.utils.errors import UserError

LINEAR_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)  # DINOv2's learning_rates
ITERATIONS = 10 * 1250  # DINOv2's epochs x epoch_length
BATCH_SIZE = 128  # DINOv2's batch_size, per process


@dataclass(frozen=True)
class Schedule:
    """How the heads train: `batch_size` per process, `world` processes (their batches make one step)."""

    iterations: int = ITERATIONS
    batch_size: int = BATCH_SIZE
    world: int = 1
    lrs: tuple[float, ...] = LINEAR_LRS
    momentum: float = 0.9
    seed: int = 0  # the sampler's (DINOv2: 0) and the heads' initialisation

    def __post_init__(self):
        for name in ("iterations", "batch_size", "world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"linear.{name} {value!r} must be an integer >= 1")
        if not self.lrs or any(not lr > 0 for lr in self.lrs):
            raise UserError(f"linear.lrs {list(self.lrs)} must be a non-empty list of learning rates > 0")

    @property
    def lr_scale(self) -> float:
        """DINOv2's scale_lr: x batch_size x world / 256."""
        return self.batch_size * self.world / 256.0

    def lr_at(self, step: int) -> float:
        """CosineAnnealingLR(max_iter, eta_min=0)'s factor at `step` (0 before the first step)."""
        return 0.5 * (1.0 + math.cos(math.pi * step / self.iterations))

    def describe(self, features: int, augment: bool) -> str:
        """What metrics.json says of the protocol."""
        data = (
            "features recomputed each step on RandomResizedCrop + flip of the training images"
            if augment
            else "cached features of the training images (no augmentation)"
        )
        return (
            f"dinov2 eval/linear.py: {self.iterations} iterations, batch {self.batch_size} x {self.world} processes "
            f"from a shuffled infinite sampler, SGD momentum {self.momentum} wd 0, lr x {self.lr_scale:g} "
            f"({self.batch_size} x {self.world} / 256), cosine to 0, {len(self.lrs)} lrs x {features} feature "
            f"configurations; {data}"
        )


def sharded_stream(n: int, seed: int, rank: int, world: int, chunk: int) -> Iterator[np.ndarray]:
    """The indices process `rank` of `world` reads, `chunk` at a time: DINOv2's ShardedInfiniteSampler
    (data/samplers.py, shuffle=True) with its randperm slice shuffle (SHARDED_INFINITE_NEW): one permutation of the
    n images, this process's every world-th of it, reshuffled on every pass with a seed of the pass alone."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, dtype=torch.int32 if n <= 2**31 else torch.int64, generator=g)
    count = n // world  # the last n % world of the permutation are dropped, as DINOv2 drops them
    share, pending, passes = perm[rank::world], np.empty(0, np.int64), 0
    while True:
        while len(pending) < chunk:
            g.manual_seed(seed + rank + (passes << 24))  # DINOv2's _make_seed
            pending = np.concatenate([pending, share[torch.randperm(count, generator=g)].numpy().astype(np.int64)])
            passes += 1
        yield pending[:chunk]
        pending = pending[chunk:]


def cached_batches(train: torch.Tensor, labels: torch.Tensor, s: Schedule) -> Iterator[tuple]:
    """Every process's batch of each step, together (world x batch_size rows), from features held in memory."""
    streams = [sharded_stream(len(train), s.seed, r, s.world, s.batch_size) for r in range(s.world)]
    while True:
        idx = torch.from_numpy(np.concatenate([next(st) for st in streams]))
        yield train[idx], labels[idx]


class Heads(torch.nn.Module):
    """A Linear(D_v, C) per (configuration v, learning rate): per configuration, weights (L, C, D_v) and biases (L, C).
    `views` maps each configuration's name to its columns of the features; heads are ordered configuration first,
    learning rate second (DINOv2's classifiers_dict order: n_last_blocks, avgpool, lr)."""

    def __init__(self, views: dict[str, slice], dim: int, num_classes: int, lrs: int, generator: torch.Generator):
        super().__init__()
        self.views = dict(views)
        self.weights, self.biases = torch.nn.ParameterList(), torch.nn.ParameterList()
        for cols in self.views.values():
            width = len(range(dim)[cols])
            w = torch.empty(lrs, num_classes, width).normal_(0.0, 0.01, generator=generator)  # LinearClassifier's
            self.weights.append(w)
            self.biases.append(torch.zeros(lrs, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D) features -> (B, heads, C) logits."""
        parts = zip(self.views.values(), self.weights, self.biases, strict=True)
        return torch.cat([torch.einsum("bd,lcd->blc", x[:, cols], w) + b for cols, w, b in parts], dim=1)


def train_heads(heads: Heads, batches: Iterator[tuple], s: Schedule, on_step: Callable | None = None) -> Heads:
    """`s.iterations` steps of DINOv2's loop: the summed cross-entropy of every head on the step's batch (multi-hot
    labels: binary cross-entropy a class, summed), SGD with momentum and each head's learning rate, cosine-annealed."""
    params = [*heads.weights, *heads.biases]
    base = torch.tensor(s.lrs, dtype=torch.float32) * s.lr_scale  # (L,)
    momenta: list[torch.Tensor | None] = [None] * len(params)
    for step in range(s.iterations):
        x, y = next(batches)
        logits = heads(x.float())  # (B, H, C)
        b, h, c = logits.shape
        if y.ndim == 2:  # several labels an image
            loss = F.binary_cross_entropy_with_logits(logits, y[:, None].float().expand_as(logits), reduction="sum") / b
        else:
            loss = F.cross_entropy(logits.reshape(b * h, c), y.repeat_interleave(h), reduction="sum") / b
        grads = torch.autograd.grad(loss, params)
        lr = base * s.lr_at(step)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                # torch.optim.SGD: the first step's buffer is the gradient itself, then m * buffer + gradient
                momenta[i] = g.clone() if momenta[i] is None else momenta[i].mul_(s.momentum).add_(g)
                p.sub_(lr.view(-1, *[1] * (p.ndim - 1)) * momenta[i])
        if on_step is not None:
            on_step(step)
    return heads


@torch.no_grad()
def choose(heads: Heads, lrs: tuple, val, val_labels, test, test_labels) -> dict:
    """The head best on validation (the first of equals in the heads' order, as DINOv2's strict >), and its test
    accuracy: the test split never takes part in the choice. Multi-hot labels: chosen on validation mAP, its test mAP
    (`val_map`, `test_map`, `test_map_micro`) in place of the accuracies."""
    if val_labels.ndim == 2:
        return _choose_on_map(heads, lrs, val, val_labels, test, test_labels)
    val_acc = (heads(val.float()).argmax(-1) == val_labels[:, None]).float().mean(0)  # (H,)
    best = int(val_acc.argmax())  # argmax's first maximum
    names = [(view, lr) for view in heads.views for lr in lrs]
    test_acc = (heads(test.float())[:, best].argmax(-1) == test_labels).float().mean().item()
    per_head = {f"{v}/lr{lr:g}": a for (v, lr), a in zip(names, val_acc.tolist(), strict=True)}
    view, lr = names[best]
    return {
        "features": view,
        "lr": lr,
        "val_acc": val_acc[best].item(),
        "test_acc": test_acc,
        "val_acc_per_head": per_head,
    }


def _choose_on_map(heads: Heads, lrs: tuple, val, val_labels, test, test_labels) -> dict:
    from vitlab.evaluation.probes import average_precision as ap

    val_logits = heads(val.float())  # (N, H, C)
    val_map = torch.tensor([ap(val_logits[:, h], val_labels) for h in range(val_logits.shape[1])])
    best = int(val_map.argmax())  # argmax's first maximum
    names = [(view, lr) for view in heads.views for lr in lrs]
    test_logits = heads(test.float())[:, best]
    view, lr = names[best]
    return {
        "features": view,
        "lr": lr,
        "val_map": val_map[best].item(),
        "test_map": ap(test_logits, test_labels),
        "test_map_micro": ap(test_logits, test_labels, "micro"),
        "val_map_per_head": {f"{v}/lr{lr:g}": a for (v, lr), a in zip(names, val_map.tolist(), strict=True)},
    }


def linear_grid(
    views: dict[str, slice], train, train_labels, val, val_labels, test, test_labels, num_classes: int,
    schedule: Schedule = Schedule(),
) -> dict:  # fmt: skip
    """DINOv2's linear evaluation on cached features: (N, D) train / val / test features, `views` the columns of each
    feature configuration; the chosen (configuration, learning rate), its validation and test accuracy."""
    g = torch.Generator().manual_seed(schedule.seed)
    heads = Heads(views, train.shape[1], num_classes, len(schedule.lrs), g)
    train_heads(heads, cached_batches(train.float(), train_labels.long(), schedule), schedule)
    return choose(heads, schedule.lrs, val, val_labels, test, test_labels)
