"""Datasets held on the training device (data/resident.py, `data.on_device`): the loader path's batches where
nothing random is drawn, torchvision's shift and flip a batch at a time, drawn on the host, and one log line on
which path a run takes and why."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from tests.helpers.images import image_tree
from tests.helpers.trainers import fake_trainer
from vitlab.data import CIFAR10DataModule, DigitsDataModule, FakeDataModule, ImageFolderDataModule
from vitlab.data.resident import ResidentImages, ShiftFlip
from vitlab.data.seeded import TransformDataset


def _as_rank(dm, rank: int, world: int, epoch: int = 0, device: str = "cpu") -> None:
    """`dm` as process `rank` of `world` sees it under a Trainer, in `epoch`."""
    dm.trainer = fake_trainer(world, rank, epoch, device)


def _batches(dm, world: int) -> list[torch.Tensor]:
    """Every batch each process trains on in two epochs, then validates and tests on, as the model takes them."""
    out = []
    for epoch in (0, 1):
        for rank in range(world):
            _as_rank(dm, rank, world, epoch)
            for x, y in dm.train_dataloader():
                out += dm.device_transform([x, y], train=True)
                dm.trainer.next_batch()
    for rank in range(world):
        _as_rank(dm, rank, world)
        for loader in (dm.val_dataloader(), dm.test_dataloader()):
            for x, y in loader:
                out += dm.device_transform([x, y], train=False)
    return out


def _folder(tmp_path, shift: int = 0, **kw):
    root = image_tree(tmp_path, classes=("a", "b"), per_class=6, size=(11, 14), splits=("train", "val", "test"))
    transform = {"random_resized_crop": None, "hflip": 0.0, "shift": shift}
    return ImageFolderDataModule(data_dir=str(root), num_classes=2, num_workers=0, train_transform=transform, **kw)


CASES = {
    "digits": lambda tmp_path, **kw: DigitsDataModule(img_size=8, batch_size=64, shift=0, **kw),
    "digits-resized": lambda tmp_path, **kw: DigitsDataModule(img_size=[12, 16], batch_size=64, shift=0, **kw),
    "fake-erased": lambda tmp_path, **kw: FakeDataModule(
        img_size=16,
        batch_size=8,
        num_train=40,
        num_val=12,
        num_test=12,
        num_workers=0,
        train_transform={
            "random_resized_crop": None,
            "hflip": 0.0,
            "random_erasing": 0.7,
            "erasing_mode": "pixel",
            "erasing_count": 2,
        },
        **kw,
    ),  # fmt: skip
    "folder-cropped": lambda tmp_path, **kw: _folder(tmp_path, img_size=8, batch_size=4, **kw),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_held_on_the_device_the_batches_are_the_loaders_where_the_augmentation_is_the_same(tmp_path, case, world):
    """With the same seed, the device path and the loader path (`data.on_device=false`) give each process the same
    batches, image for image, bit for bit: the same shares of the same permutation each epoch, the same pixels
    (stored through the loader's own resize and center crop), the same normalisation and the same random erasing."""
    paths = {}
    for on_device in (True, False):
        torch.manual_seed(0)
        dm = CASES[case](tmp_path, on_device=on_device)
        dm.setup()
        paths[on_device] = _batches(dm, world)
        assert dm.resides is on_device
    assert len(paths[True]) == len(paths[False]) > 0
    for a, b in zip(paths[True], paths[False], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_shift_and_flip_are_torchvisions_on_each_image_drawn_on_the_host():
    """ShiftFlip(2, 0.5): each image is torchvision's pad-by-2-and-crop at some offset, flipped or not; every
    offset and both flips occur; the draws come from the host generator, as many whatever the device (a GPU draws
    the same numbers as a CPU), and a batch without shift or flip is left alone, nothing drawn."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (256, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    start = g.get_state()
    out = ShiftFlip(2, 0.5)(x, g)
    after = g.get_state()
    assert out.shape == x.shape and out.dtype == torch.uint8 and out.is_contiguous()
    seen = set()
    for img, src in zip(out, x, strict=True):
        padded = TF.pad(src, [2, 2, 2, 2])
        found = {
            (dy, dx, flip)
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
            if torch.equal(img, (TF.horizontal_flip if flip else lambda t: t)(padded[:, dy : dy + 6, dx : dx + 5]))
        }
        assert found, "an image that is no shift and flip of its source"
        seen |= found
    assert {dy for dy, _, _ in seen} == set(range(5)) == {dx for _, dx, _ in seen}
    assert {flip for *_, flip in seen} == {False, True}
    g.set_state(start)
    on_meta = ShiftFlip(2, 0.5)(x.to("meta"), g)
    assert on_meta.shape == x.shape and torch.equal(g.get_state(), after)
    assert ShiftFlip(0, 0.0)(x, g) is x and torch.equal(g.get_state(), after)


def test_the_digits_default_is_held_on_the_training_device_and_says_so(caplog):
    """Digits by default (data.on_device=auto): every split on the training device (the meta device stands in for a
    GPU), a loader without workers that pins nothing, whole batches gathered there, and one log line."""
    dm = DigitsDataModule(img_size=8, batch_size=16, pin_memory=True, num_workers=3)
    dm.setup()
    _as_rank(dm, 0, 1, device="meta")
    with caplog.at_level(logging.INFO, logger="vitlab.data.resident"):
        loader = dm.train_dataloader()
    assert caplog.messages == [
        "data on meta: 1,257 train, 270 val, 270 test images as uint8 (0.1 MB), augmented there a batch at a time, "
        "no loader workers (data.on_device=auto)"
    ]
    assert isinstance(loader.dataset, ResidentImages) and loader.num_workers == 0 and not loader.pin_memory
    x, y = next(iter(loader))
    assert x.device.type == "meta" and x.dtype == torch.uint8 and x.shape == (16, 1, 8, 8) and y.device.type == "meta"
    assert dm.val_dataloader().dataset.images.device.type == "meta"


def test_auto_keeps_the_loader_for_what_runs_per_image_or_over_the_budget_and_says_why(tmp_path, caplog):
    def resides(dm) -> bool:
        dm.setup()
        dm.train_dataloader()
        return dm.resides

    caplog.set_level(logging.INFO, logger="vitlab.data.resident")
    crop, plain = {"random_resized_crop": [0.5, 1.0]}, {"random_resized_crop": None}
    assert not resides(FakeDataModule(img_size=8, num_workers=0, train_transform=crop))
    assert not resides(FakeDataModule(img_size=8, num_workers=0, train_transform=plain, on_device_gb=1e-4))
    assert not resides(_folder(tmp_path, img_size=8, batch_size=4, shift=2))
    assert caplog.messages == [
        "data.on_device=auto: data.train_transform.random_resized_crop=[0.5, 1.0] runs per image, so the loader's "
        "workers read the images",
        "data.on_device=auto: the images take 0.3 MB as uint8, over data.on_device_gb=0.0001, so the loader's "
        "workers read them (raise data.on_device_gb, or set data.on_device=true, to hold them on cpu)",
        "data.on_device=auto: data.train_transform.shift=2 (each image is shifted at its own size, before the resize) "
        "runs per image, so the loader's workers read the images",
    ]
    assert not resides(FakeDataModule(img_size=8, num_workers=0, on_device=False))
    assert caplog.messages[-1] == "data.on_device=false: the loader's workers read the images, a batch at a time"
    assert resides(FakeDataModule(img_size=8, train_transform=plain, on_device=True, on_device_gb=1e-4))  # any size
    with pytest.raises(ValueError, match=r"^data.on_device=true, but data.train_transform.auto_augment=3a runs per"):
        resides(FakeDataModule(img_size=8, on_device=True, train_transform=plain | {"auto_augment": "3a"}))
    with pytest.raises(ValueError, match=r"^data.on_device 'yes' must be true, false or auto$"):
        FakeDataModule(img_size=8, on_device="yes")
    with pytest.raises(ValueError, match=r"^data.on_device_gb 0 must be a number of GB > 0$"):
        FakeDataModule(img_size=8, on_device_gb=0)


def test_cifar_is_held_from_torchvisions_arrays_as_its_items_are(monkeypatch):
    """CIFAR's images come from torchvision's array, each equal to the PIL item torchvision gives; the training
    split is held at 32x32, its own size, where the default shift of 4 runs."""
    rng = np.random.default_rng(0)
    sets = {
        train: SimpleNamespace(data=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                               targets=rng.integers(0, 10, n).tolist(), classes=[str(i) for i in range(10)])
        for train, n in ((True, 40), (False, 8))
    }  # fmt: skip
    monkeypatch.setattr(CIFAR10DataModule, "_open", lambda self, train: sets[train])
    crop = {"random_resized_crop": None, "shift": 4, "hflip": 0.5}  # conf/data/cifar10.yaml's
    dm = CIFAR10DataModule(img_size=32, batch_size=8, val_size=8, train_transform=crop)
    dm.setup()
    for i in (0, 17):
        img, label = dm.train_set.base[i]
        assert torch.equal(img, TF.to_image(Image.fromarray(sets[True].data[i]))) and label == sets[True].targets[i]
    _as_rank(dm, 0, 1)
    x, y = next(iter(dm.train_dataloader()))
    assert dm.resides and x.shape == (8, 3, 32, 32) and x.dtype == torch.uint8
    assert isinstance(dm.train_set, TransformDataset) and dm.class_names == [str(i) for i in range(10)]


@pytest.mark.parametrize("on_device", [True, False])
def test_repeated_augmentation_is_timms_global_batches_on_any_count_and_augments_every_copy_alike_never(on_device):
    """data.repeated_aug=3: on one process the training indices are timm's RepeatAugSampler's (DeiT's) for the epoch,
    on either path; on 2 or 4 processes (issue 78) each global batch holds the images timm's would (timm strides them
    over the processes, here each process takes its contiguous share), with the same augmentation seeds as on one
    process; per image (the loader's) no two copies share a seed."""
    from timm.data.distributed_sampler import RepeatAugSampler

    dm = FakeDataModule(
        img_size=8, num_train=40, num_val=8, num_test=8, batch_size=8, repeated_aug=3, on_device=on_device,
        train_transform={"random_resized_crop": None},
    )  # fmt: skip
    dm.setup()
    for epoch in (0, 1):
        _as_rank(dm, 0, 1, epoch)
        one = list(dm.train_dataloader().sampler)
        timm = RepeatAugSampler(dm.train_set, num_replicas=1, rank=0, num_repeats=3)
        timm.set_epoch(epoch)
        indices = one if on_device else [i for _, i in one]
        assert indices == list(timm)
        for world in (2, 4):
            b, shares, strided = 8 // world, [], []  # each process's share of a global batch of 8
            for rank in range(world):
                _as_rank(dm, rank, world, epoch)
                shares.append(list(dm.train_dataloader().sampler))
                strided.append(RepeatAugSampler(dm.train_set, num_replicas=world, rank=rank, num_repeats=3))
                strided[-1].set_epoch(epoch)
                strided[-1] = list(strided[-1])
            ours = [x for k in range(len(one) // 8) for share in shares for x in share[k * b : (k + 1) * b]]
            assert ours == one  # the one process's sequence, batch by batch, keys and all
            for k in range(len(one) // 8):  # timm's global batch k: each process's k-th batch of b
                theirs = sorted(i for s in strided for i in s[k * b : (k + 1) * b])
                assert sorted(indices[k * 8 : (k + 1) * 8]) == theirs
        seeds = [] if on_device else [s for s, _ in one]
        assert len(set(seeds)) == len(seeds)  # every copy its own augmentation
        assert max(indices.count(i) for i in set(indices)) == 3  # an image's copies
    with pytest.raises(ValueError, match="data.repeated_aug 1 must be 0 .off. or a number of copies >= 2"):
        FakeDataModule(img_size=8, repeated_aug=1)
