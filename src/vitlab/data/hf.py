"""Hugging Face datasets (`data=hf`, timm's `--dataset hfds/<name>`, with `data.streaming=true` its `hfids/<name>`):
`data.name` is a Hub id (`load_dataset`), a folder `Dataset.save_to_disk` wrote (`load_from_disk`), or a folder of
parquet (or other data) files (`load_dataset(<folder>)`).

The image and label columns are found where that is unambiguous (an `Image` feature, or a column named image / img;
a `ClassLabel`, or label / labels / fine_label) and named with `data.image_key` / `data.label_key` where not. The class
names are the `ClassLabel`'s, else the labels' own (integers, or class names sorted). Images are read as the bytes
stored (the Image feature undecoded) and decoded in the loader workers by `data.images.decode_image`, as an image
folder's files are: the same file gives the same pixels either way.

Without streaming, a split is a map-style dataset (memory-mapped Arrow): it trains as an image folder does. With
`data.streaming=true` it is read as an iterable dataset, its shards dealt out to processes and workers
(data/streamed.py), `data.num_train` samples an epoch (the split's size where the dataset says it).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from vitlab.data.images import decode_image
from vitlab.data.indexes import (
    SIZES,
    class_names,
    columns,
    hf_multilabels,
    hf_streamed_multilabels,
    label_indices,
    load,
    pick,
)
from vitlab.data.lists import multi_hot
from vitlab.data.multilabels import class_counts, column_labels, multilabel_indices
from vitlab.data.records import RecordsDataModule
from vitlab.data.streamed import StreamedSplit
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

VAL_SPLITS = ("validation", "val", "valid")


class HFImages(Dataset):
    """A split of a map-style Hugging Face dataset as (uint8 image, label): the image's stored bytes decoded here
    (in a loader worker), labels read once."""

    def __init__(self, split: Any, image_key: str, labels: list[int], where: str, channels: int = 3):
        import datasets

        undecoded = split.cast_column(image_key, datasets.Image(decode=False))
        self.table = undecoded.select_columns([image_key])
        self.key, self.labels, self.where, self.channels = image_key, labels, where, channels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        name = f"{self.where} row {i}"
        return decode_image(image_bytes(self.table[i][self.key], name), name, self.channels), self.labels[i]

    def encoded(self, i: int) -> tuple[bytes, str, int]:
        """The stored image's bytes, its name, its label (data.decode=device: decoded on the device)."""
        name = f"{self.where} row {i}"
        return image_bytes(self.table[i][self.key], name), name, self.labels[i]


def image_bytes(value: Any, name: str) -> bytes:
    """An image cell's bytes: an undecoded Image ({bytes, path}) or plain bytes."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict) and value.get("bytes"):
        return value["bytes"]
    if isinstance(value, dict) and value.get("path"):
        return Path(value["path"]).read_bytes()
    raise UserError(f"{name} holds no image ({type(value).__name__}); name the image column with data.image_key")


class HFStream:
    """A split of an iterable Hugging Face dataset as a data/streamed.py Source: its shards, (name, bytes, label).
    With several labels a row (`multilabel`: the label columns, a list column or 0/1 columns, of the classes `names`)
    a label is the row's multi-hot vector, as a map-style split's (data/lists.py multi_hot)."""

    def __init__(self, split: Any, image_key: str, label_key: str, names: list[str] | None, where: str,
                 multilabel: list[str] | None = None):  # fmt: skip
        import datasets

        self.keys = multilabel or [label_key]
        self.split = split.cast_column(image_key, datasets.Image(decode=False)).select_columns([image_key, *self.keys])
        self.n_shards, self.image_key, self.where = split.num_shards, image_key, where
        self.names, self.multilabel = names, multilabel is not None
        self.index = {n: i for i, n in enumerate(names)} if names else None

    def read(self, shard: int):
        # (.iter, not iteration: that deals the shards out to the loader's workers once more, as we have)
        batches = self.split.shard(num_shards=self.n_shards, index=shard).iter(batch_size=64)
        rows = (({k: b[k][j] for k in self.keys}, image) for b in batches for j, image in enumerate(b[self.image_key]))
        for i, (labels, image) in enumerate(rows):
            name = f"{self.where} shard {shard} row {i}"
            yield name, image, self._multi_hot(labels, name) if self.multilabel else self._label(labels, name)

    def _label(self, labels: dict, name: str) -> int:
        (label,) = labels.values()
        if isinstance(label, str) and self.index is not None and label in self.index:
            label = self.index[label]
        if not isinstance(label, int) or isinstance(label, bool):
            raise UserError(f"{name} has the label {label!r}: labels must be integers or the class names")
        return label

    def _multi_hot(self, labels: dict, name: str) -> Any:
        if self.keys == self.names:  # a 0/1 column a class (label_format=columns)
            (indices,), _ = column_labels([labels], "", name, self.names)
        else:
            (indices,), _ = multilabel_indices(list(labels.values()), name, self.names)
        return multi_hot([indices], self.names)[0]


class HFDataModule(RecordsDataModule):
    takes_folds = True  # data.folds=K data.fold=i (data/folds.py)
    decodes_files = True  # an Image column holds each photo's encoded file (decoded in the loader's workers, at its own
    # size: objective=dino cuts its views from each whole image, as from a folder's)

    def __init__(
        self,
        name: str,
        num_classes: int,
        config: str | None = None,  # the dataset's configuration (load_dataset's second argument)
        image_key: str | None = None,  # null: found (an Image feature, or image / img)
        label_key: str | None = None,  # null: found (a ClassLabel, or label / labels / fine_label)
        train_split: str = "train",
        val_split: str | None = None,  # null: validation / val / valid where there is one, else held out of train
        test_split: str | None = "test",  # null: none (a missing `test` is no error)
        streaming: bool = False,
        num_train: int | None = None,  # streaming: samples an epoch; null: the train split's size
        shuffle_buffer: int = 1024,  # streaming: samples shuffled among (timm's shuffle_size)
        corrupt: str = "skip",  # streaming: skip (and count) an image that cannot be decoded, or error
        cache_dir: str | None = None,  # where load_dataset keeps what it prepares; null: Hugging Face's default
        multilabel: bool = False,  # several labels an image (objective.multilabel): data/multilabels.py
        label_format: str = "names",  # names (a list column, or ;-separated names) | columns (a 0/1 column a class)
        **kwargs: Any,
    ):
        if corrupt not in ("skip", "error"):
            raise UserError(f"data.corrupt {corrupt!r} must be skip or error")
        if num_train is not None and num_train < 1:
            raise UserError(f"data.num_train {num_train} must be >= 1, or null")
        super().__init__(num_classes=num_classes, data_dir=name, **kwargs)
        self.name, self.config, self.image_key, self.label_key = str(name), config, image_key, label_key
        self.split_names = {"train": train_split, "val": val_split, "test": test_split}
        self.streaming, self.num_train = streaming, num_train
        self.shuffle_buffer, self.corrupt = shuffle_buffer, corrupt
        self.cache_dir = cache_dir
        self.multilabel, self.label_format = bool(multilabel), label_format
        self.can_reside = not streaming

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        splits = load(self.name, self.config, bool(self.streaming), self.cache_dir)
        names = dict(self.split_names)
        if names["val"] is None:
            names["val"] = next((s for s in VAL_SPLITS if s in splits), None)
        if names["test"] is not None and names["test"] not in splits and self.split_names["test"] == "test":
            names["test"] = None  # (the default: a dataset without a test split tests nothing)
        chosen = {role: pick(splits, s, self.name) for role, s in names.items() if s is not None}
        where = {role: f"{self.name} [{s}]" for role, s in names.items() if s is not None}
        if self.multilabel:
            return self._setup_multilabel(chosen, where)
        image, label = columns(chosen["train"], self.image_key, self.label_key, where["train"])
        names_of = class_names(chosen["train"], label)
        if self.streaming:
            self._check_classes(names_of or [str(i) for i in range(self.num_classes)], where["train"])
            self._set_streamed_splits(self._stream(chosen, where, image, label), where, self._epoch_size(chosen), {})
            return
        made = {}
        for role, split in chosen.items():
            labels, names_of = label_indices(split[label], f"the label column {label!r} of {where[role]}", names_of)
            made[role] = HFImages(split, image, labels, where[role], self.channels)
        self._check_classes(names_of, where["train"])
        log.info("%s: %s images in %d classes", self.name, ", ".join(f"{len(d):,} {r}" for r, d in made.items()),
                 len(names_of))  # fmt: skip
        self._set_map_splits(made["train"], made.get("val"), made.get("test"), where)

    def _setup_multilabel(self, chosen: dict, where: dict) -> None:
        """Several labels a row (objective.multilabel): each image's multi-hot row (data/multilabels.py). Streamed,
        the classes are the train split's features' (every split's the same) and nothing is counted."""
        made, names = {}, None
        if self.streaming:
            found = {r: hf_streamed_multilabels(s, self.image_key, self.label_key, self.label_format, where[r])
                     for r, s in chosen.items()}  # fmt: skip
            image, keys, names = found["train"]
            for role, (_, _, theirs) in found.items():
                if theirs != names:
                    raise UserError(f"{where[role]} has the classes {theirs[:5]}..., not the train split's "
                                    f"{names[:5]}...")  # fmt: skip
            self._check_classes(names, where["train"])
            streamed = self._stream(chosen, where, image, keys[0], multilabel=keys)
            self._set_streamed_splits(streamed, where, self._epoch_size(chosen), {})
            return
        for role, split in chosen.items():
            image, labels, names = hf_multilabels(
                split, self.image_key, self.label_key, self.label_format, where[role], names
            )
            if role == "train":
                self.class_counts = class_counts(labels, names)
            made[role] = HFImages(split, image, multi_hot(labels, names), where[role], self.channels)
        self._check_classes(names, where["train"])
        self._set_map_splits(made["train"], made.get("val"), made.get("test"), where)

    def _epoch_size(self, chosen: dict) -> int:
        if self.num_train is not None:
            return self.num_train
        saved = SIZES.get(str(Path(self.name).expanduser()), {}).get(self.split_names["train"])
        info = chosen["train"].info.splits or {}
        split = info.get(self.split_names["train"])
        if saved:
            self.num_train = saved
            return saved
        if split is None or not split.num_examples:
            raise UserError(f"{self.name} does not say how many training samples it streams: give data.num_train")
        self.num_train = split.num_examples
        return self.num_train

    def _stream(self, chosen: dict, where: dict, image: str, label: str, multilabel: list[str] | None = None):
        names = self.class_names or None
        sources = {where[r]: HFStream(split, image, label, names, where[r], multilabel) for r, split in chosen.items()}
        saved = SIZES.get(str(Path(self.name).expanduser()), {})
        count = {where[r]: saved.get(self.split_names[r]) for r in chosen}

        def make(split: str, train: bool, holdout):
            size = self._epoch_size(chosen) if train else (count[split] if holdout is None else None)
            tf = self.train_tf if train else self.eval_tf
            decode = functools.partial(_decode, channels=self.channels)
            return StreamedSplit(sources[split], tf, decode, train, size, self.shuffle_buffer if train else 0,
                                 self.corrupt, holdout)  # fmt: skip

        return make


def _decode(value: Any, name: str, channels: int):
    return decode_image(image_bytes(value, name), name, channels)
