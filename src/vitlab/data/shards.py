"""Packing a dataset's splits into LitData chunks (`python -m vitlab.pack`), read back by data/streaming.py.

An image file's bytes are kept as they are (JPEG stays JPEG); images a dataset holds in memory (CIFAR, fake) are
written as PNG, losslessly. Every image is decoded once while packing, as training would decode it, so a file that
cannot be is named in one line before anything is left behind. The splits are written into a temporary folder
beside the output and renamed into place when all are complete; an existing output is replaced only when asked.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from vitlab.data.images import decode_image
from vitlab.data.seeded import TransformDataset, init_worker
from vitlab.data.streaming import INFO
from vitlab.data.wds import write_shards
from vitlab.utils.atomic import disk_error
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


def pack(
    datamodule,
    out: Path,
    overwrite: bool = False,
    workers: int | None = None,
    chunk_bytes: str = "64MB",
    format: str = "litdata",
    shard_size: int = 10000,
) -> dict:
    """Write every split of `datamodule` (set up) as shards in `out`, LitData's or (format wds) WebDataset's tars of
    `shard_size` samples; returns the description saved beside them."""
    if out.exists() and not overwrite:
        raise UserError(f"out {str(out)!r} already exists; give a new folder, or overwrite=true to replace it")
    splits = {"train": datamodule.train_set, "val": datamodule.val_set, "test": datamodule.test_set}
    splits = {name: split for name, split in splits.items() if split is not None}  # (a folder without test/)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    info = {"format": 1, "class_names": list(datamodule.class_names), "channels": datamodule.channels, "splits": {}}
    try:
        if format == "wds":
            tmp.mkdir()
            items = {name: _items(split, workers or os.cpu_count() or 1) for name, split in splits.items()}
            info = write_shards(items, tmp, datamodule.class_names, shard_size)
            _replace(tmp, out)
            return info
        for name, split in splits.items():
            log.info("packing %s: %d images into %s", name, len(split), out / name)
            _write(split, tmp / name, workers or os.cpu_count() or 1, chunk_bytes)
            info["splits"][name] = len(split)
            size = sum(f.stat().st_size for f in (tmp / name).iterdir())
            log.info("packed %s: %d images, %.1f MB", name, len(split), size / 1e6)
        (tmp / INFO).write_text(json.dumps(info, indent=2))
        _replace(tmp, out)
    except OSError as e:
        disk = disk_error(e)
        if disk is None or disk.errno in (errno.EACCES, errno.EPERM):  # (reading an image may be refused too)
            raise
        raise UserError(
            f"cannot write the shards of {out} ({disk.strerror or disk}); the partial shards were removed"
            f"{' and the earlier ' + out.name + ' is as it was' if out.exists() else ''}; free space, or pack "
            "elsewhere with out=<folder>"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _items(split: TransformDataset, workers: int):
    """The split's items, in order, read (and checked) by loader workers."""
    from torch.utils.data import DataLoader

    return DataLoader(_Items(split), batch_size=None, num_workers=workers, worker_init_fn=init_worker)


def _write(split: TransformDataset, folder: Path, workers: int, chunk_bytes: str) -> None:
    """The split's items, in order, as LitData chunks in `folder`: loader workers read (and check) the images,
    LitData's writer chunks them here. A bar on a terminal, a line per tenth in a log."""
    from litdata.streaming.writer import BinaryWriter

    items = _items(split, workers)
    folder.mkdir(parents=True)
    writer = BinaryWriter(str(folder), chunk_bytes=chunk_bytes)
    with _progress(len(split), folder.name) as advance:
        for i, item in enumerate(items):
            writer.add_item(i, {**item, "image": _blob(item["image"])})
            advance()
    writer.done()
    writer.merge()


class _Items(Dataset):
    """What the shards hold for item i of a split: an image file's own bytes (an ImageFolder), or a PNG of an
    image the dataset holds in memory (CIFAR, fake); its label; its name, for errors."""

    def __init__(self, split: TransformDataset):
        self.base, self.indices = split.base, split.indices
        self.root = Path(self.base.root).parent if hasattr(self.base, "samples") else None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        index = self.indices[i]
        if self.root is not None:
            path, label = self.base.samples[index]
            data = Path(path).read_bytes()
            decode_image(data, path)  # a file training could not read is named now, not mid-run
            return {"image": data, "label": label, "name": str(Path(path).relative_to(self.root))}
        img, label = self.base[index]
        if not isinstance(img, Image.Image):  # a uint8 (C, H, W) tensor
            array = np.asarray(img.permute(1, 2, 0))
            img = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
        buffer = io.BytesIO()
        img.save(buffer, format="PNG")
        return {"image": buffer.getvalue(), "label": int(label), "name": str(index)}


def _blob(data: bytes) -> np.ndarray:
    """An encoded image as a uint8 array: LitData keeps arrays in its own item format. Raw bytes beside an int and a
    str make a row LitData 0.2.76 writes as an Arrow footer alone once pyarrow is installed (as `datasets` brings it),
    and such chunks read from an object store come back empty. The reader takes either (`bytes(item["image"])`)."""
    return np.frombuffer(data, dtype=np.uint8)


@contextlib.contextmanager
def _progress(total: int, what: str):
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, desc=f"packing {what}", unit="img") as bar:
            yield bar.update
        return
    done, tenth = 0, max(1000, total // 10)

    def advance() -> None:
        nonlocal done
        done += 1
        if done % tenth == 0 and done < total:
            log.info("packing %s: %d of %d images", what, done, total)

    yield advance


def _replace(tmp: Path, out: Path) -> None:
    """Put the complete `tmp` at `out`; an earlier `out` is moved aside first and removed only once it is."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
