"""What a split's cached features were made from, beside the weights: its images and labels (and masks), and the
transform that prepared them. Two extractions that agree on it hold the same features; one that does not is made
anew ("re-extracted: the data changed"), where keying on the split's size alone let another folder of as many
images, or images moved between classes, or corrected masks, be answered by the old features.

Files are known by their path, size and modification time (what `make` and rsync trust: a file rewritten is new,
none is read); images held in memory (digits, CIFAR, the embedded canvases) by their bytes; a dataset of another
kind by what describes it (a Hugging Face table's fingerprint, a shard's url and file). The digest is a blake2b of
them in the split's order, so a reordered split is new too. Plain Python, no Lightning.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch


def data_identity(dataset: Any, datamodule: Any) -> dict[str, Any]:
    """{"items": what the split's images were read from (a digest), "transform": how evaluation prepared them} of
    `dataset` (a split as `eval_view` or `seg_view` give it), as JSON gives it back (the cache compares the two)."""
    h = hashlib.blake2b(digest_size=16)
    kind = _feed(h, dataset)
    transform = {
        "img_size": _plain(getattr(datamodule, "img_hw", None)),
        "channels": getattr(datamodule, "channels", None),
        "mean": _plain(getattr(datamodule, "mean", None)),
        "std": _plain(getattr(datamodule, "std", None)),
        "eval": _plain(dict(getattr(datamodule, "eval_settings", {}) or {})),
        "reduce_zero_label": getattr(datamodule, "reduce_zero_label", None),  # (the masks as read)
    }
    return {"items": f"{kind}:{h.hexdigest()}", "transform": transform}


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: the value as it comes back from JSON."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _feed(h, ds: Any) -> str:
    """Feed `ds`'s items' sources into `h`, in order; returns what they were known by (files, arrays, ...)."""
    if hasattr(ds, "base") and hasattr(ds, "indices"):  # TransformDataset, SegmentationView: a view of its base
        h.update(np.asarray(ds.indices, dtype=np.int64).tobytes())
        return _feed(h, ds.base)
    if hasattr(ds, "dataset") and hasattr(ds, "indices"):  # torch's Subset
        h.update(np.asarray(ds.indices, dtype=np.int64).tobytes())
        return _feed(h, ds.dataset)
    if hasattr(ds, "samples"):  # torchvision's ImageFolder: (path, class index)
        _files(h, ((p, label) for p, label in ds.samples))
        return "files"
    if hasattr(ds, "pairs"):  # segmentation's (image, mask) files
        _files(h, ((p, "image") for p, _ in ds.pairs))
        _files(h, ((m, "mask") for _, m in ds.pairs))
        return "files"
    if hasattr(ds, "paths") and hasattr(ds, "labels"):  # a list file's images
        _files(h, zip(ds.paths, ds.labels, strict=True))
        return "files"
    if isinstance(getattr(ds, "images", None), torch.Tensor):  # decoded images in memory (+ masks)
        for name in ("images", "labels", "masks"):
            t = getattr(ds, name, None)
            if isinstance(t, torch.Tensor):
                h.update(name.encode() + str(tuple(t.shape)).encode())
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return "arrays"
    table = getattr(ds, "table", None)
    if table is not None and hasattr(table, "_fingerprint"):  # a Hugging Face split: its table's own fingerprint
        h.update(str(table._fingerprint).encode() + np.asarray(ds.labels, dtype=np.int64).tobytes())
        return "hf"
    source = getattr(ds, "source", None)
    if source is not None and hasattr(source, "urls"):  # tar shards: each one's url (and file, where local)
        _files(h, ((u, "shard") for u in source.urls))
        return "shards"
    described = source if source is not None else ds  # (RandomImages: its count, size and seed; a stream: its name)
    scalars = {k: v for k, v in vars(described).items() if isinstance(v, (int, float, str, tuple))}
    h.update(f"{type(described).__name__}{sorted(scalars.items())}".encode())
    return type(described).__name__


def _files(h, entries) -> None:
    """Each (path, label)'s path, size, modification time and label; a path that is not a local file by name."""
    for path, label in entries:
        path = os.fspath(path)
        try:
            st = os.stat(path)
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{label}\n".encode())
        except (OSError, ValueError):  # (a url: its name)
            h.update(f"{path}\0{label}\n".encode())
