"""Any tree of images in class folders: data_dir/train/<class>/*.jpg and data_dir/val/<class>/*
(ImageNet's layout), and data_dir/test/ when there is one. val/ validates (selects the best checkpoint) and test/
tests; without test/, nothing is tested and the result is named val, or, with `data.val_fraction`, a held-out slice
of train validates and val/ is the test (big_vision's minival; `ImageDataModule._assign_splits`).

Every image is decoded by `data.images.read_image` to an upright uint8 RGB tensor, so grayscale,
palette, RGBA, CMYK, 16-bit and EXIF-rotated files mix with RGB ones, exactly as `vitlab.predict` will
read them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

from torchvision import datasets

from vitlab.data.folds import describe_splits
from vitlab.data.image_module import ImageDataModule
from vitlab.data.images import check_image_file, is_image_file, read_image
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)


def rgb_loader(path: str):
    """ImageFolder's loader: every file through the one decoder (`data.images.read_image`); a file that
    cannot be decoded stops the run naming it (silently skipping it would train on less data than the
    user believes)."""
    return read_image(path, channels=3)


class UnlabeledFolder(datasets.ImageFolder):
    """Every image under a folder, at any depth, all with label 0: one class named '' (the folder itself), which
    torchvision's walk of a class folder then covers whole."""

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        return [""], {"": 0}


def check_class_folders(data_dir: str, num_classes: int, unlabeled: bool = False) -> None:
    """data.num_classes against the class folders of data_dir/train (ImageFolder's classes), where there is one: when
    the module is built, and before, in the launching process (cli.node_checks.check_node), so that no run
    directory or DDP process exists to say it four times."""
    train = Path(data_dir) / "train"
    if unlabeled or not train.is_dir():
        return  # (a missing split is named when the data is set up)
    found = sum(1 for entry in os.scandir(train) if entry.is_dir())
    if found == 0:
        raise UserError(
            f"{data_dir}/train holds no class folders (expected {data_dir}/train/<class>/<image>; images without "
            "classes: data.unlabeled=true)"
        )
    if found != num_classes:
        raise UserError(f"data.num_classes {num_classes} does not match the {found} class folders in {data_dir}/train")


class ImageFolderDataModule(ImageDataModule):
    """`data=imagefolder`: `data_dir/{train,val}[/test]/<class>/<image>` (ImageNet's layout), the class folders
    checked against `num_classes`; `val_fraction` holds a seeded share of train/ out to validate on, `unlabeled`
    reads every image at any depth for pretraining without labels."""

    takes_folds = True  # data.folds=K data.fold=i (data/folds.py)

    channels = 3
    mean = (0.485, 0.456, 0.406)  # ImageNet
    std = (0.229, 0.224, 0.225)
    decodes_files = True

    def __init__(
        self,
        data_dir: str,
        num_classes: int,
        check_images: bool = True,
        val_fraction: float = 0.0,  # > 0: this share of train/ validates, and val/ tests when there is no test/
        split_seed: int = 0,
        unlabeled: bool = False,  # every image under train/ (val/, test/) at any depth, no classes: objective=mae
        **kwargs,
    ):
        check_class_folders(data_dir, num_classes, unlabeled)
        if num_classes < 1 and not unlabeled:
            raise UserError(f"data.num_classes {num_classes} must be >= 1")
        super().__init__(data_dir=data_dir, num_classes=num_classes, **kwargs)
        self.class_names: list[str] = []
        self.check_images, self.val_fraction, self.split_seed = check_images, val_fraction, split_seed
        self.unlabeled = unlabeled

    def _split(self, name: str) -> datasets.ImageFolder:
        path = Path(self.data_dir) / name
        if not path.is_dir():
            raise MissingFileError(
                f"image folder split {str(path)!r} does not exist "
                f"(expected {self.data_dir}/train/<class>/... and {self.data_dir}/val/<class>/...)"
            )
        try:
            kind = UnlabeledFolder if self.unlabeled else datasets.ImageFolder
            return kind(str(path), loader=rgb_loader, is_valid_file=is_image_file)
        except FileNotFoundError as e:  # an empty split or class folder
            raise MissingFileError(f"{path}: {e}") from None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if not Path(self.data_dir).is_dir():
            raise MissingFileError(f"data.data_dir {str(self.data_dir)!r} does not exist")
        train, val = self._split("train"), self._split("val")
        test = self._split("test") if (Path(self.data_dir) / "test").is_dir() else None
        for split in (val, test):
            if split is not None and split.classes != train.classes:
                raise UserError(_classes_differ(split.root, split.classes, train.root, train.classes))
        self.class_names = [] if self.unlabeled else list(train.classes)
        self._assign_splits(train, val, test, self.val_fraction, self.split_seed)
        self._check({"train": train, "val": val} | ({"test": test} if test is not None else {}))

    def _check(self, splits: dict[str, datasets.ImageFolder]) -> None:
        """Every image every split will read is checked before the first step (its header, and a PNG's end:
        `images.check_image_file`), so a bad file in test/ stops the run now, not after training; what the
        folders hold besides images is counted in the log line, not passed over in silence."""
        if self.check_images:  # one file after another, in this thread: no thread pool in a process that forks workers
            for split in splits.values():
                for path, _ in split.samples:
                    check_image_file(path)
        found = ", ".join(f"{len(split):,} {name}" for name, split in splits.items())
        others = Counter(
            Path(name).suffix.lower() or name
            for split in splits.values()
            for folder, _, names in os.walk(split.root)
            for name in names
            if not is_image_file(name)
        )
        skipped = (
            f"; skipped, not of a kind read: {', '.join(f'{n} {k}' for k, n in others.most_common())}" if others else ""
        )
        classes = "unlabeled" if self.unlabeled else f"in {len(self.class_names)} classes"
        log.info("%s: %s images %s%s", self.data_dir, found, classes, skipped)
        log.info("%s", describe_splits(self.splits))


def _classes_differ(root: str, classes: list[str], train_root: str, train_classes: list[str]) -> str:
    """The one line for a split whose class folders are not train's: which are missing and which are extra (both
    lists are sorted, ImageFolder's order, so differing lists differ as sets)."""
    missing, extra = sorted(set(train_classes) - set(classes)), sorted(set(classes) - set(train_classes))
    parts = [
        f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else "",
        f"not in train: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}" if extra else "",
    ]
    return f"class folders of {root} differ from those of {train_root} ({'; '.join(p for p in parts if p)})"
