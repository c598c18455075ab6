"""`data.decode=device`: the loader's workers read each image's encoded bytes and draw its random augmentation, and
the training device decodes and augments the whole batch (nvjpeg on a GPU, libjpeg-turbo on the CPU).

Worker side (`EncodedImages`, a TransformDataset): an image's file bytes, its header (size after EXIF orientation,
whether the device decoder takes it) and, in training, the draws of the per-image pipeline (`train_transform`'s
random-resized-crop box, flip, colour jitter's order and factors, grayscale, blur's sigma) made by the pipeline's own
ops from the same seeded generators (`seeded.seeded`), so the boxes and choices are the worker path's for the same
seed, sampler and epoch: a mid-epoch resume and the DDP share-out are the square path's.

Device side (`decode_batch`, `train_batch`, `eval_batch`): `torchvision.io.decode_jpeg` on the batch's list of
JPEGs (device=the model's); per image through `images.decode_image` (the worker path's decoder) for what the device
decoder does not take: files that are not JPEG, CMYK and grayscale JPEGs, and JPEGs with an EXIF orientation (nvjpeg
ignores it). Then each image is cropped and resized (antialiased, torchvision's resized_crop, the worker path's own
kernel), and the batch is flipped, colour-jittered (the arithmetic of transforms.ColorJitter, per-image factors
broadcast), grayed and blurred; it leaves as uint8 for `transforms.DeviceTransform` (normalisation, random erasing).
On the CPU both decoders are libjpeg-turbo and the kernels are the worker path's: the training pixels are the same.

What has no batched tensor version here is refused in one line (`check`): shift, simple_crop, auto_augment, NaFlex,
objective=dino's views, several training sizes, streamed splits, images held decoded in memory.
No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2 as T

from vitlab.data import crop_modes, images, transforms
from vitlab.data.seeded import TransformDataset, seeded
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

DECODES = ("workers", "device")
# An image's record, float64 (exact for the integers it holds); NaN: a factor colour jitter does not draw.
H, W, ON_DEVICE, TOP, LEFT, BOX_H, BOX_W, FLIP, JITTER = range(9)
ORDER = slice(9, 13)  # colour jitter's random order of its 4 adjustments (torch.randperm(4))
FACTORS = slice(13, 17)  # brightness, contrast, saturation, hue
GRAY, BLUR, SIGMA = 17, 18, 19
FIELDS = 20
EVAL_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # the PIL filters torchvision's tensor resize has


class EncodedBatch(NamedTuple):
    """A batch as the workers leave it: each image's encoded bytes (uint8, on the host), their (B, FIELDS) records,
    labels, names (for errors)."""

    data: list[torch.Tensor]
    records: torch.Tensor
    labels: torch.Tensor
    names: list[str]


def collate(items: list[tuple]) -> EncodedBatch:
    data, records, labels, names = zip(*items, strict=True)
    labels = torch.stack(labels) if isinstance(labels[0], torch.Tensor) else torch.as_tensor(labels)  # (multi-hot)
    return EncodedBatch(list(data), torch.stack(records), labels, list(names))


def encoded(base: Any, i: int) -> tuple[bytes, str, int]:
    """Item `i` of a split's reader as (file bytes, name, label): an image folder's file, a list's, a Hugging Face
    dataset's Image cell, a shard's item (each reader's `encoded`)."""
    if hasattr(base, "encoded"):
        return base.encoded(i)
    path, label = base.samples[i]
    return Path(path).read_bytes(), str(path), label


def check(dm: Any, decode: str) -> str:
    """`decode` (data.decode), checked: a one-line refusal of what data.decode=device cannot do for the datamodule
    `dm` (an ImageDataModule)."""
    if decode not in DECODES:
        raise UserError(f"data.decode {decode!r} is not one of {list(DECODES)}")
    why = None
    s = dm.train_settings
    if dm.views is not None:
        why = "objective=dino's views are cut per image (multi-crop is not ported to the device)"
    elif dm.size_schedule is not None:  # several sizes, or NaFlex's lengths (data/sizes.py, data/naflex.py)
        why = dm.size_schedule.not_on_device
    elif s.shift or s.simple_crop or s.auto_augment is not None:
        name, value = next((n, getattr(s, n)) for n in ("shift", "simple_crop", "auto_augment") if getattr(s, n))
        why = f"data.train_transform.{name}={value} has no batched tensor version here"
    elif dm.eval_settings.get("interpolation", "bicubic") not in EVAL_INTERPOLATIONS:
        why = f"data.eval_transform.interpolation={dm.eval_settings['interpolation']} is a PIL filter torchvision lacks"
    elif dm.channels != 3:
        why = f"data.channels={dm.channels}: the device decoder makes RGB"
    elif dm.on_device is True:
        why = "data.on_device=true holds the images decoded already"
    if why is not None and decode == "device":
        raise UserError(f"data.decode=device: {why}; set data.decode=workers")
    return decode


def check_split(dataset: Any) -> None:
    base = getattr(dataset, "base", None)
    if base is None or not (hasattr(base, "encoded") or hasattr(base, "samples")):
        raise UserError(
            f"data.decode=device reads encoded image files (image folders, lists, Hugging Face datasets, shards), and "
            f"{type(base if base is not None else dataset).__name__} holds its images decoded or streams them; set "
            "data.decode=workers"
        )


class EncodedImages(TransformDataset):
    """A split as (bytes, record, label, name): `transform` (the split's per-image pipeline) is not run, only its
    random draws (training: handed (seed, index) keys by the same samplers)."""

    def __init__(self, split: TransformDataset, train: bool):
        super().__init__(split.base, split.transform, split.indices)
        self.train = train

    def get(self, key: int | tuple[int, int], transform):
        i = key if isinstance(key, int) else key[1]
        data, name, label = encoded(self.base, self.indices[i])
        hw, on_device = header(data, name)
        record = torch.full((FIELDS,), math.nan, dtype=torch.float64)
        record[H], record[W], record[ON_DEVICE] = hw[0], hw[1], on_device
        if self.train:
            draws = draw if isinstance(key, int) else lambda r: seeded(key[0], draw, r)
            draws((record, transform.transforms))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), record, label, name


def header(data: bytes, name: str) -> tuple[tuple[int, int], bool]:
    """The (height, width) the decoded image will have (EXIF orientation applied) and whether the device decoder
    takes it (an RGB JPEG without orientation), from the header alone."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            turn = img.getexif().get(0x0112, 1)
            mode, kind = img.mode, img.format
    except (OSError, ValueError, SyntaxError):  # (the decoder names the file and its problem)
        images.decode_image(data, name)
        raise
    if turn in (5, 6, 7, 8):
        h, w = w, h
    return (h, w), kind == "JPEG" and mode == "RGB" and turn in (1, None)


def draw(state: tuple[torch.Tensor, Sequence]) -> None:
    """The draws `ops` (a train_transform's ops) make for an image, in their order, by the ops' own code, written into
    `record`; the image is a stand-in of its size (no pixels)."""
    record, ops = state
    fake = [tv_tensors.Image(torch.empty((), dtype=torch.uint8).expand(3, int(record[H]), int(record[W])))]
    record[TOP], record[LEFT], record[BOX_H], record[BOX_W] = 0, 0, record[H], record[W]
    record[FLIP] = record[JITTER] = record[GRAY] = record[BLUR] = 0
    for op in ops:
        if isinstance(op, T.RandomResizedCrop):
            p = op.make_params(fake)
            record[TOP], record[LEFT], record[BOX_H], record[BOX_W] = p["top"], p["left"], p["height"], p["width"]
        elif isinstance(op, (T.RandomHorizontalFlip, T.RandomGrayscale)):
            applied = not bool(torch.rand(1) >= op.p)  # (_RandomApplyTransform.forward's draw)
            record[FLIP if isinstance(op, T.RandomHorizontalFlip) else GRAY] = applied
        elif isinstance(op, T.RandomApply):
            if torch.rand(1) >= op.p:  # (RandomApply.forward's draw)
                continue
            inner = op.transforms[0]
            p = inner.make_params(fake)
            if isinstance(inner, T.ColorJitter):
                record[JITTER], record[ORDER] = 1, p["fn_idx"].to(torch.float64)
                keys = ("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")
                record[FACTORS] = torch.tensor([math.nan if p[k] is None else p[k] for k in keys])
            else:  # GaussianBlur
                record[BLUR], record[SIGMA] = 1, p["sigma"][0]
        elif not isinstance(op, (T.ToImage, transforms._ResizeIfNeeded)):
            raise RuntimeError(f"no device version of {op!r}")  # (check() refuses such settings first)


def decode_batch(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
    """Each image of the batch as uint8 (3, H, W) on `device`: the device decoder's JPEGs in one call, the rest (and
    a batch the decoder fails on) through the worker path's decoder, one by one."""
    out: list[torch.Tensor | None] = [None] * len(batch.data)
    jpegs = [i for i, flag in enumerate(batch.records[:, ON_DEVICE].tolist()) if flag == 1]
    if jpegs:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            decoded = decode_jpeg([batch.data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            for i, img in zip(jpegs, decoded, strict=True):
                out[i] = img
        except RuntimeError:  # a file the decoder refuses: the worker path's decoder decodes it or names it
            pass
    for i, img in enumerate(out):
        if img is None:
            data = batch.data[i].numpy().tobytes()
            out[i] = images.decode_image(data, batch.names[i]).to(device, non_blocking=True)
    return out


def train_batch(
    decoded: list[torch.Tensor], records: torch.Tensor, hw: tuple[int, int], interpolation: str
) -> torch.Tensor:
    """The training pipeline of the worker path on the batch: crop and resize each image to `hw` (the worker path's
    kernel), then flip, colour jitter, grayscale and blur the batch as the records say; uint8 (B, 3, *hw)."""
    mode = transforms.INTERPOLATIONS[interpolation]
    boxes = records[:, [TOP, LEFT, BOX_H, BOX_W]].long().tolist()
    x = torch.stack([
        T.functional.resized_crop(img, t, l, h, w, list(hw), interpolation=mode, antialias=True)
        if (h, w) != tuple(img.shape[-2:]) or (h, w) != hw else img
        for img, (t, l, h, w) in zip(decoded, boxes, strict=True)
    ])  # fmt: skip
    device = x.device
    flip = records[:, FLIP].to(torch.bool).to(device, non_blocking=True)
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if bool(records[:, JITTER].any()) or bool(records[:, GRAY].any()):
        x = jitter(x.to(torch.float32), records)
        gray = records[:, GRAY].to(torch.bool)
        if bool(gray.any()):
            g = transforms._gray(x).trunc_().expand_as(x)
            x = torch.where(gray.to(device)[:, None, None, None], g, x)
        x = x.to(torch.uint8)
    for i in records[:, BLUR].nonzero().flatten().tolist():
        s = float(records[i, SIGMA])
        x[i] = T.functional.gaussian_blur(x[i], kernel_size=[23, 23], sigma=[s, s])
    return x


def jitter(x: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """transforms.ColorJitter's arithmetic on a float32 batch of uint8 values: step k applies each image's k-th
    adjustment with its factor, the other images' factor 1 (an identity: x * 1 + mean * 0, clamped, truncated)."""
    B, device = len(x), x.device
    on = records[:, JITTER] == 1
    factors = records[:, FACTORS]
    for k in range(4):
        op = records[:, ORDER][:, k]
        for fn in range(3):
            f = torch.where(on & (op == fn) & ~factors[:, fn].isnan(), factors[:, fn], 1.0)
            if bool((f == 1.0).all()):
                continue
            # (1 - f) in float64 and addcmul, as the worker path's add_(y, alpha=1.0 - factor) (fused: a separate
            # multiply and add differ by an ulp, a level after the truncation)
            f, g = (v.to(torch.float32).to(device, non_blocking=True).view(B, 1, 1, 1) for v in (f, 1.0 - f))
            if fn == 0:
                x = x.mul(f).clamp_(0, 255).trunc_()
            elif fn == 1:
                mean = transforms._gray(x).floor_().mean(dim=(-3, -2, -1), keepdim=True)
                x = x.mul(f).addcmul_(mean, g).clamp_(0, 255).trunc_()
            else:
                x = x.mul(f).addcmul_(transforms._gray(x).floor_(), g).clamp_(0, 255).trunc_()
        for i in (on & (op == 3) & ~factors[:, 3].isnan()).nonzero().flatten().tolist():
            x[i] = T.functional.adjust_hue(x[i].to(torch.uint8), float(factors[i, 3])).to(torch.float32)
    return x


def eval_batch(decoded: list[torch.Tensor], resize_crop: crop_modes.ResizeCrop) -> torch.Tensor:
    """Evaluation's resize and crop (crop_modes.ResizeCrop's geometry) of each image on its device: the resize by
    torchvision on float32 (antialiased; the worker path resizes in PIL: within a level or so, tests say how close),
    rounded to uint8; uint8 (B, 3, *hw)."""
    rc, out = resize_crop, []
    mode = transforms.INTERPOLATIONS[rc.interpolation]
    for img in decoded:
        size = crop_modes.resized_hw(tuple(img.shape[-2:]), rc.hw, rc.crop_pct, rc.crop_mode)
        if size != tuple(img.shape[-2:]):
            resized = T.functional.resize(img.to(torch.float32), list(size), interpolation=mode, antialias=True)
            img = resized.round_().clamp_(0, 255).to(torch.uint8)
        if rc.crop_mode == "border":
            img = crop_modes.center_crop_or_pad(img, rc.hw, rc.fill)
        elif tuple(img.shape[-2:]) != rc.hw:
            img = T.functional.center_crop(img, list(rc.hw))
        out.append(img)
    return torch.stack(out)


def served(dm: Any, split: str, dataset: TransformDataset) -> EncodedImages:
    """`split` of the datamodule `dm` as its loader reads it under data.decode=device (made once; the start-up line
    says the path when the training split is first asked for)."""
    made = dm.__dict__.setdefault("_encoded", {})
    if split not in made:
        check_split(dataset)
        made[split] = EncodedImages(dataset, train=split == "train")
        if split == "train":
            where = dm.data_device
            decoder = "nvjpeg" if where.type == "cuda" else "libjpeg-turbo"
            log.info(
                "data.decode=device: the loader's workers read each image's bytes and draw its crop; %s decodes each "
                "batch (%s; other files through the workers' decoder, one by one) and augments it there",
                where, decoder,
            )  # fmt: skip
    return made[split]


def augmented(dm: Any, batch: EncodedBatch, train: bool) -> torch.Tensor:
    """The uint8 (B, 3, H, W) batch the worker path would have made of `batch` (on the labels' device)."""
    decoded = decode_batch(batch, batch.labels.device)
    if train:
        return train_batch(decoded, batch.records, dm.img_hw, dm.train_settings.interpolation)
    return eval_batch(decoded, dm.eval_tf.transforms[-1])
