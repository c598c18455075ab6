"""Frozen features of a split, extracted once and cached on disk for every evaluation that reads them (k-NN,
few-shot, linear: `vitlab.evaluation.probes`).

A split's images pass through the data module's evaluation transforms (no augmentation, the training split
included) and the model: by default its pooled pre-logits features (`forward_head(..., pre_logits=True)`: the class
token or the pooled tokens after the final norm), or (`Layers`, through `forward_intermediates`) the class tokens of
chosen blocks after the final norm, with or without the average patch token (DINOv2's linear-probe features). The
cache is `<dir>/<split>.npy` (float32, memory-mapped; `<split>.<layers>.npy` for other layers) and
`<split>.labels.npy`, with `<split>.json` naming what they hold (the weights, the split's size, the layers, the
width, what the images, labels and masks were read from and the transform: evaluation/fingerprint.py) and how many
rows are written: an extraction that stopped goes on from there, a second task on the same data reads the file
instead of running the model, and one on changed data extracts anew ("re-extracted: the data changed").

Under torch.distributed (the processes Lightning starts: vitlab.eval with trainer=ddp_cpu, or a DDP training run)
each process extracts every world-th image and rank 0 gathers them batch by batch into the original order: the same
rows as one process, written once, by rank 0. `evaluation.tasks.run_probe` runs task=knn|linear|fewshot on them. No
Lightning, no Hydra.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from vitlab.data.naflex import check_square_reader
from vitlab.evaluation.fingerprint import data_identity
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


def source_id(ckpt_path: str) -> dict[str, Any]:
    """What identifies the weights features came from: a different file (or the same path rewritten) is new."""
    st = os.stat(ckpt_path)
    return {"ckpt": str(Path(ckpt_path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@dataclass(frozen=True)
class Layers:
    """Which features of an image: the pooled pre-logits features the head reads (`blocks` empty), or, through
    `forward_intermediates`, the class tokens of `blocks` (absolute indices, ascending) after the final norm,
    concatenated, then with `avgpool` the mean of the last of them's patch tokens (DINOv2's create_linear_input:
    (B, len(blocks) * D [+ D]))."""

    blocks: tuple[int, ...] = ()
    avgpool: bool = False

    @property
    def name(self) -> str:
        """The cache's name for them: '' for the pooled features (the split's own file), else 'blocks8-11+avgpool'."""
        if not self.blocks:
            return ""
        b = self.blocks
        run = len(b) > 1 and b == tuple(range(b[0], b[-1] + 1))
        return "blocks" + (f"{b[0]}-{b[-1]}" if run else "_".join(map(str, b))) + ("+avgpool" if self.avgpool else "")

    def dim(self, model) -> int:
        return model.num_features * (max(1, len(self.blocks)) + int(self.avgpool))

    def extract(self, model, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, dim) features."""
        if not self.blocks:
            return model.forward_head(model.forward_features(x), pre_logits=True)
        out = model.forward_intermediates(x, list(self.blocks), return_prefix_tokens=True, norm=True, stop_early=True,
                                          output_fmt="NLC", intermediates_only=True)  # fmt: skip
        feats = [prefix[:, 0] for _, prefix in out]  # each block's class token, (B, D)
        if self.avgpool:
            feats.append(out[-1][0].mean(1))  # the last block's patch tokens (registers left out), averaged
        return torch.cat(feats, dim=1)


POOLED = Layers()


def layers_of(model, blocks, avgpool: bool = False) -> Layers:
    """`blocks` as the user gives them (None: the pooled features; an int or a list of block indices, negative from
    the end) -> Layers, or a one-line UserError naming eval's `layers`."""
    if blocks is None:
        return POOLED
    given, depth = blocks, len(model.blocks)
    blocks = [blocks] if isinstance(blocks, int) else list(blocks)
    bad = [b for b in blocks if not isinstance(b, int) or isinstance(b, bool) or not -depth <= b < depth]
    if bad or not blocks:
        raise UserError(f"layers={given} must be block indices from {-depth} to {depth - 1} (the model has {depth})")
    if not model.cfg.class_token:
        raise UserError(
            f"layers={given} reads class tokens and the model has none (class_token=false); set layers=null"
        )
    # blocks' tokens of padded NaFlex batches: not read here (data/naflex.py)
    check_square_reader(
        model.cfg, f"layers={given} reads blocks' tokens of square images; a NaFlex model: set layers=null"
    )
    return Layers(tuple(sorted({b % depth for b in blocks})), avgpool)


def _world() -> tuple[int, int]:
    """(rank, number of processes): those of torch.distributed's default group, where Lightning set one up."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@torch.no_grad()
def split_features(
    model: torch.nn.Module,
    datamodule,
    split: str,
    device: torch.device,
    cache: Path | None,
    source: dict,
    layers: Layers = POOLED,
    dataset: Dataset | None = None,
    label_spec: tuple[tuple[int, ...], torch.dtype] = ((), torch.int64),
    copy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(features (N, D) float32, labels (N,) int64, or `label_spec`'s) of `split`, from the cache where it holds them;
    in rank 0 only where several processes share the work (all must call it; the others get (None, None)). Rank 0
    alone reads and writes the cache. `dataset` (else `eval_view`) and `copy` serve seg_probe's maps and masks."""
    dataset = datamodule.eval_view(split) if dataset is None else dataset
    n, (rank, world) = len(dataset), _world()
    if n == 0:  # (a held-out validation slice that held nothing: data/streamed.py refuses it in training now)
        raise UserError(f"the {split} split holds no images to extract features of")
    stem = f"{split}.{layers.name}" if layers.name else split
    meta = _meta(source, split, n, layers, dataset, datamodule) if rank == 0 else {}  # (rank 0 alone caches)
    found = _read(cache, stem, meta) if cache is not None and rank == 0 else None
    done = _from_rank0(found[2] if found is not None else 0, device, world)
    if done == n:
        if rank == 0:
            log.info("%s features: read from %s", stem, cache)
            return _tensors(cache, stem, found[:2], copy)
        return None, None
    model.eval().to(device)
    dim, (label_shape, label_dtype) = layers.dim(model), label_spec
    shape, feats, labels = tuple(dim) if isinstance(dim, tuple) else (dim,), None, None
    if rank == 0:
        opened = found is not None and done
        feats, labels = found[:2] if opened else _open(cache, stem, n, shape, meta, label_shape, label_dtype)
    # Rank r takes rows done + r, done + r + world, ...: its i-th batch and the others' i-th make rows
    # [start, start + batch * world) together, gathered and written in order by rank 0 (resumable there).
    loader = datamodule._loader(dataset, train=False, sampler=range(done + rank, n, world))
    batches, step = iter(loader), loader.batch_size * world
    for start in range(done, n, step):
        stop = min(n, start + step)
        batch = next(batches, None)
        if batch is None:  # this rank's share ended a batch before the others'
            f, y = torch.zeros(0, *shape, device=device), torch.zeros(0, *label_shape, dtype=label_dtype)
        else:
            x, y = datamodule.device_transform(datamodule.transfer_batch_to_device(batch, device, 0), train=False)
            f = layers.extract(model, x).float()
        parts = _gather_to_rank0(f, y.to(device, label_dtype), loader.batch_size, world)
        if rank > 0:
            continue
        for r, (pf, py) in enumerate(parts):
            count = len(range(start + r, stop, world))
            feats[start + r : stop : world], labels[start + r : stop : world] = pf[:count], py[:count]
        if cache is not None:
            feats.flush(), labels.flush()
            _write_meta(cache, stem, {**meta, "dim": dim, "done": stop})
    if rank > 0:
        return None, None
    if cache is not None:
        log.info("%s features: %d x %s, cached in %s", stem, n, " x ".join(map(str, shape)), cache)
    return _tensors(cache, stem, (feats, labels), copy)


def _meta(source: dict, split: str, n: int, layers: Layers, dataset, datamodule) -> dict:
    """What the cached features of `split` are: the weights (`source`), the split, its size, the layers, and what its
    images (labels, masks) were read from and how (evaluation/fingerprint.py)."""
    meta = {**source, "split": split, "n": n} | ({"layers": layers.name} if layers.name else {})
    return meta | {"made_from": data_identity(dataset, datamodule)}


def _tensors(cache: Path | None, stem: str, arrays: tuple, copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The features and labels as tensors: copied into memory; or, `copy` false, the cache's files mapped read-only
    (the segmentation probe's maps: ADE20k's at ViT-S/14's 37 x 37 tokens take 42 GB), pages read as they are used."""
    if copy or cache is None:
        return tuple(torch.from_numpy(np.array(a)) for a in arrays)
    with warnings.catch_warnings():  # (read-only arrays: torch warns that the tensors must not be written, and none is)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        mapped = (np.load(cache / f"{stem}.npy", mmap_mode="r"), np.load(cache / f"{stem}.labels.npy", mmap_mode="r"))
        return tuple(torch.from_numpy(a) for a in mapped)


def _from_rank0(value: int, device: torch.device, world: int) -> int:
    """Rank 0's `value`, in every process."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.broadcast(t, src=0)
    return int(t.item())


def _gather_to_rank0(f: torch.Tensor, y: torch.Tensor, batch: int, world: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every process's (features, labels) of a round, in rank 0, as numpy arrays (padded to `batch` rows on the
    way: torch.distributed gathers equal shapes; the callers know each share's length); [] elsewhere."""
    if world == 1:
        return [(f.cpu().numpy(), y.cpu().numpy())]
    rank = torch.distributed.get_rank()
    pf, py = f.new_zeros(batch, *f.shape[1:]), y.new_zeros(batch, *y.shape[1:])
    pf[: len(f)], py[: len(y)] = f, y
    out_f = [torch.empty_like(pf) for _ in range(world)] if rank == 0 else None
    out_y = [torch.empty_like(py) for _ in range(world)] if rank == 0 else None
    torch.distributed.gather(pf, out_f, dst=0)
    torch.distributed.gather(py, out_y, dst=0)
    return [(a.cpu().numpy(), b.cpu().numpy()) for a, b in zip(out_f, out_y, strict=True)] if rank == 0 else []


def _read(cache: Path, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray, int] | None:
    path = cache / f"{split}.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if {k: saved.get(k) for k in meta} != meta:  # other weights, another split or other data: extract anew
        if all(saved.get(k) == v for k, v in meta.items() if k not in DATA_KEYS):
            log.info("%s features: re-extracted: the data changed (%s)", split, _what_changed(saved, meta))
        return None
    feats = np.load(cache / f"{split}.npy", mmap_mode="r+")
    labels = np.load(cache / f"{split}.labels.npy", mmap_mode="r+")
    return feats, labels, int(saved["done"])


DATA_KEYS = ("made_from", "data")  # (data: the segmentation probe's data config)


def _what_changed(saved: dict, meta: dict) -> str:
    was, now = saved.get("made_from") or {}, meta["made_from"]
    parts = {"items": "its images, labels or masks", "transform": "its evaluation transform"}
    changed = [text for key, text in parts.items() if was.get(key) != now[key]]
    return " and ".join(changed) if changed else "its data config"


def _open(cache: Path | None, split: str, n: int, shape: tuple, meta: dict, label_shape: tuple, label_dtype):
    label_dtype = torch.empty(0, dtype=label_dtype).numpy().dtype
    if cache is None:
        return np.empty((n, *shape), np.float32), np.empty((n, *label_shape), label_dtype)
    cache.mkdir(parents=True, exist_ok=True)
    dim = shape[0] if len(shape) == 1 else list(shape)
    _write_meta(cache, split, {**meta, "dim": dim, "done": 0})
    feats = np.lib.format.open_memmap(cache / f"{split}.npy", mode="w+", dtype=np.float32, shape=(n, *shape))
    labels = np.lib.format.open_memmap(
        cache / f"{split}.labels.npy", mode="w+", dtype=label_dtype, shape=(n, *label_shape)
    )
    return feats, labels


def _write_meta(cache: Path, split: str, meta: dict) -> None:
    tmp = cache / f".{split}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, cache / f"{split}.json")
