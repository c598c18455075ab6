"""Small datasets held where training runs (`data.on_device`): every split once, as uint8 (N, C, H, W) tensors on
the training device, a batch one gather there, and training's shift and flip applied there to the whole batch. No
loader workers, nothing pinned or copied per step: on a GPU the host only launches work.

What is stored is what the loader path's per-image pipeline makes of every image alike, so that both paths see
the same pixels: the evaluation splits through the eval transform (resize, center crop), the training split through
its pipeline's ops before the first random one (the resize; none when a shift comes first, which then runs at the
images' own size, as per image). The loader gives the same batches in the same order (the same sampler); normalising
and random erasing are the same code with the same draws (`transforms.DeviceTransform`). The shift and the flip are
drawn a batch at a time here (`ShiftFlip`), from the datamodule's generator on the host, where the loader path draws
them per image: the same distribution, other draws. Drawn on the host, they are the same on a CPU and a GPU, and
the generator's state is checkpointed with the rest of each process's (training/devices/rank_state.py), so a run resumes
mid-epoch exactly.

`decide` picks the path: `data.on_device=auto` holds the splits on the device when the training augmentation runs
there and they fit in `data.on_device_gb`; otherwise the loader's workers read them, and one log line says why.
No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2 as T

from vitlab.data import image_views, transforms
from vitlab.data.seeded import Rows, TransformDataset, init_worker, rows_of
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

# The training settings only the per-image pipeline runs, with their off values (transforms.TrainTransform).
PER_IMAGE = {
    "random_resized_crop": None,
    "simple_crop": False,
    "auto_augment": None,
    "color_jitter": None,
    "grayscale_prob": 0.0,
    "gaussian_blur_prob": 0.0,
}
RANDOM_OPS = (transforms.Shift, T.RandomHorizontalFlip)  # the random ops a pipeline keeps when PER_IMAGE are off
CHUNK = 1024  # images prepared and copied to the device at a time when a split is stored


class ArrayImages(Dataset):
    """Images already decoded, in host memory: uint8 (N, C, H, W) and int64 labels (N,) (digits, CIFAR), or (N,
    classes) multi-hot rows (several labels an image). Its items are a folder's: (uint8 (C, H, W) image, int label),
    or the image and its row."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i]) if self.labels.ndim == 1 else self.labels[i]


class ResidentImages(Dataset):
    """A split on the training device: uint8 (N, C, H, W) images and int64 labels. A loader without workers or
    collation fetches whole batches by index (`__getitems__`): one gather on the device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        # made on the host and copied without blocking (a list made into a GPU tensor waits for the GPU)
        idx = torch.as_tensor(indices).to(self.labels.device, non_blocking=True)
        return [self.images[idx], self.labels[idx]]


def already_batched(batch):
    return batch


class ShiftFlip:
    """TrainTransform's `shift` (pad with `shift` zeros and crop back at random: torchvision's RandomCrop with
    padding, as `transforms.Shift`) and `hflip` (the chance of a horizontal flip), for a whole uint8 (B, C, H, W)
    batch where it is, in one gather. Each image's offsets and flip are drawn on the host from `generator` (row
    offsets, column offsets, flips: as many draws whatever the device) and cross to the device in one copy that does
    not wait."""

    def __init__(self, shift: int = 0, hflip: float = 0.0):
        self.shift, self.hflip = shift, hflip

    def __call__(self, x: torch.Tensor, generator: torch.Generator | Rows | None = None) -> torch.Tensor:
        """`generator`: or the Rows of a global batch (data/seeded.py): drawn for all of it, these rows kept."""
        if not self.shift and not self.hflip:
            return x
        B, _, H, W = x.shape
        generator, start, n = rows_of(generator, B)
        p = self.shift
        dy = torch.randint(0, 2 * p + 1, (n, 1), generator=generator) if p else torch.zeros(n, 1, dtype=torch.long)
        dx = torch.randint(0, 2 * p + 1, (n, 1), generator=generator) if p else torch.zeros(n, 1, dtype=torch.long)
        flip = torch.rand(n, 1, generator=generator) < self.hflip if self.hflip else torch.zeros(n, 1, dtype=torch.bool)
        dy, dx, flip = dy[start : start + B], dx[start : start + B], flip[start : start + B]
        cols = torch.where(flip, torch.arange(W - 1, -1, -1), torch.arange(W)) + dx  # (B, W) in the padded image
        where = torch.cat([dy + torch.arange(H), cols], 1).to(x.device, non_blocking=True)  # (B, H + W)
        rows, cols = where[:, :H, None], where[:, None, H:]  # (B, H, 1), (B, 1, W)
        padded = F.pad(x, (p,) * 4) if p else x
        batch = torch.arange(B, device=x.device)[:, None, None]
        return padded[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous()  # (B, H, W, C) -> (B, C, H, W)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shift={self.shift}, hflip={self.hflip})"


def per_image_only(settings: transforms.TrainTransform, native_hw: tuple[int, int] | None) -> str | None:
    """The first training setting that only the per-image pipeline runs (named as the config names it), or None
    when all of it runs on the device. A shift comes before the resize, at each image's own size: on the device
    only when the images share one (`native_hw`)."""
    for name, off in PER_IMAGE.items():
        value = getattr(settings, name)
        if value != off:
            return f"data.train_transform.{name}={list(value) if isinstance(value, tuple) else value}"
    if settings.shift and native_hw is None:
        return f"data.train_transform.shift={settings.shift} (each image is shifted at its own size, before the resize)"
    return None


def stored_transform(train_tf: T.Compose) -> T.Compose:
    """What the loader path does to every training image alike: its pipeline's ops before the first random one."""
    ops = []
    for op in train_tf.transforms:
        if isinstance(op, RANDOM_OPS):
            break
        ops.append(op)
    return T.Compose(ops)


def decide(dm: Any) -> bool:
    """Whether `dm`'s splits are held on its device (`dm.on_device`: True, False or "auto"), said in one log line.
    `dm` is an ImageDataModule (data/image_module.py): its settings, splits and device."""
    if not dm.can_reside or isinstance(dm.train_tf, image_views.ImageViews):  # (views cut per image: in workers)
        return False
    if dm.on_device is False:
        log.info("data.on_device=false: the loader's workers read the images, a batch at a time")
        return False
    device = dm.data_device
    why = per_image_only(dm.train_settings, dm.native_hw)
    if why is not None:
        if dm.on_device is True:
            raise UserError(
                f"data.on_device=true, but {why} runs per image, in the loader's workers (on the device: "
                "shift, hflip and random erasing); turn it off, or set data.on_device=auto"
            )
        log.info("data.on_device=auto: %s runs per image, so the loader's workers read the images", why)
        return False
    splits = {name: getattr(dm, f"{name}_set") for name in ("train", "val", "test")}
    count = {name: len(split) for name, split in splits.items() if split is not None}
    train_hw = dm.native_hw if dm.train_settings.shift else dm.img_hw
    pixels = count["train"] * math.prod(train_hw) + (sum(count.values()) - count["train"]) * math.prod(dm.img_hw)
    size = dm.channels * pixels  # bytes, as uint8
    shown = f"{size / 1e6:.1f} MB" if size < 1e9 else f"{size / 1e9:.1f} GB"
    if dm.on_device == "auto" and size > dm.on_device_gb * 1e9:
        log.info(
            "data.on_device=auto: the images take %s as uint8, over data.on_device_gb=%g, so the loader's workers "
            "read them (raise data.on_device_gb, or set data.on_device=true, to hold them on %s)",
            shown,
            dm.on_device_gb,
            device,
        )
        return False
    log.info(
        "data on %s: %s images as uint8 (%s), augmented there a batch at a time, no loader workers (data.on_device=%s)",
        device,
        ", ".join(f"{n:,} {name}" for name, n in count.items()),
        shown,
        str(dm.on_device).lower(),
    )
    return True


def store(dataset: TransformDataset, transform: T.Compose, device: torch.device, workers: int = 0) -> ResidentImages:
    """`dataset`'s images through `transform` (no random op: the same for every image, every epoch), stacked as
    uint8 on `device`, with their labels. Images in memory are transformed a chunk at a time; files are decoded by
    `workers` loader workers (once: training reads the tensors)."""
    images = labels = None
    done = 0
    for x, y in _chunks(dataset, transform, workers):
        if images is None:
            images = torch.empty((len(dataset), *x.shape[1:]), dtype=torch.uint8, device=device)
            labels = torch.empty((len(dataset), *torch.as_tensor(y).shape[1:]), dtype=torch.long, device=device)
        if x.shape[1:] != images.shape[1:]:
            raise UserError(
                f"data.on_device needs images of one size, and the training split has {tuple(images.shape[1:])} "
                f"and {tuple(x.shape[1:])}: set data.on_device=false"
            )
        images[done : done + len(x)], labels[done : done + len(x)] = x, y
        done += len(x)
    if images is None:
        raise RuntimeError("an empty split cannot be stored")
    return ResidentImages(images, labels)


def _chunks(dataset: TransformDataset, transform: T.Compose, workers: int) -> Iterator[tuple[torch.Tensor, Any]]:
    base = dataset.base
    if isinstance(base, ArrayImages):  # torchvision's transforms take a batch: each image as on its own
        for start in range(0, len(dataset), CHUNK):
            idx = torch.as_tensor(dataset.indices[start : start + CHUNK], dtype=torch.long)
            yield transform(base.images[idx]).as_subclass(torch.Tensor), base.labels[idx]
        return
    view = TransformDataset(base, transform, dataset.indices)
    init = {"worker_init_fn": init_worker} if workers else {}
    yield from DataLoader(view, batch_size=CHUNK, num_workers=workers, **init)
