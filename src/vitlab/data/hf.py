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
from vitlab.data.records import RecordsDataModule, label_indices
from vitlab.data.streamed import StreamedSplit
from vitlab.utils.downloads import unless_hub_reachable_read_the_cache
from vitlab.utils.errors import MissingFileError, OfflineError, UserError

log = logging.getLogger(__name__)

IMAGE_KEYS, LABEL_KEYS = ("image", "img"), ("label", "labels", "fine_label")
VAL_SPLITS = ("validation", "val", "valid")
SIZES: dict[str, dict[str, int]] = {}  # a saved dataset's split sizes, by its path, when it is streamed
STREAM_SHARDS = 64  # shards a saved dataset is cut into when streamed, to deal out to processes and workers


@functools.lru_cache(maxsize=8)
def load(name: str, config: str | None = None, streaming: bool = False, cache_dir: str | None = None) -> dict:
    """The dataset's splits {name: Dataset or IterableDataset}; a saved dataset streamed keeps its splits' sizes in
    SIZES."""
    import datasets

    path = Path(name).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        saved = datasets.load_from_disk(str(path))
        splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
        if streaming:
            SIZES[str(path)] = {k: len(v) for k, v in splits.items()}
            splits = {
                k: v.to_iterable_dataset(num_shards=min(STREAM_SHARDS, max(1, len(v)))) for k, v in splits.items()
            }
        return splits
    if not path.exists() and (name.startswith(("/", ".", "~")) or name.count("/") > 1):
        raise MissingFileError(f"data.name {name!r} does not exist (a folder save_to_disk wrote, or of parquet files)")
    if not path.exists():
        unless_hub_reachable_read_the_cache()  # (no network: the cache alone, at once)
    try:
        return dict(datasets.load_dataset(str(path) if path.exists() else name, config, streaming=streaming,
                                          cache_dir=cache_dir))  # fmt: skip
    except Exception as e:  # the Hub's errors offline are many kinds (ConnectionError, LocalEntryNotFoundError, ...)
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        if path.exists():
            raise UserError(f"data.name {name!r} cannot be read as a dataset ({said})") from e
        raise OfflineError(
            f"data.name {name!r} cannot be loaded from the Hugging Face Hub ({said}); offline, point data.name at a "
            "local copy: a folder Dataset.save_to_disk wrote, or a folder of its parquet files"
        ) from e


def find_column(features: dict, given: str | None, kinds: tuple, names: tuple, what: str, where: str) -> str:
    """The image or label column: `given`, else the one of `kinds` (features) or `names` where there is one."""
    columns = list(features)
    if given is not None:
        if given not in features:
            raise UserError(f"data.{what}_key {given!r} is not a column of {where}; its columns: {', '.join(columns)}")
        return given
    for found in ([c for c in columns if isinstance(features[c], kinds)], [c for c in names if c in features]):
        if len(found) == 1:
            return found[0]
    raise UserError(
        f"{where} has no single {what} column ({', '.join(columns)}): name it with data.{what}_key=<column>"
    )


def columns(split: Any, image_key: str | None, label_key: str | None, where: str) -> tuple[str, str]:
    import datasets

    features = split.features
    if features is None:
        raise UserError(f"{where} does not say its columns' features; name them with data.image_key and data.label_key")
    image = find_column(features, image_key, (datasets.Image,), IMAGE_KEYS, "image", where)
    label = find_column(features, label_key, (datasets.ClassLabel,), LABEL_KEYS, "label", where)
    kind = features[image]
    if isinstance(kind, datasets.ClassLabel) or (isinstance(kind, datasets.Value) and "string" not in kind.dtype
                                                 and "binary" not in kind.dtype):  # fmt: skip
        held = "class labels" if isinstance(kind, datasets.ClassLabel) else f"{kind.dtype} values"
        raise UserError(
            f"data.image_key {image!r} is a column of {where} that holds {held}, not images; its columns: "
            f"{', '.join(features)}"
        )
    return image, label


def class_names(split: Any, label_key: str) -> list[str] | None:
    import datasets

    feature = split.features[label_key]
    return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def count_classes(name: str, config: str | None = None, label_key: str | None = None, streaming: bool = False,
                  cache_dir: str | None = None, train_split: str = "train") -> int:  # fmt: skip
    """`${data_classes:}` for data=hf: the classes of the train split's label column."""
    splits = load(str(name), config, bool(streaming), cache_dir)
    train = pick(splits, train_split, name)
    label = columns(train, None, label_key, f"{name} [{train_split}]")[1]
    names = class_names(train, label)
    if names is None:
        if streaming:
            raise UserError(f"the label column {label!r} of {name} is not a ClassLabel: give data.num_classes")
        names = label_indices(train[label], f"the label column {label!r} of {name} [{train_split}]")[1]
    return len(names)


def pick(splits: dict, split: str, name: str) -> Any:
    if split not in splits:
        raise UserError(f"{name} has no split {split!r}; its splits: {', '.join(splits)}")
    return splits[split]


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
    """A split of an iterable Hugging Face dataset as a data/streamed.py Source: its shards, (name, bytes, label)."""

    def __init__(self, split: Any, image_key: str, label_key: str, names: list[str] | None, where: str):
        import datasets

        self.split = split.cast_column(image_key, datasets.Image(decode=False)).select_columns([image_key, label_key])
        self.n_shards, self.image_key, self.label_key, self.where = split.num_shards, image_key, label_key, where
        self.index = {n: i for i, n in enumerate(names)} if names else None

    def read(self, shard: int):
        # (.iter, not iteration: that deals the shards out to the loader's workers once more, as we have)
        rows = self.split.shard(num_shards=self.n_shards, index=shard).iter(batch_size=64)
        pairs = (pair for b in rows for pair in zip(b[self.image_key], b[self.label_key], strict=True))
        for i, (image, label) in enumerate(pairs):
            name = f"{self.where} shard {shard} row {i}"
            if isinstance(label, str) and self.index is not None and label in self.index:
                label = self.index[label]
            if not isinstance(label, int) or isinstance(label, bool):
                raise UserError(f"{name} has the label {label!r}: labels must be integers or the class names")
            yield name, image, label


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

    def _stream(self, chosen: dict, where: dict, image: str, label: str):
        names = self.class_names or None
        sources = {where[r]: HFStream(split, image, label, names, where[r]) for r, split in chosen.items()}
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
