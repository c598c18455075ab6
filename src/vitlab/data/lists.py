"""Lists of images (`data=list`, timm's `--dataset` of an image-and-label file): a CSV with a header, or JSON Lines,
one image a row, its path (relative to the list's own folder, or absolute) and its label (a class index, or a class
name: the names sorted are the classes, as an image folder's). `data.train_file`, with `data.val_file` and
`data.test_file` where there are such lists (no val_file: a slice of train validates, data/records.py). Several
labels an image (`objective.multilabel=true`): a label cell of names separated by `;`, a JSON list, or a 0/1 column
per class (`data.label_format`, data/multilabels.py); each image's label is then a multi-hot (num_classes,) vector.

Every image is read by `data.images.read_image`, as an image folder's are: the same files give the same pixels.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from vitlab.data.images import read_image
from vitlab.data.indexes import list_labels
from vitlab.data.multilabels import class_counts
from vitlab.data.records import RecordsDataModule

log = logging.getLogger(__name__)


class ListedImages(Dataset):
    """A list's images and labels: class indices, or (several labels an image) an int64 (N, classes) multi-hot."""

    def __init__(self, paths: list[str], labels: list[int] | torch.Tensor, channels: int = 3):
        self.paths, self.labels, self.channels = paths, labels, channels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return read_image(self.paths[i], self.channels), self.labels[i]

    def encoded(self, i: int) -> tuple[bytes, str, int]:
        """The file's bytes, its name, its label (data.decode=device: decoded on the device, data/decoding.py)."""
        return Path(self.paths[i]).read_bytes(), self.paths[i], self.labels[i]


class ListDataModule(RecordsDataModule):
    takes_folds = True  # data.folds=K data.fold=i (data/folds.py)
    decodes_files = True

    def __init__(
        self,
        train_file: str,
        num_classes: int,
        val_file: str | None = None,  # null: a slice of train validates (data.val_fraction, 10% when null)
        test_file: str | None = None,  # null: nothing is tested
        image_key: str = "path",
        label_key: str = "label",
        multilabel: bool = False,  # several labels an image (objective.multilabel): data/multilabels.py
        label_format: str = "names",  # names (a cell of ;-separated names, a JSON list) | columns (0/1 per class)
        **kwargs: Any,
    ):
        super().__init__(num_classes=num_classes, data_dir=str(Path(train_file).parent), **kwargs)
        self.files = {"train": train_file, "val": val_file, "test": test_file}
        self.image_key, self.label_key = image_key, label_key
        self.multilabel, self.label_format = bool(multilabel), label_format

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        made, names = {}, None
        for role, file in self.files.items():
            if file is None:
                continue
            paths, labels, names = list_labels(
                str(file), self.image_key, self.label_key, self.multilabel, self.label_format, names
            )
            if role == "train":
                self.class_counts = class_counts(labels, names)  # the run's metrics.json
            made[role] = ListedImages(paths, multi_hot(labels, names) if self.multilabel else labels, self.channels)
        self._check_classes(names, str(self.files["train"]))
        log.info("%s images in %d classes", ", ".join(f"{len(d):,} {r}" for r, d in made.items()), len(names))
        where = {role: str(file) for role, file in self.files.items() if file is not None}
        self._set_map_splits(made["train"], made.get("val"), made.get("test"), where)


def multi_hot(labels: list[list[int]], names: list[str]) -> torch.Tensor:
    """Each image's class indices as an int64 (N, classes) 0/1 matrix (the loss and the metrics read it)."""
    out = torch.zeros(len(labels), len(names), dtype=torch.long)
    for row, indices in enumerate(labels):
        out[row, indices] = 1
    return out
