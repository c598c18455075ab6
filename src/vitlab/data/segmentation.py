"""`data=segmentation`: images with a class mask each (one class index a pixel), for the segmentation probe
(vitlab.eval task=segmentation) and for pretraining on the same images.

Where the data comes from:
- no `data_dir`: the embedded default (data/canvas.py): digits pasted on canvases, class 0 background and d + 1 for
  digit d (11 classes), no download;
- ADE20k's layout (`layout: ade20k`, or found by `auto`): `images/{training,validation}/<name>.jpg` and
  `annotations/{training,validation}/<name>.png`; its label 0 is "other" and is ignored, the classes start at 1:
  `reduce_zero_label` (mmseg's name, on by default for this layout) makes 0 -> 255 (ignored) and k -> k - 1;
- VOC's (`layout: voc`): `JPEGImages/<id>.jpg`, `SegmentationClass/<id>.png` (palette PNGs read as indices) and the
  ids of `ImageSets/Segmentation/{train,val}.txt`; 255 (the objects' borders) is ignored.

Label 255 is ignored everywhere (mmseg's ignore_index). Every mask is checked before use (`check_images`): its name
against its image's, its size against its image's, its labels against `num_classes`; a mismatch is one line.

Two views of every split: `seg_view(split)` gives (image, mask) pairs, both resized and cropped alike (the image as
every dataset's eval transform does it; the mask with the same geometry, nearest neighbour, padding with 255); the
ImageDataModule's own splits give (image, label) for training (objective=dino on the images) and for k-NN, the label
of an image being the most frequent class of its mask other than `background` (its "main object").
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from vitlab.data import canvas
from vitlab.data.image_module import ImageDataModule
from vitlab.data.images import check_image_file, is_image_file, read_image
from vitlab.data.masks import IGNORE, MaskResizeCrop, image_label, read_mask
from vitlab.data.resident import ArrayImages
from vitlab.data.seeded import TransformDataset
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "ade20k", "voc")
# Where each layout keeps a split's images and masks (relative to data_dir); VOC names its split's ids in a file.
ADE20K = {"train": ("images/training", "annotations/training"), "val": ("images/validation", "annotations/validation")}
VOC = {"images": "JPEGImages", "masks": "SegmentationClass", "ids": "ImageSets/Segmentation/{split}.txt"}
# A folder's normalisation: ImageNet's, and for gray images (data.channels=1) the mean of its three channels.
IMAGENET = {3: ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), 1: ((0.449,), (0.226,))}


class MaskedFiles(Dataset):
    """(image path, mask path) pairs: items (uint8 image (C, H, W), uint8 mask (H, W)) through `pair`, and
    (image, image label) as a classification dataset's (`__getitem__`: training, k-NN)."""

    def __init__(self, pairs: list[tuple[Path, Path]], channels: int, reduce_zero_label: bool, background: int | None):
        self.pairs, self.channels = pairs, channels
        self.reduce_zero_label, self.background = reduce_zero_label, background

    def __len__(self) -> int:
        return len(self.pairs)

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.pairs[i]
        return read_image(image, self.channels), read_mask(mask, self.reduce_zero_label)

    def __getitem__(self, i: int):
        image, mask = self.pair(i)
        return image, image_label(mask, self.background)


class MaskedArrays(ArrayImages):
    """The embedded canvases in memory: uint8 images (N, C, S, S), masks (N, S, S), and their image labels."""

    def __init__(self, images: torch.Tensor, masks: torch.Tensor, background: int | None):
        super().__init__(images, torch.tensor([image_label(m, background) for m in masks]))
        self.masks = masks

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.masks[i]


class SegmentationView(Dataset):
    """`base`'s (image, mask) pairs at `indices`, resized and cropped together (`prepare`: data/masks.py)."""

    def __init__(self, base, indices: list[int], prepare: MaskResizeCrop):
        self.base, self.indices, self.prepare = base, list(indices), prepare

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.prepare(*self.base.pair(self.indices[i]))


class SegmentationDataModule(ImageDataModule):
    """`data=segmentation`: the embedded canvases, or an ADE20k or VOC folder (module docstring)."""

    eval_crop_pct = 1.0  # the whole image's shorter side to img_size, its centre: no labelled border cropped away

    def __init__(
        self,
        data_dir: str | None = None,
        num_classes: int = len(canvas.CLASS_NAMES),
        channels: int = 3,
        layout: str = "auto",
        reduce_zero_label: bool | None = None,  # None: the layout's (ADE20k: true; VOC and the canvases: false)
        background: int | None = 0,  # the class an image's label passes over when its mask holds others
        check_images: bool = True,
        canvas_size: int = 32,
        canvases: tuple[int, int, int] = (1024, 256, 256),  # the embedded train, val and test canvases
        split_seed: int = 0,
        mean=None,
        std=None,
        **kwargs,
    ):
        if layout not in LAYOUTS:
            raise UserError(f"data.layout {layout!r} is not one of {list(LAYOUTS)}")
        if channels not in (1, 3):
            raise UserError(f"data.channels {channels} must be 1 (gray) or 3 (RGB)")
        if not 1 <= num_classes <= IGNORE:
            raise UserError(f"data.num_classes {num_classes} must be from 1 to {IGNORE} (label {IGNORE} is ignored)")
        if data_dir is None and (len(canvases) != 3 or min(canvases) < 1 or canvas_size < 8):
            raise UserError(f"data.canvases {list(canvases)} must be 3 counts >= 1 and data.canvas_size >= 8")
        embedded = data_dir is None
        mean = mean if mean is not None else (canvas.MEAN[channels] if embedded else IMAGENET[channels][0])
        std = std if std is not None else (canvas.STD[channels] if embedded else IMAGENET[channels][1])
        super().__init__(data_dir=data_dir, num_classes=num_classes, channels=channels, mean=mean, std=std, **kwargs)
        self.layout = "embedded" if embedded else (find_layout(data_dir) if layout == "auto" else layout)
        self.reduce_zero_label = self.layout == "ade20k" if reduce_zero_label is None else reduce_zero_label
        self.background, self.check_images = background, check_images
        self.canvas_size, self.canvases, self.split_seed = canvas_size, tuple(canvases), split_seed
        self.class_names = canvas.CLASS_NAMES if embedded else []
        if embedded and num_classes != len(canvas.CLASS_NAMES):
            raise UserError(f"data.num_classes {num_classes}: the embedded canvases have 11 (background and 10 digits)")
        self.bases: dict[str, Dataset] = {}
        self.decodes_files = not embedded  # a folder's images are decoded by the loader's workers
        self.native_hw = (canvas_size, canvas_size) if embedded else None
        self.prepare = MaskResizeCrop(self.img_hw, self.eval_settings, self.mean)

    @property
    def identity(self) -> dict:
        """What decides the masks and images a split holds (the features cache's key, beside the weights), as JSON
        gives it back (lists, not tuples: the cache compares it with the JSON it wrote)."""
        where = (
            {"data_dir": str(Path(self.data_dir).resolve())}
            if self.data_dir
            else {"canvases": list(self.canvases), "canvas_size": self.canvas_size, "split_seed": self.split_seed}
        )
        return where | {"layout": self.layout, "reduce_zero_label": self.reduce_zero_label,
                        "img_size": list(self.img_hw), "channels": self.channels, "mean": list(self.mean),
                        "std": list(self.std), "eval": dict(self.eval_settings)}  # fmt: skip

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.layout == "embedded":
            for split, count in zip(canvas.SPLITS, self.canvases, strict=True):
                images, masks = canvas.make_split(split, count, self.canvas_size, self.channels, self.split_seed)
                self.bases[split] = MaskedArrays(images, masks, self.background)
            self.splits = {
                s: f"{n:,} canvases (split_seed {self.split_seed})"
                for s, n in zip(canvas.SPLITS, self.canvases, strict=True)
            }
        else:
            if not Path(self.data_dir).is_dir():
                raise MissingFileError(f"data.data_dir {str(self.data_dir)!r} does not exist")
            for split in ("train", "val"):
                pairs = (
                    ade20k_pairs(self.data_dir, split) if self.layout == "ade20k" else voc_pairs(self.data_dir, split)
                )
                self.bases[split] = MaskedFiles(pairs, self.channels, self.reduce_zero_label, self.background)
            self.splits = {"train": f"{self.layout} train", "val": f"{self.layout} val"}
            if self.check_images:
                for base in self.bases.values():
                    check_pairs(base, self.num_classes)
        self.train_set = TransformDataset(self.bases["train"], self.train_tf)
        self.val_set = TransformDataset(self.bases["val"], self.eval_tf)
        self.test_set = TransformDataset(self.bases["test"], self.eval_tf) if "test" in self.bases else None
        log.info(
            "%s: %s", self.data_dir or "embedded canvases", ", ".join(f"{len(b):,} {s}" for s, b in self.bases.items())
        )

    def seg_view(self, split: str) -> SegmentationView:
        """`split`'s (uint8 image (C, H, W), uint8 mask (H, W)) pairs at img_size, as evaluation prepares them."""
        self.setup("test")
        if split not in self.bases:
            raise UserError(f"the data has no {split} split")
        base = self.bases[split]
        return SegmentationView(base, range(len(base)), self.prepare)


def find_layout(data_dir: str) -> str:
    """ADE20k's or VOC's, by the folders data_dir holds; neither is one line naming both."""
    root = Path(data_dir)
    if (root / "images").is_dir() and (root / "annotations").is_dir():
        return "ade20k"
    if (root / VOC["images"]).is_dir() and (root / VOC["masks"]).is_dir():
        return "voc"
    if not root.is_dir():
        raise MissingFileError(f"data.data_dir {str(data_dir)!r} does not exist")
    raise UserError(
        f"data.data_dir {str(data_dir)!r} is neither ADE20k's layout (images/training, annotations/training, ...) nor "
        "VOC's (JPEGImages, SegmentationClass, ImageSets/Segmentation/train.txt)"
    )


def ade20k_pairs(data_dir: str, split: str) -> list[tuple[Path, Path]]:
    """The (image, mask) files of ADE20k's `split`, paired by name; an image without its mask, or a mask without its
    image, is one line naming the first of each."""
    images_dir, masks_dir = (Path(data_dir) / d for d in ADE20K[split])
    for folder in (images_dir, masks_dir):
        if not folder.is_dir():
            raise MissingFileError(f"segmentation split folder {str(folder)!r} does not exist")
    images = {p.stem: p for p in sorted(images_dir.iterdir()) if is_image_file(p)}
    masks = {p.stem: p for p in sorted(masks_dir.iterdir()) if p.suffix.lower() == ".png"}
    unmasked, orphans = sorted(images.keys() - masks.keys()), sorted(masks.keys() - images.keys())
    if unmasked or orphans:
        parts = []
        if unmasked:
            parts.append(f"{len(unmasked)} images without a mask (first: {images[unmasked[0]].name})")
        if orphans:
            parts.append(f"{len(orphans)} masks without an image (first: {masks[orphans[0]].name})")
        raise UserError(f"the masks of {masks_dir} do not match the images of {images_dir} by name: {'; '.join(parts)}")
    if not images:
        raise MissingFileError(f"segmentation split folder {str(images_dir)!r} holds no images")
    return [(images[k], masks[k]) for k in sorted(images)]


def voc_pairs(data_dir: str, split: str) -> list[tuple[Path, Path]]:
    """The (image, mask) files of the ids VOC's ImageSets/Segmentation/<split>.txt lists; a listed id without its
    image or mask is one line naming it."""
    root = Path(data_dir)
    ids_file = root / VOC["ids"].format(split=split)
    if not ids_file.is_file():
        raise MissingFileError(f"VOC split file {str(ids_file)!r} does not exist")
    ids = [line.strip() for line in ids_file.read_text().splitlines() if line.strip()]
    pairs = [(root / VOC["images"] / f"{i}.jpg", root / VOC["masks"] / f"{i}.png") for i in ids]
    for image, mask in pairs:
        for path in (image, mask):
            if not path.is_file():
                raise UserError(
                    f"{ids_file} lists {image.stem}, but {path} does not exist (masks must match the images)"
                )
    if not pairs:
        raise MissingFileError(f"VOC split file {str(ids_file)!r} lists no images")
    return pairs


def check_pairs(base: MaskedFiles, num_classes: int) -> None:
    """Each image's header, each mask's size against its image's and its labels against `num_classes` (255, ignored,
    aside): the first mismatch is one line naming the files."""
    for image, mask in base.pairs:
        check_image_file(image)
        with Image.open(image) as img:
            image_size = img.size
        labels = read_mask(mask, base.reduce_zero_label)
        if tuple(labels.shape[::-1]) != image_size:
            raise UserError(
                f"mask {str(mask)!r} is {labels.shape[1]}x{labels.shape[0]} pixels but its image {str(image)!r} is "
                f"{image_size[0]}x{image_size[1]}: a mask must have its image's size"
            )
        found = np.unique(labels.numpy())
        above = found[(found >= num_classes) & (found != IGNORE)]
        if len(above):
            shifted = " (after data.reduce_zero_label's shift by -1)" if base.reduce_zero_label else ""
            raise UserError(
                f"mask {str(mask)!r} holds label {int(above[-1])}{shifted}, above data.num_classes {num_classes} "
                f"(labels 0..{num_classes - 1}, {IGNORE} ignored): set data.num_classes to the data's class count"
            )
