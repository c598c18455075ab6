"""Shards written by `python -m vitlab.pack`: every split of a dataset as LitData chunks (each image file's bytes
as they were, its label and its name), in a local folder or an object store (s3://, gs://, azure://; LitData
fetches the chunks into a local cache, credentials and endpoint from the usual environment, e.g. AWS_* variables).

Images are read by LitData's random access, one at a time, and go through the pipeline every image dataset uses
(data/image_module.py): workers decode with `data.images.decode_image` and crop on uint8, the device normalises. So the
sampler, the exact mid-epoch resume and the DDP share-out (a disjoint part per process, every image each epoch,
the same number of steps for every process) are the ones every other datamodule has. LitData's own streaming
loader shares the data out by chunks: under DDP it either drops the remainder or gives the processes different
step counts, which hangs DDP.

The pack keeps the dataset's order, so item i of a split's shards is item i of the dataset it was packed from:
the same model evaluates identically on a folder and on its shards.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from vitlab.data.folds import describe_splits
from vitlab.data.image_module import ImageDataModule
from vitlab.data.images import decode_image
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

INFO = "vitlab-shards.json"  # beside the splits: class names, channels, split sizes


def is_remote(url: str) -> bool:
    """Whether `url` names an object store (`s3://`, `gs://`, `azure://`) rather than a folder."""
    return "://" in str(url)


def read_info(data_dir: str) -> dict[str, Any]:
    """The pack's description of the shards at `data_dir` (a folder or an object-store prefix)."""
    where = f"{str(data_dir).rstrip('/')}/{INFO}"
    if not is_remote(data_dir):
        if not Path(data_dir).is_dir():
            raise MissingFileError(f"data.data_dir {str(data_dir)!r} does not exist")
        if not Path(where).is_file():
            raise MissingFileError(f"data.data_dir {str(data_dir)!r} holds no shards written by python -m vitlab.pack")
        return json.loads(Path(where).read_text())
    from litdata.streaming.fs_provider import _get_fs_provider

    with tempfile.TemporaryDirectory() as tmp:
        try:
            _get_fs_provider(str(data_dir), {}).download_file(where, f"{tmp}/{INFO}")
        except Exception as e:  # the providers raise their SDK's errors: no credentials, no bucket, no such key
            raise UserError(f"cannot read {where} ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        return json.loads(Path(tmp, INFO).read_text())


def shard_classes(data_dir: str) -> int:
    """`${shard_classes:<data_dir>}`: the number of classes of the shards there, so the model's head is sized
    from the data as with an image folder."""
    return len(read_info(data_dir)["class_names"])


class ShardImages(Dataset):
    """One split's `size` images as a map-style dataset of (uint8 image, label), read by LitData's random access
    (an index is the image's place in the whole split; LitData's own length is one process's share under DDP)."""

    def __init__(self, url: str, size: int, cache_dir: str | None, max_cache_size: str, channels: int = 3):
        from litdata import StreamingDataset

        self.url, self.size, self.channels = url, size, channels
        # batch_decode off: LitData would decode the 256 items around each one it is asked for, ahead of a sequential
        # read (300 us an item when the sampler asks at random, 5 us without)
        self.shards = StreamingDataset(url, cache_dir=cache_dir, max_cache_size=max_cache_size, batch_decode=False)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        item = self.shards[i]
        return decode_image(bytes(item["image"]), f"{self.url} item {i} ({item['name']})", self.channels), item["label"]

    def encoded(self, i: int) -> tuple[bytes, str, int]:
        """The item's file bytes, its name, its label (data.decode=device: decoded on the device)."""
        item = self.shards[i]
        return bytes(item["image"]), f"{self.url} item {i} ({item['name']})", item["label"]


class StreamingDataModule(ImageDataModule):
    """`data=streaming`: the LitData shards `python -m vitlab.pack` writes, read from a folder or an object store
    (chunks cached in `cache_dir`, at most `max_cache_size`) through the image folder's pipeline and sampler."""

    channels = 3
    mean = (0.485, 0.456, 0.406)  # ImageNet
    std = (0.229, 0.224, 0.225)
    can_reside = False  # streamed from shards, read as they come

    def __init__(
        self,
        data_dir: str,
        num_classes: int,
        cache_dir: str | None = None,
        max_cache_size: str = "50GB",
        val_fraction: float = 0.0,  # > 0: this share of train validates, and val tests when there is no test split
        split_seed: int = 0,
        **kwargs,
    ):
        super().__init__(data_dir=data_dir, num_classes=num_classes, **kwargs)
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.class_names: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        info = read_info(self.data_dir)
        if len(info["class_names"]) != self.num_classes:
            raise UserError(
                f"data.num_classes {self.num_classes} does not match the {len(info['class_names'])} classes of the "
                f"shards in {self.data_dir}"
            )
        self.class_names = list(info["class_names"])
        split = {name: self._split(name, size) for name, size in info["splits"].items()}
        self._assign_splits(split["train"], split["val"], split.get("test"), self.val_fraction, self.split_seed)
        log.info("%s", describe_splits(self.splits))

    def _split(self, name: str, size: int) -> ShardImages:
        url = f"{str(self.data_dir).rstrip('/')}/{name}"
        return ShardImages(url, size, self.cache_dir, self.max_cache_size, self.channels)
