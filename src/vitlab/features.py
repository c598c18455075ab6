"""Frozen features of a split, extracted once and cached on disk for every evaluation that reads them (k-NN,
few-shot: `vitlab.probes`).

A split's images pass through the data module's evaluation transforms (no augmentation, the training split
included) and the model's pooled pre-logits features (`forward_head(..., pre_logits=True)`: the class token or the
pooled tokens after the final norm). The cache is `<dir>/<split>.npy` (float32, memory-mapped) and
`<split>.labels.npy`, with `<split>.json` naming what they hold (the checkpoint's path, size and time, the split's
size, the width) and how many rows are written: an extraction that stopped goes on from there, and a second task
reads the file instead of running the model. `probe` runs vitlab.eval's task=knn|linear|fewshot on them. No
Lightning, no Hydra.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import UserError

log = logging.getLogger(__name__)


def source_id(ckpt_path: str) -> dict[str, Any]:
    """What identifies the weights features came from: a different file (or the same path rewritten) is new."""
    st = os.stat(ckpt_path)
    return {"ckpt": str(Path(ckpt_path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@torch.no_grad()
def split_features(
    model: torch.nn.Module, datamodule, split: str, device: torch.device, cache: Path | None, source: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, D) float32, labels (N,) int64) of `split`, from the cache where it holds them."""
    dataset = datamodule.eval_view(split)
    n = len(dataset)
    meta = {**source, "split": split, "n": n}
    found = None
    if cache is not None:
        found = _read(cache, split, meta)
        if found is not None and found[2] == n:
            log.info("%s features: read from %s", split, cache)
            return torch.from_numpy(np.array(found[0])), torch.from_numpy(np.array(found[1]))
    model.eval().to(device)
    loader = datamodule._loader(dataset, train=False)
    feats = labels = None
    done = found[2] if found is not None else 0
    row = 0
    for batch in loader:
        b = len(batch[1])
        if row + b <= done:  # written before the extraction stopped
            row += b
            continue
        x, y = datamodule.device_transform(datamodule.transfer_batch_to_device(batch, device, 0), train=False)
        f = model.forward_head(model.forward_features(x), pre_logits=True).float().cpu().numpy()
        if feats is None:
            feats, labels = found[:2] if found is not None and done else _open(cache, split, n, f.shape[1], meta)
        feats[row : row + b], labels[row : row + b] = f, y.cpu().numpy()
        row += b
        if cache is not None:
            feats.flush(), labels.flush()
            _write_meta(cache, split, {**meta, "dim": f.shape[1], "done": row})
    if cache is not None:
        log.info("%s features: %d x %d, cached in %s", split, n, feats.shape[1], cache)
    return torch.from_numpy(np.array(feats)), torch.from_numpy(np.array(labels))


def _read(cache: Path, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray, int] | None:
    path = cache / f"{split}.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if {k: saved.get(k) for k in meta} != meta:  # other weights or another split: extract anew
        return None
    feats = np.load(cache / f"{split}.npy", mmap_mode="r+")
    labels = np.load(cache / f"{split}.labels.npy", mmap_mode="r+")
    return feats, labels, int(saved["done"])


def _open(cache: Path | None, split: str, n: int, dim: int, meta: dict):
    if cache is None:
        return np.empty((n, dim), np.float32), np.empty(n, np.int64)
    cache.mkdir(parents=True, exist_ok=True)
    _write_meta(cache, split, {**meta, "dim": dim, "done": 0})
    feats = np.lib.format.open_memmap(cache / f"{split}.npy", mode="w+", dtype=np.float32, shape=(n, dim))
    labels = np.lib.format.open_memmap(cache / f"{split}.labels.npy", mode="w+", dtype=np.int64, shape=(n,))
    return feats, labels


def _write_meta(cache: Path, split: str, meta: dict) -> None:
    tmp = cache / f".{split}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, cache / f"{split}.json")


TASKS = ("test", "knn", "fewshot", "linear")


def probe(cfg, model, datamodule) -> dict:
    """vitlab.eval's task=knn|linear|fewshot (`cfg`: eval's config) on the frozen features of the training split
    and the test split (the validation split where the data has none), extracted once into the features cache and
    read from there by later tasks."""
    from vitlab.probes import fewshot_accuracy, knn_accuracy, linear_probe

    if cfg.task not in TASKS:
        raise UserError(f"task {cfg.task!r} is not one of {list(TASKS)}")
    ckpt = Path(cfg.ckpt_path)
    cache = Path(cfg.features_dir) if cfg.features_dir else ckpt.resolve().parent.parent / "features" / ckpt.stem
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    split = "test" if getattr(datamodule, "test_set", None) is not None else "val"
    if cfg.task == "linear" and split == "val":
        raise UserError(
            "task=linear picks its learning rate on the validation split and needs a test split besides it: this data "
            "has none (for an image folder, data.val_fraction=0.01 validates on a slice of train and tests on val/)"
        )
    args = (model, datamodule)
    train, train_y = split_features(*args, "train", device, cache, source_id(cfg.ckpt_path))
    test, test_y = split_features(*args, split, device, cache, source_id(cfg.ckpt_path))
    k = datamodule.num_classes
    if cfg.task == "linear":
        val, val_y = split_features(*args, "val", device, cache, source_id(cfg.ckpt_path))
        lp = cfg.linear
        found = linear_probe(train, train_y, val, val_y, test, test_y, k, tuple(lp.lrs), lp.epochs, lp.batch_size,
                             lp.seed)  # fmt: skip
        metrics = {"linear/top1": found["test_acc"], "linear/val_top1": found["val_acc"], "linear/lr": found["lr"]}
    elif cfg.task == "knn":
        found = knn_accuracy(train, train_y, test, test_y, k, tuple(cfg.knn.k), cfg.knn.temperature)
        metrics = {f"knn/top1_k{n}": acc for n, acc in found.items()}
    else:
        f = cfg.fewshot
        found = fewshot_accuracy(train, train_y, test, test_y, k, tuple(f.shots), f.l2_reg, f.seed)
        metrics = {f"fewshot/{n}shot": acc for n, acc in found.items()}
    print(", ".join(f"{name} {v:.4f}" for name, v in metrics.items()) + f" (on the {split} split)", flush=True)
    return metrics | {"split": split, "features": str(cache)}
