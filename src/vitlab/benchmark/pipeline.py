"""benchmark.task=pipeline: the training loader alone, in images/s, against what decoding and cropping
cost. Three loaders over the same training images, with the same sampler, batch size, workers and
prefetch (vitlab.train's data config):

- `vitlab`: the datamodule's own train loader (uint8 batches; normalisation happens later, on the device), with
  `data.on_device=false` (data that fits is otherwise held on the device, with no loader workers to time);
- `float32_workers`: the same, plus what the workers did before uint8 batches: ToDtype(float32),
  Normalize and RandomErasing per image (the pipeline this one replaced, kept to measure against);
- `timm` (image folders, with random-resized-crop): timm's train.py loader on the same files, sampler, batch and
  workers: PIL decode, `timm.data.create_transform(is_training=True, use_prefetcher=True)` with the data config's
  crop scale, flip, colour jitter, grayscale, blur and timm policy, and train.py's default `random` interpolation
  (bilinear or bicubic, drawn per image), uint8 out, batched by `fast_collate` (its prefetcher normalises on the
  device, as `vitlab`'s batches are normalised there);
- `ceiling`: a bare loader that only decodes (torchvision's libjpeg-turbo for files) and applies the same
  random-resized-crop (or resize) and flip on uint8: no auto-augment, no checks, no fallbacks;
- `streaming` (with `benchmark.pipeline.shards`): the train loader of data=streaming over the same images
  packed by `python -m vitlab.pack`, with every other setting of the data config;
- `hf`, `list`, `wds` (with `benchmark.pipeline.readers=[hf=<saved dataset>,list=<csv>,wds=<pattern>]`): the train
  loader of data=hf, data=list, data=wds over the same images, with every other setting of the data config;
- `device_decode` (image files, where the data config allows data.decode=device): the datamodule's train loader
  with `data.decode=device`, each batch then decoded and augmented to uint8 on `benchmark.device` (nvjpeg on a GPU,
  libjpeg-turbo in this process on the CPU) as training does: the workers only read bytes and draw crops, and the
  device's share is counted (synchronised at the end of each pass);
- `vitlab[<policy>]` (with `benchmark.pipeline.policies`): the datamodule's train loader with
  `data.train_transform.auto_augment=<policy>` (timm's policy strings, torchvision's randaugment/trivialaugment),
  every other setting the same: what each augmentation policy costs the workers.

Each loader is iterated `rounds` times (alternating order; persistent workers, as in training), the
first `warmup_batches` of a round untimed. Ratios are each loader's images/s over the ceiling's.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2 as T

from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.measure import pick_device, sync
from vitlab.data import decoding, formats
from vitlab.data.seeded import TransformDataset
from vitlab.data.transforms import INTERPOLATIONS, TORCHVISION_AUGMENTS, TrainTransform
from vitlab.model.config import as_hw
from vitlab.training.run import build
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


class Ceiling(Dataset):
    """Decode and crop only: the least any loader of these images must do."""

    def __init__(self, data: TransformDataset, img_size, settings: TrainTransform):
        self.data, self.samples = data, getattr(data.base, "samples", None)  # ImageFolder: (path, label) pairs
        hw, mode = as_hw(img_size, "data.img_size"), INTERPOLATIONS[settings.interpolation]
        crop = (
            T.RandomResizedCrop(hw, scale=settings.random_resized_crop, interpolation=mode, antialias=True)
            if settings.random_resized_crop
            else T.Resize(hw, interpolation=mode, antialias=True)
        )
        self.augment = T.Compose([crop, T.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        from torchvision.io import ImageReadMode, decode_image

        index = self.data.indices[i]
        if self.samples is not None:
            path, label = self.samples[index]
            img = decode_image(path, ImageReadMode.RGB)
        else:
            img, label = self.data.base[index]
            img = T.functional.to_image(img)
        return self.augment(img), label


# data=<name> of benchmark.pipeline.readers -> its module and the key that says where the images are
READERS = formats.readers()


def reader_loader(dm, data: Mapping[str, Any], reader: str):
    """The train loader of `reader` (`<data=name>=<where>`) with the data settings' others."""
    kind, _, where = reader.partition("=")
    if kind not in READERS or not where:
        raise UserError(f"benchmark.pipeline.readers entry {reader!r} must be hf=<path>, list=<file> or wds=<pattern>")
    same = {k: v for k, v in data.items() if k not in ("check_images", "unlabeled", "data_dir", "val_fraction")}
    target, key = READERS[kind]  # (check_images ... val_fraction: a folder's settings)
    other = build.build_datamodule(same | {"_target_": target, key: where, "num_classes": dm.num_classes})
    other.setup("fit")
    return other.train_dataloader()


class TimmFolder(Dataset):
    """timm's ImageDataset of the training images, as train.py builds it: each file opened by PIL and converted to
    RGB, then timm's training transform (uint8 out, for its prefetcher). Takes the (seed, index) keys of vitlab's
    sampler and ignores the seed (timm draws from the worker's generators)."""

    def __init__(self, data: TransformDataset, transform):
        self.samples, self.indices, self.transform = data.base.samples, data.indices, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | tuple[int, int]):
        from PIL import Image

        path, label = self.samples[self.indices[key if isinstance(key, int) else key[1]]]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), label


def timm_loader(dm):
    """timm's train.py loader of `dm`'s training images (`TimmFolder`, `fast_collate`) with `dm`'s sampler, batch,
    workers and prefetch; None where timm has no equivalent (images not from files, no random-resized-crop)."""
    from timm.data import create_transform
    from timm.data.loader import fast_collate

    s = dm.train_settings
    if not hasattr(dm.train_set.base, "samples") or not s.random_resized_crop or s.shift:
        return None
    aa = s.auto_augment if s.auto_augment not in TORCHVISION_AUGMENTS else None
    tf = create_transform(
        tuple(dm.img_hw), is_training=True, use_prefetcher=True, scale=s.random_resized_crop, hflip=s.hflip,
        color_jitter=s.color_jitter, color_jitter_prob=s.color_jitter_prob if s.color_jitter else None,
        grayscale_prob=s.grayscale_prob, gaussian_blur_prob=s.gaussian_blur_prob, auto_augment=aa,
        interpolation="random", mean=dm.mean, std=dm.std,
    )  # fmt: skip
    return dm._loader(TimmFolder(dm.train_set, tf), train=True, collate_fn=fast_collate)


class DeviceDecoded:
    """data.decode=device's train loader with the device's work in it: each batch decoded and augmented to uint8 on
    `device` (decoding.augmented, as training's on_after_batch_transfer does before normalising)."""

    def __init__(self, dm, device: torch.device):
        self.dm, self.loader, self.device = dm, dm.train_dataloader(), device
        dm.placement = device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            batch = self.dm.transfer_batch_to_device(batch, self.device, 0)
            yield decoding.augmented(self.dm, batch, train=True), batch.labels


def device_loader(data: Mapping[str, Any], device: torch.device) -> DeviceDecoded | None:
    """The `device_decode` contender, or None (said in the log) where data.decode=device refuses the data config."""
    try:
        other = build.build_datamodule({**data, "decode": "device"})
        other.setup("fit")
        return DeviceDecoded(other, device)
    except UserError as e:
        log.info("no device_decode row: %s", e)
        return None


def loaders(
    dm, data: Mapping[str, Any], shards: str | None = None, policies: tuple[str, ...] = (),
    readers: tuple[str, ...] = (), device: torch.device | None = None,
) -> dict[str, Any]:  # fmt: skip
    train = dm.train_set
    settings = dm.train_settings
    before = [T.ToDtype(torch.float32, scale=True), T.Normalize(list(dm.mean), list(dm.std))]
    if settings.random_erasing:
        before.append(T.RandomErasing(settings.random_erasing, value=0))
    old = TransformDataset(train.base, T.Compose([dm.train_tf, *before]), train.indices)
    found = {
        "vitlab": dm.train_dataloader(),
        "float32_workers": dm._loader(old, train=True),
        "ceiling": dm._loader(Ceiling(train, dm.img_size, settings), train=True),
    }
    if (timm := timm_loader(dm)) is not None:
        found["timm"] = timm
    if device is not None and (decoded := device_loader(data, device)) is not None:
        found["device_decode"] = decoded
    if shards:
        # Without a folder's settings: the shards' images were all decoded when packed, and labelled by their class
        # folders.
        same = {k: v for k, v in data.items() if k not in ("check_images", "unlabeled")}
        streaming = build.build_datamodule(
            same | {"_target_": "vitlab.data.StreamingDataModule", "data_dir": shards, "num_classes": dm.num_classes}
        )
        streaming.setup("fit")
        if len(streaming.train_set) != len(train):
            raise UserError(
                f"benchmark.pipeline.shards {shards!r} hold {len(streaming.train_set)} training images, the data "
                f"{len(train)}: pack the same images (python -m vitlab.pack with the same data settings)"
            )
        found["streaming"] = streaming.train_dataloader()
    for reader in readers:
        found[reader.partition("=")[0]] = reader_loader(dm, data, reader)
    for policy in policies:
        augmented = {**(data.get("train_transform") or {}), "auto_augment": policy}
        other = build.build_datamodule({**data, "train_transform": augmented})
        other.setup("fit")
        found[f"vitlab[{policy}]"] = other.train_dataloader()
    return found


def time_loader(loader, warmup: int, batches: int) -> tuple[float, int]:
    """Seconds for `batches` batches after `warmup` untimed ones, and the images they held."""
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    images, start = 0, time.perf_counter()
    for _ in range(batches):
        images += len(next(it)[1])
    if isinstance(loader, DeviceDecoded):
        sync(loader.device)
    return time.perf_counter() - start, images


def bench_pipeline(plan: TrainPlan, b: BenchmarkConfig) -> dict[str, Any]:
    L.seed_everything(plan.seed, workers=True, verbose=False)
    data = {**plan.data, "on_device": False}  # the loader's workers are what is timed
    dm = build.build_datamodule(data)
    dm.setup("fit")
    contenders = loaders(dm, data, b.pipeline.shards, b.pipeline.policies, b.pipeline.readers, pick_device(b.device))
    p = b.pipeline
    need = p.warmup_batches + p.batches
    if len(contenders["vitlab"]) < need:
        raise UserError(
            f"benchmark.pipeline needs {need} batches (warmup_batches + batches) per pass, and the training set gives "
            f"{len(contenders['vitlab'])} of {dm.per_device_batch_size}: lower them or use more images"
        )
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(p.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, images = time_loader(contenders[name], p.warmup_batches, p.batches)
            rates[name].append(images / seconds)
            log.info("round %d %s: %.1f images/s", r, name, rates[name][-1])
    loader = contenders["vitlab"]
    first = next(iter(loader))[0]
    results = {
        name: {"images_per_s": statistics.median(v), "images_per_s_rounds": [round(x, 2) for x in v]}
        for name, v in rates.items()
    }
    ceiling = results["ceiling"]["images_per_s"]
    return {
        "loader": {
            "batch_size": dm.per_device_batch_size,
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers,
            "batch_dtype": str(first.dtype).removeprefix("torch."),
            "batch_shape": list(first.shape),
            "train_images": len(dm.train_set),
        },
        "results": results,
        "ratios": {f"{name}/ceiling": results[name]["images_per_s"] / ceiling for name in results if name != "ceiling"},
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=140)
    ld = report["loader"]
    table = Table(
        title=f"train loader, batch {ld['batch_size']}, {ld['num_workers']} workers ({ld['train_images']} images)"
    )
    for col in ("loader", "images/s (median)", "per round", "/ ceiling"):
        table.add_column(col)
    for name, r in report["results"].items():
        ratio = report["ratios"].get(f"{name}/ceiling")
        table.add_row(
            escape(name), f"{r['images_per_s']:.1f}", str(r["images_per_s_rounds"]), f"{ratio:.3f}" if ratio else ""
        )
    console.print(table)
