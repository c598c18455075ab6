"""WebDataset shards (`data=wds`, timm's `--dataset wds/<name>`): tar files whose members of one key make a sample
(`0001.jpg` + `0001.cls`), read by `webdataset`'s tar reader from local paths, `pipe:<command>` or http(s) URLs.
`data.urls` is a brace pattern (`/data/train-{000000..000127}.tar`) or a list of them; `data.val_urls` and
`data.test_urls` likewise, where there are such shards (no val_urls: a held-out slice of train validates,
data/streamed.py).

Samples are streamed (data/streamed.py): shards dealt out to processes and loader workers, a shuffle buffer,
`data.num_train` samples an epoch, exact mid-epoch resume. An image is the first of `data.image_key`'s members
(`jpg;png;webp`), decoded in the workers by `data.images.decode_image` (an image folder's decoder); its label the
integer in `data.label_key` (`cls`). A sample whose image cannot be decoded, or a tar member cut short, is skipped
and counted (data.corrupt=skip, timm's), or stops the run (data.corrupt=error).

`python -m vitlab.pack format=wds` writes a dataset's splits as such shards (`write_shards`), with `vitlab-wds.json`
beside them: the class names and each split's size, from which num_classes and num_train default.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from vitlab.data.images import decode_image
from vitlab.data.indexes import INFO, expand, read_info
from vitlab.data.records import RecordsDataModule
from vitlab.data.streamed import StreamedSplit
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


class TarShards:
    """Shards as a data/streamed.py Source: each tar's samples in order, (name, image bytes, label)."""

    def __init__(self, urls: list[str], image_keys: list[str], label_key: str, corrupt: str):
        import multiprocessing

        self.urls, self.n_shards, self.image_keys, self.label_key = urls, len(urls), image_keys, label_key
        self.corrupt = corrupt
        # A shard that cannot be read whole is said once (a reader goes round its shards many times an epoch: a cut
        # tar made 144 lines of one epoch), its faults counted: shared with the loader workers, forked from here.
        self.said, self.faults = multiprocessing.Array("b", len(urls)), multiprocessing.Value("q", 0)

    def read(self, shard: int):
        from webdataset.tariterators import tarfile_samples

        url = self.urls[shard]
        for sample in tarfile_samples([{"url": url}], handler=functools.partial(self._tar_error, shard)):
            name = f"{url} {sample.get('__key__')}"
            data = next((sample[k] for k in self.image_keys if k in sample), None)
            if data is None:  # (decoding it names the sample and what was looked for)
                data = f"no {';'.join(self.image_keys)} member among {sorted(k for k in sample if k[:2] != '__')}"
            yield name, data, self._label(sample, name)

    def _label(self, sample: dict, name: str) -> int:
        value = sample.get(self.label_key)
        try:
            return int(bytes(value).decode().strip())
        except (TypeError, ValueError):
            raise UserError(
                f"sample {name} has no integer {self.label_key!r} member ({value!r:.40}); name the label's with "
                "data.label_key"
            ) from None

    def _tar_error(self, shard: int, error: Exception) -> bool:
        url = self.urls[shard]
        if self.corrupt == "error":
            raise UserError(f"shard {url} cannot be read ({type(error).__name__}: {error}); data.corrupt=skip skips "
                            "what cannot be read, counted")  # fmt: skip
        with self.faults.get_lock():
            self.faults.value += 1
            first, self.said[shard] = not self.said[shard], 1
        if first:
            log.warning("shard %s cannot be read whole (%s: %s): what it holds before that is used, the rest skipped "
                        "(data.corrupt=skip); said once, counted at the end", url, type(error).__name__,
                        str(error).splitlines()[0][:160])  # fmt: skip
        return True

    def summary(self) -> str | None:
        """How many reads failed, in which shards (None: none)."""
        if not self.faults.value:
            return None
        bad = [url for url, said in zip(self.urls, self.said, strict=True) if said]
        return f"{self.faults.value} read(s) of {len(bad)} shard(s) failed and were skipped: {', '.join(bad[:3])}"


def decode(data: Any, name: str, channels: int = 3):
    if isinstance(data, str):
        raise UserError(f"sample {name} has {data}: name the image's with data.image_key")
    return decode_image(bytes(data), f"sample {name}", channels)


class WDSDataModule(RecordsDataModule):
    can_reside = False  # streamed, read as it comes

    def __init__(
        self,
        urls: str | list[str],
        num_classes: int,
        val_urls: str | list[str] | None = None,
        test_urls: str | list[str] | None = None,
        num_train: int | None = None,  # samples an epoch; null: the pack's count of train (vitlab-wds.json)
        image_key: str = "jpg;png;webp",  # the image's member: the first of these a sample has
        label_key: str = "cls",
        shuffle_buffer: int = 1024,
        corrupt: str = "skip",
        **kwargs: Any,
    ):
        if corrupt not in ("skip", "error"):
            raise UserError(f"data.corrupt {corrupt!r} must be skip or error")
        if shuffle_buffer < 0:
            raise UserError(f"data.shuffle_buffer {shuffle_buffer} must be >= 0 (0 or 1: no shuffling among samples)")
        if num_train is not None and num_train < 1:
            raise UserError(f"data.num_train {num_train} must be >= 1, or null")
        self.urls = {"train": expand(urls, "urls")}
        self.urls |= {"val": expand(val_urls, "val_urls")} if val_urls is not None else {}
        self.urls |= {"test": expand(test_urls, "test_urls")} if test_urls is not None else {}
        super().__init__(num_classes=num_classes, data_dir=str(Path(self.urls["train"][0]).parent), **kwargs)
        self.image_keys = [k.strip().lower() for k in image_key.split(";") if k.strip()]
        self.label_key, self.shuffle_buffer, self.corrupt = label_key, shuffle_buffer, corrupt
        info = read_info(self.urls["train"][0]) or {}
        self.num_train = num_train or info.get("splits", {}).get("train")
        if self.num_train is None:
            raise UserError("data.num_train is needed: the samples an epoch of data.urls' shards (timm's too)")
        self.sizes = {k: n for k, n in info.get("splits", {}).items()}
        self.class_names = list(info.get("class_names") or [str(i) for i in range(num_classes)])

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        names = {role: f"data.{'urls' if role == 'train' else role + '_urls'}" for role in self.urls}
        sources = {names[r]: TarShards(u, self.image_keys, self.label_key, self.corrupt) for r, u in self.urls.items()}
        self._sources = sources
        sizes = {names[r]: self.sizes.get(r) for r in self.urls}

        def make(split: str, train: bool, holdout):
            size = self.num_train if train else (sizes[split] if holdout is None else None)
            tf = self.train_tf if train else self.eval_tf
            buffer = self.shuffle_buffer if train else 0
            return StreamedSplit(sources[split], tf, functools.partial(decode, channels=self.channels), train, size,
                                 buffer, self.corrupt, holdout)  # fmt: skip

        self._set_streamed_splits(make, names, self.num_train, sizes)

    def teardown(self, stage: str) -> None:
        """The count at the end of fit or test: each shard that could not be read whole was said once."""
        reported = self.__dict__.setdefault("_reported", {})
        for split, source in getattr(self, "_sources", {}).items():
            if (said := source.summary()) is not None and reported.get(split) != source.faults.value:
                reported[split] = source.faults.value
                log.warning("%s (%s, in this process's loaders, data.corrupt=skip)", said, split)
        super().teardown(stage)


def write_shards(splits: dict, out: Path, class_names: list[str], shard_size: int) -> dict:
    """Every split's items (pack.py's: an image file's bytes, its label, its name) as `<split>-NNNNNN.tar` shards of
    `shard_size` samples in `out`, and the description beside them; returns it."""
    from webdataset import ShardWriter

    info = {"format": 1, "class_names": list(class_names), "splits": {}, "urls": {}}
    for name, items in splits.items():
        pattern = str(out / f"{name}-%06d.tar")
        with ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
            for i, item in enumerate(items):
                ext = Path(item["name"]).suffix.lower().lstrip(".") or "png"
                sink.write({"__key__": f"{i:08d}", "jpg" if ext == "jpeg" else ext: item["image"],
                            "cls": str(item["label"]).encode()})  # fmt: skip
            written = sink.shard
        info["splits"][name] = len(items)
        info["urls"][name] = f"{name}-{{000000..{written - 1:06d}}}.tar"
        log.info("packed %s: %d samples in %d shards", name, len(items), written)
    (out / INFO).write_text(json.dumps(info, indent=2))
    return info
