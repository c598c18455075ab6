import shutil
import socket

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import CIFAR10DataModule, DigitsDataModule, FakeDataModule, ImageFolderDataModule
from vitlab.data.digits import random_affine


def test_digits_split_is_fixed_stratified_and_disjoint():
    a, b = DigitsDataModule(img_size=8), DigitsDataModule(img_size=8)
    a.setup(), b.setup()
    assert (len(a.train_set), len(a.val_set), len(a.test_set)) == (1257, 270, 270)
    assert a.test_set.indices == b.test_set.indices and a.test_set.base is not b.test_set.base
    labels = a.test_set.base.labels
    counts = torch.bincount(labels[a.test_set.indices], minlength=10)
    assert counts.min() >= 26 and counts.max() <= 28  # stratified: ~27 per class
    assert not set(a.train_set.indices) & set(a.test_set.indices)
    assert not set(a.train_set.indices) & set(a.val_set.indices)
    # uint8, as any dataset's: the pixel values 0..16 scaled to 0..255
    assert a.train_set.base.images.dtype == torch.uint8 and a.train_set.base.images.max() == 255


def test_digits_batches_are_normalised_and_resized_on_transfer():
    dm = DigitsDataModule(img_size=[16, 24], batch_size=32)
    dm.setup()
    x, y = dm.on_after_batch_transfer(next(iter(dm.test_dataloader())), 0)
    assert x.shape == (32, 1, 16, 24) and x.dtype == torch.float32 and y.dtype == torch.long
    native = DigitsDataModule(img_size=8)
    native.setup()
    full = native.device_transform([native.train_set.base.images, None], train=False)[0]  # every image, at 8x8
    assert abs(full.mean().item()) < 0.05 and abs(full.std().item() - 1) < 0.05


def test_random_affine_identity_and_fill():
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(random_affine(x, 0.0, (1.0, 1.0), fill=-0.8), x, atol=1e-6, rtol=0)
    zoomed_out = random_affine(torch.zeros(2, 1, 8, 8) + 5.0, 0.0, (0.5, 0.5), fill=-0.8)
    assert zoomed_out[0, 0, 0, 0].item() == pytest.approx(-0.8)  # the corner is outside the shrunk image
    assert zoomed_out[0, 0, 4, 4].item() == pytest.approx(5.0)


def test_bad_datamodule_arguments_name_the_value():
    with pytest.raises(ValueError, match="data.batch_size 0 must be >= 1"):
        DigitsDataModule(img_size=8, batch_size=0)
    with pytest.raises(ValueError, match="data.num_classes 5 does not match DigitsDataModule's 10"):
        DigitsDataModule(img_size=8, num_classes=5)
    with pytest.raises(ValueError, match=r"data.rotate 270 must be in \[0, 180\]"):
        DigitsDataModule(img_size=8, rotate=270)
    with pytest.raises(ValueError, match="one value per channel"):
        FakeDataModule(img_size=8, channels=3, mean=[0.5])
    with pytest.raises(ValueError, match="digits augments whole batches on the device: use data.shift"):
        DigitsDataModule(img_size=8, train_transform={"hflip": 0.5})


def test_fake_data_is_deterministic():
    dm = FakeDataModule(img_size=16, num_classes=4, batch_size=8, num_train=16)
    dm.setup()
    x1, y1 = next(iter(dm.val_dataloader()))
    x2, y2 = next(iter(dm.val_dataloader()))
    assert x1.shape == (8, 3, 16, 16) and torch.equal(x1, x2) and torch.equal(y1, y2) and y1.max() < 4


def _image_tree(root, modes=("RGB", "L", "RGBA", "I;16", "P")):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            d = root / split / cls
            d.mkdir(parents=True)
            for i, mode in enumerate(modes):
                if mode == "I;16":
                    img = Image.fromarray(rng.integers(0, 65535, (20, 24), dtype=np.uint16))
                    assert img.mode.startswith("I;16")
                else:
                    img = Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).convert(mode)
                img.save(d / f"{i}.png")


def test_imagefolder_mixes_image_modes(tmp_path):
    _image_tree(tmp_path)
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path), num_classes=2, img_size=16, batch_size=10, eval_transform={"crop_pct": 1.0}
    )
    dm.setup()
    assert dm.class_names == ["cat", "dog"]
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (10, 3, 16, 16) and sorted(y.tolist()) == [0] * 5 + [1] * 5
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (10, 3, 16, 16)


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_cross_as_uint8_and_become_normalised_floats_on_the_device(tmp_path, workers):
    _image_tree(tmp_path, modes=("RGB", "L"))
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(
        tmp_path / "val" / "cat" / "2.jpg", quality=90
    )
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path),
        num_classes=2,
        img_size=16,
        batch_size=2,
        num_workers=workers,
        prefetch_factor=3,
        train_transform={"random_erasing": 0.5},
    )
    dm.setup()
    train = dm.train_dataloader()
    assert train.num_workers == workers and (not workers or (train.persistent_workers and train.prefetch_factor == 3))
    for loader in (train, dm.val_dataloader()):
        x, y = next(iter(loader))
        assert x.dtype == torch.uint8 and x.shape == (2, 3, 16, 16) and y.dtype == torch.long
        z, y2 = dm.device_transform((x, y), train=True)
        assert z.dtype == torch.float32 and y2 is y
    # The eval loader and vitlab.predict are one preprocessing: the same file gives the same tensor.
    from vitlab.data.images import read_image

    val = [p for p, _ in dm.val_set.base.samples]
    batches = [dm.device_transform(b, train=False)[0] for b in dm.val_dataloader()]
    for path, x in zip(val, torch.cat(batches), strict=True):
        assert torch.equal(dm.predict_tensor(read_image(path))[0], x), path


def test_imagefolder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderDataModule(data_dir=str(tmp_path / "nope"), num_classes=2, img_size=16).setup()
    _image_tree(tmp_path, modes=("RGB",))
    with pytest.raises(ValueError, match="data.num_classes 3 does not match the 2 class folders"):
        ImageFolderDataModule(data_dir=str(tmp_path), num_classes=3, img_size=16).setup()


def test_imagefolder_names_the_class_folders_that_are_not_there(tmp_path):
    """A train/ of loose images (class_folders counts 0), and a val/ whose classes are not train's: the folders
    are named, not a number (issue 41)."""
    from tests.helpers.images import image_tree

    (tmp_path / "flat" / "train").mkdir(parents=True)
    (tmp_path / "flat" / "train" / "x.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"flat/train holds no class folders \(expected .*data.unlabeled=true\)"):
        ImageFolderDataModule(data_dir=str(tmp_path / "flat"), num_classes=0, img_size=16)
    image_tree(tmp_path / "t", classes=("ant", "bee", "cat"), splits=("train",))
    image_tree(tmp_path / "t", classes=("ant", "cow"), splits=("val",))
    dm = ImageFolderDataModule(data_dir=str(tmp_path / "t"), num_classes=3, img_size=16)
    said = r"t/val differ from those of .*t/train \(missing bee, cat; not in train: cow\)"
    with pytest.raises(ValueError, match=said):
        dm.setup()


def test_cifar_offline_without_a_copy_fails_clearly(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="CIFAR-10 not found under data.data_dir=.* and data.download=false"):
        CIFAR10DataModule(data_dir=str(tmp_path), download=False, img_size=32).prepare_data()
    socket.setdefaulttimeout(5)  # this machine has no route out; fail fast whatever the resolver does
    try:
        with pytest.raises(ConnectionError, match="CIFAR-10 not found under data.data_dir=.* and the download failed"):
            CIFAR10DataModule(data_dir=str(tmp_path / "data" / "cifar10"), download=True, img_size=32).prepare_data()
        assert list(tmp_path.iterdir()) == []  # no empty data/cifar10/ left behind (issue 41)
    finally:
        socket.setdefaulttimeout(None)


@pytest.mark.parametrize("workers", [0, 1])
def test_undecodable_image_stops_naming_the_file(tmp_path, workers):
    from vitlab.utils.errors import one_line

    _image_tree(tmp_path, modes=("RGB",))
    bad = tmp_path / "val" / "dog" / "broken.png"
    bad.write_bytes((tmp_path / "val" / "dog" / "0.png").read_bytes()[:40])  # truncated
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path), num_classes=2, img_size=16, batch_size=4, num_workers=workers, check_images=False
    )
    dm.setup()
    with pytest.raises(ValueError) as e:
        list(dm.val_dataloader())
    assert one_line(e.value).startswith(f"image file '{bad}' cannot be decoded")


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_setup_checks_every_split_before_anything_is_read(tmp_path, split):
    """check_images (the default): a file that is not an image, or a PNG cut short, in any split the run reads
    stops setup(), not the epoch (or, in test/, the end of training) that would read it."""
    from vitlab.utils.errors import UserError

    _image_tree(tmp_path, modes=("RGB",))
    shutil.copytree(tmp_path / "val", tmp_path / "test")
    cut = tmp_path / split / "dog" / "cut.png"
    cut.write_bytes((tmp_path / split / "dog" / "0.png").read_bytes()[:-20])
    dm = ImageFolderDataModule(data_dir=str(tmp_path), num_classes=2, img_size=16, batch_size=4)
    with pytest.raises(UserError, match=f"image file '{cut}' is cut short"):
        dm.setup()


def test_empty_class_folder_is_named(tmp_path):
    _image_tree(tmp_path, modes=("RGB",))
    (tmp_path / "train" / "eel").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'train'}: Found no valid file for the classes eel"):
        ImageFolderDataModule(data_dir=str(tmp_path), num_classes=3, img_size=16).setup()


@pytest.mark.parametrize("ddp", [True, False])
def test_validation_shares_are_each_process_s_own_under_ddp_and_evened_out_where_a_stall_could_follow(ddp):
    """Issue 78: under DDP each process validates its own share, none twice (the metrics the same on any count;
    DDP's forward without gradients syncs nothing after the first batch, so uneven shares cannot stall it); under a
    sharded strategy (every forward gathers the weights: an extra batch on one process would wait forever)
    Lightning's evened-out shares stay."""
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from tests.helpers.trainers import fake_trainer

    class OnCPU:  # the strategy's kind, on the CPU (no devices to set up)
        root_device = torch.device("cpu")

    kind = type("Strategy", (OnCPU, DDPStrategy if ddp else ModelParallelStrategy), {})
    dm = DigitsDataModule(img_size=8, batch_size=64, on_device=False, num_workers=0)
    dm.trainer = fake_trainer(world=4, rank=3)
    dm.trainer.strategy = kind.__new__(kind)
    dm.setup("fit")
    sampler = dm.val_dataloader().sampler
    assert isinstance(sampler, UnrepeatedDistributedSampler) == ddp
    assert isinstance(dm.test_dataloader().sampler, UnrepeatedDistributedSampler)  # testing: outside any wrapper
