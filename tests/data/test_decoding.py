"""data.decode=device (data/decoding.py) on the CPU: the workers draw the worker path's crops and choices for the same
seed, and the batch the device makes is the worker path's pixel for pixel in training (both decoders are
libjpeg-turbo here and the crop, resize and colour kernels are the same; on a GPU nvjpeg decodes: tests/end_to_end/
test_gpu.py), evaluation within one level (PIL's resize against torchvision's); the DDP share-out and a mid-epoch
resume are the sampler's; what it cannot do is refused in one line."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2 as T

from tests.helpers.trainers import fake_trainer
from vitlab.data import HFDataModule, ImageFolderDataModule, ListDataModule, StreamingDataModule, decoding
from vitlab.data.seeded import seeded
from vitlab.utils.errors import UserError

EVERY_OP = {"color_jitter": [0.4, 0.4, 0.4, 0.1], "grayscale_prob": 0.3, "gaussian_blur_prob": 0.3}


def jpeg_tree(root, per_class=5, classes=("a", "b"), seed=0):
    """data_dir/{train,val}/<class>/ photos of 30-60 px: JPEGs, and a grayscale JPEG, a CMYK JPEG, an EXIF-rotated
    JPEG and a PNG among them (the device decoder's fallbacks)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                h, w = (int(v) for v in rng.integers(30, 60, 2))
                coarse = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
                img = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
                name = root / split / c / f"{i}.jpg"
                if i == 0:
                    img.convert("L").save(name, quality=90)
                elif i == 1:
                    img.convert("CMYK").save(name, quality=90)
                elif i == 2:
                    img.save(name.with_suffix(".png"))
                elif i == 3:
                    exif = Image.Exif()
                    exif[0x0112] = 6  # rotated 90 degrees
                    img.save(name, quality=90, exif=exif)
                else:
                    img.save(name, quality=90)
    return root


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return jpeg_tree(tmp_path_factory.mktemp("jpegs"))


def _module(root, decode, rank=0, world=1, workers=0, kind=ImageFolderDataModule, **train_transform):
    where = {"data_dir": str(root), "num_classes": 2} if kind is ImageFolderDataModule else root
    dm = kind(**where, img_size=16, batch_size=4, num_workers=workers, decode=decode, train_transform=train_transform)
    dm.trainer = fake_trainer(world, rank)
    dm.setup("fit")
    return dm


def test_the_workers_draw_the_worker_path_s_crops_and_the_batch_is_its_pixels(jpegs, monkeypatch):
    """The same boxes and pixels, random erasing's too (on the device: the global batch's draws, issue 78)."""
    ops = EVERY_OP | {"random_erasing": 0.5}
    workers, device = _module(jpegs, "workers", **ops), _module(jpegs, "device", **ops)
    boxes = []
    make_params = T.RandomResizedCrop.make_params
    monkeypatch.setattr(T.RandomResizedCrop, "make_params", lambda self, f: boxes.append(make_params(self, f)) or
                        boxes[-1])  # fmt: skip
    encoded = device.train_dataloader().dataset
    for key in list(device.train_dataloader().sampler)[:6]:
        record = encoded[key][1]
        img, _ = workers.train_set.base[workers.train_set.indices[key[1]]]
        seeded(key[0], workers.train_tf, img)
        drawn = [boxes[-1][k] for k in ("top", "left", "height", "width")]
        assert record[[decoding.TOP, decoding.LEFT, decoding.BOX_H, decoding.BOX_W]].tolist() == drawn
        assert record[[decoding.H, decoding.W]].tolist() == list(img.shape[-2:])  # (EXIF orientation applied)
    kinds = [encoded[i][1][decoding.ON_DEVICE].item() for i in range(len(encoded))]
    assert kinds.count(0) == 8 and kinds.count(1) == 2  # 2 x grayscale, CMYK, EXIF, PNG by the fallback
    # 3 epochs of batches: every op's draws taken (jitter's 4 orders, grayscale, blur), the same uint8 pixels
    for epoch in range(3):
        for dm in (workers, device):
            dm.trainer.fit_loop.epoch_progress.current.processed = epoch
        for a, b in zip(workers.train_dataloader(), device.train_dataloader(), strict=True):
            x, y = workers.device_transform(a, train=True)
            z, labels = device.device_transform(device.transfer_batch_to_device(b, torch.device("cpu"), 0), True)
            assert torch.equal(x, z) and torch.equal(y, labels)


def test_evaluation_on_the_device_is_within_a_level_of_the_workers(jpegs):
    """The worker path resizes in PIL (fixed point), the device in torchvision on float32, both antialiased bicubic
    with the same kernel: rounding apart, at most one level of 255, and the same geometry."""
    workers, device = _module(jpegs, "workers"), _module(jpegs, "device")
    std = torch.tensor(workers.std).view(1, 3, 1, 1)
    for a, b in zip(workers.val_dataloader(), device.val_dataloader(), strict=True):
        x = workers.device_transform(a, train=False)[0]
        z = device.device_transform(device.transfer_batch_to_device(b, torch.device("cpu"), 0), train=False)[0]
        levels = ((x - z) * std * 255).abs()
        assert levels.max() < 1.01 and levels.mean() < 0.3


def test_the_ddp_share_out_and_a_mid_epoch_resume_are_the_sampler_s(jpegs):
    shares = [_module(jpegs, "device", rank=r, world=2).train_dataloader() for r in (0, 1)]
    names = [[n for batch in loader for n in batch.names] for loader in shares]
    assert len(names[0]) == len(names[1]) == 4 and not set(names[0]) & set(names[1])  # whole batches, disjoint
    loader = _module(jpegs, "device", workers=1).train_dataloader()  # (workers: the loader that looks ahead)
    whole = [(b.names, b.records) for b in loader]
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = _module(jpegs, "device", workers=1).train_dataloader()
    resumed.load_state_dict(state)
    rest = [(b.names, b.records) for b in resumed]
    assert len(rest) == len(whole) - 1
    for (n, r), (m, s) in zip(whole[1:], rest, strict=True):
        assert n == m
        torch.testing.assert_close(r, s, rtol=0, atol=0, equal_nan=True)


def test_the_other_readers_files_are_decoded_on_the_device_as_the_folder_s(records, shards):
    """data=hf (a saved dataset's Image cells), data=list (a CSV's files) and data=streaming (the pack's shards): the
    device path's batches are their worker path's (PNG files: the fallback decoder), epoch after epoch."""
    readers = {
        HFDataModule: {"name": str(records / "saved"), "num_classes": 3},
        ListDataModule: {"train_file": str(records / "train.csv"), "val_file": str(records / "val.csv"),
                         "num_classes": 3},
        StreamingDataModule: {"data_dir": str(shards), "num_classes": 3},
    }  # fmt: skip
    for kind, where in readers.items():
        workers, device = (_module(where, decode, kind=kind, color_jitter=0.4) for decode in ("workers", "device"))
        for a, b in zip(workers.train_dataloader(), device.train_dataloader(), strict=True):
            z, labels = device.device_transform(device.transfer_batch_to_device(b, torch.device("cpu"), 0), True)
            x, y = workers.device_transform(a, train=True)
            assert torch.equal(x, z) and torch.equal(y, labels), kind


@pytest.mark.parametrize(
    "settings, said",
    [
        ({"train_transform": {"auto_augment": "rand-m9-mstd0.5-inc1"}}, "auto_augment=rand-m9-mstd0.5-inc1 has no"),
        ({"train_transform": {"shift": 2, "random_resized_crop": None}}, "shift=2 has no batched tensor version"),
        ({"multicrop": {"crops": {"global_size": 16, "local_size": 8, "local_crops": 2}}}, "objective=dino's views"),
        ({"eval_transform": {"interpolation": "lanczos"}}, "lanczos is a PIL filter"),
        ({"on_device": True}, "data.on_device=true holds the images decoded"),
        ({"decode": "gpu"}, "data.decode 'gpu' is not one of ['workers', 'device']"),
    ],
)
def test_what_the_device_path_cannot_do_is_refused_in_one_line(jpegs, settings, said):
    kwargs = {"decode": "device", **settings}
    with pytest.raises(UserError) as e:
        ImageFolderDataModule(data_dir=str(jpegs), num_classes=2, img_size=16, batch_size=4, **kwargs)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_images_held_decoded_in_memory_are_refused():
    from vitlab.data import FakeDataModule

    dm = FakeDataModule(img_size=8, batch_size=8, num_train=16, decode="device", num_workers=0, on_device=False)
    dm.setup("fit")
    with pytest.raises(UserError, match="holds its images decoded or streams them; set data.decode=workers"):
        dm.train_dataloader()


@pytest.mark.gpu
def test_on_a_gpu_nvjpeg_makes_the_worker_path_s_batch_within_the_decoders_difference(jpegs):
    """nvjpeg's IDCT and chroma upsampling are not libjpeg-turbo's: a level or two apart on average in these smooth
    photos, a few more at sharp colour edges (the fallback files, decoded by the workers' decoder, and the crops, flips
    and colour draws are the same)."""
    workers, device = _module(jpegs, "workers", **EVERY_OP), _module(jpegs, "device", **EVERY_OP)
    device.trainer.strategy.root_device = cuda = torch.device("cuda")
    std = torch.tensor(workers.std).view(1, 3, 1, 1)
    for a, b in zip(workers.train_dataloader(), device.train_dataloader(), strict=True):
        x = workers.device_transform(a, train=True)[0]
        z, labels = device.device_transform(device.transfer_batch_to_device(b, cuda, 0), train=True)
        assert z.device.type == "cuda" and torch.equal(labels.cpu(), a[1])
        levels = ((x - z.cpu()) * std * 255).abs()
        assert levels.mean() < 2.0 and levels.quantile(0.99) < 12, (levels.mean(), levels.quantile(0.99))
