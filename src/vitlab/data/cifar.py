"""CIFAR-10 and CIFAR-100 through torchvision: downloaded once into data_dir when online, read from
there afterwards, and a clear error when neither works. Validation is a fixed hold-out of the
training set (`val_size` images); the official test set is the test split. torchvision reads the images into one
array, kept as a uint8 tensor (184 MB for the 60,000): held on the training device by default (`data.on_device`),
or read through the loader's workers."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision import datasets

from vitlab.data.folds import held_out
from vitlab.data.image_module import ImageDataModule
from vitlab.data.resident import ArrayImages
from vitlab.data.seeded import TransformDataset
from vitlab.utils.downloads import downloading
from vitlab.utils.errors import MissingFileError, UserError


class CIFAR10DataModule(ImageDataModule):
    """`data=cifar10`: CIFAR-10's 50,000 training images less `val_size` held out (seeded by `split_seed`) for
    validation, and its 10,000 test images; downloaded into `data_dir` once when online."""

    num_classes = 10
    channels = 3
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    eval_crop_pct = 1.0  # 32-px images: resized whole, no crop
    native_hw = (32, 32)
    dataset_cls = datasets.CIFAR10
    label = "CIFAR-10"

    def __init__(
        self, data_dir: str = "data", val_size: int = 5000, split_seed: int = 0, download: bool = True, **kwargs
    ):
        super().__init__(data_dir=data_dir, **kwargs)
        if not 0 < val_size < 50_000:
            raise UserError(f"data.val_size {val_size} must be in (0, 50000)")
        self.val_size, self.split_seed, self.download = val_size, split_seed, download
        self.class_names: list[str] = []  # read from the dataset in setup()

    def _open(self, train: bool):
        root = Path(self.data_dir)
        try:
            return self.dataset_cls(root, train=train, download=False)
        except RuntimeError:  # not there (or corrupt): torchvision says "Dataset not found or corrupted"
            if not self.download:
                raise MissingFileError(
                    f"{self.label} not found under data.data_dir={str(root)!r} and data.download=false"
                ) from None
        made = [p for p in (root, *root.parents) if not p.exists()]  # the folders torchvision's download makes
        try:
            with downloading(
                f"{self.label} not found under data.data_dir={str(root)!r} and the download failed (no network); "
                "download it once online or copy the extracted dataset there"
            ):
                return self.dataset_cls(root, train=train, download=True)
        except BaseException:
            for folder in made:  # deepest first; one holding a partial download is left for the next try
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            raise

    def prepare_data(self) -> None:  # rank 0 only: download before the other ranks read
        self._open(train=True)
        self._open(train=False)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        opened = self._open(train=True)
        self.class_names = list(opened.classes)
        train_full, test = _arrays(opened), _arrays(self._open(train=False))
        kept, held = held_out(len(train_full), self.val_size, self.split_seed)
        self.train_set = TransformDataset(train_full, self.train_tf, kept)
        self.val_set = TransformDataset(train_full, self.eval_tf, held)
        self.splits = {
            "train": f"the training set less {self.val_size:,} images",
            "val": f"{self.val_size:,} images of the training set held out (split_seed {self.split_seed})",
            "test": f"{self.label}'s test set",
        }
        self.test_set = TransformDataset(test, self.eval_tf)


class CIFAR100DataModule(CIFAR10DataModule):
    """`data=cifar100`: CIFAR-100, split as CIFAR-10 is."""

    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    dataset_cls = datasets.CIFAR100
    label = "CIFAR-100"


def _arrays(dataset: datasets.CIFAR10) -> ArrayImages:
    """torchvision's CIFAR as uint8 (N, 3, 32, 32) and its labels: the images its items would give, without a
    PIL image each."""
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return ArrayImages(images, torch.as_tensor(dataset.targets, dtype=torch.long))
