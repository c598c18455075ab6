"""Long tails (issue 77, points 3 and 4): data.sampler=class_balanced draws each class as often as its weight says
(inverse: alike; sqrt: as the square root of its count), keeps the epoch's length, deals one draw out to the
processes and is fixed by (seed, epoch); data=digits data.imbalance=100 trains on Cao et al.'s exponential tail and
tests on balanced digits."""

import pytest
import torch

from vitlab.data import DigitsDataModule
from vitlab.data.balanced import ClassBalancedOrder, balanced_sampler, image_weights, long_tail
from vitlab.data.resident import ArrayImages
from vitlab.data.seeded import TransformDataset
from vitlab.utils.errors import UserError

COUNTS = [400, 100, 24, 4]  # a long tail of four classes (528 images: two processes, no padding)


def _tail():
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(COUNTS)])
    return TransformDataset(ArrayImages(torch.zeros(len(labels), 1, 2, 2, dtype=torch.uint8), labels), None)


@pytest.mark.parametrize("balance, power", [("inverse", 1.0), ("sqrt", 0.5)])
def test_each_class_is_drawn_as_its_weight_says_and_the_epoch_keeps_its_length(balance, power):
    data = _tail()
    sampler = balanced_sampler(data, balance, world=1, rank=0, seed=0, batch_size=1)
    drawn = []
    for epoch in range(8):
        sampler.set_epoch(epoch)
        pairs = list(sampler)
        assert len(pairs) == len(sampler) == len(data)  # the uniform sampler's epoch
        drawn += [i for _, i in pairs]
    got = torch.bincount(data.base.labels[drawn], minlength=4).double() / len(drawn)
    share = torch.tensor([n ** (1 - power) for n in COUNTS], dtype=torch.double)  # count x count ** -power
    assert torch.allclose(got, share / share.sum(), atol=0.02), (got, share / share.sum())


@pytest.mark.parametrize("world", [2, 4])
def test_the_processes_share_out_one_draw_fixed_by_seed_and_epoch(world):
    """Issue 78: one epoch's draws, the same on any count: global batches of 8 (66 of them), each process its
    contiguous share, with the same augmentation seeds."""
    data = _tail()
    weights = image_weights(data.base.labels, 1.0)
    ranks = [
        ClassBalancedOrder(data, weights, world, r, seed=3, batch_size=8 // world, keyed=True) for r in range(world)
    ]
    for s in ranks:
        s.set_epoch(1)
    shares = [list(s) for s in ranks]
    b = 8 // world
    assert [len(s) for s in shares] == [len(data) // world] * world
    alone = ClassBalancedOrder(data, weights, 1, 0, seed=3, batch_size=8, keyed=True)
    alone.set_epoch(1)
    pairs = list(alone)
    assert [x for k in range(len(data) // 8) for s in shares for x in s[k * b : (k + 1) * b]] == pairs
    assert len({s for s, _ in pairs}) == len(pairs)  # an image drawn twice: its own augmentation each time
    alone.set_epoch(2)
    assert list(alone) != pairs


def test_an_image_of_several_labels_weighs_as_its_rarest_label():
    hot = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0], [0, 0, 0]])  # counts 4, 1, 1
    assert image_weights(hot, 1.0).tolist() == [0.25, 1.0, 1.0, 0.25, 0.25]


def test_bad_sampler_settings_are_one_line():
    with pytest.raises(UserError, match=r"^data.sampler 'balanced' is not one of \['uniform', 'class_balanced'\]$"):
        DigitsDataModule(img_size=8, sampler="balanced")
    with pytest.raises(UserError, match=r"^data.sampler_balance 'log' is not one of \['inverse', 'sqrt'\]$"):
        DigitsDataModule(img_size=8, sampler="class_balanced", sampler_balance="log")
    with pytest.raises(UserError, match=r"^data.sampler=class_balanced draws images with replacement, and data.rep"):
        DigitsDataModule(img_size=8, sampler="class_balanced", repeated_aug=3)
    with pytest.raises(UserError, match=r"^data.imbalance 0.5 must be >= 1"):
        DigitsDataModule(img_size=8, imbalance=0.5)


def test_long_tailed_digits_train_on_an_exponential_tail_and_test_on_all():
    kept = long_tail(list(range(1000)), [i // 100 for i in range(1000)], 100, seed=0)
    counts = torch.bincount(torch.tensor([i // 100 for i in kept])).tolist()
    assert counts == [max(1, int(100 * 100 ** (-c / 9))) for c in range(10)]  # 100, 59, 35, ..., 1
    dm = DigitsDataModule(img_size=8, imbalance=100, sampler="class_balanced", on_device=False)
    dm.setup("fit")
    train = torch.bincount(dm.train_set.base.labels[dm.train_set.indices], minlength=10).tolist()
    test = torch.bincount(dm.test_set.base.labels[dm.test_set.indices], minlength=10).tolist()
    assert train[0] / train[9] >= 50 and train == sorted(train, reverse=True) and min(test) >= 26
    assert isinstance(dm.train_dataloader().sampler, ClassBalancedOrder)
