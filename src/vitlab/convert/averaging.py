"""The element-wise mean of checkpoints' weights (`python -m vitlab.average`), by timm's rule (avg_checkpoints.py):
every tensor of the networks, parameters and buffers alike, summed in float64, divided by the count, and cast back
(timm casts to float32, clamped to its range; here each to its own dtype, clamped to that dtype's range, so bf16 or
fp16 weights stay so and integer buffers are rounded). The metric bookkeeping a vitlab checkpoint also holds (running
sums, the best score so far) is no weight and is left out; a module loading the result starts it fresh.

Which weights: each checkpoint's `state_dict` (the set its monitor chose: the EMA's where callbacks=ema kept it), and
the other set a callbacks=ema checkpoint carries beside it (`current_model_state` or `average_model_state`), averaged
too where every checkpoint carries it; `use_ema`: the EMA weights of every checkpoint (timm's default, --no-use-ema
otherwise) become the weights averaged.

Which checkpoints: a list (`ckpt_paths`), or a run's `top_k` best by the metric its BestCheckpoint monitored (each
kept file's own score, as Lightning recorded it when saving it: `best_checkpoints`). A file or a directory of shards
(trainer=fsdp's save_distributed_checkpoint=true) alike (weights.read_checkpoint gathers the shards)."""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]
# The keys of a callbacks=ema checkpoint that hold the other set of weights (training.callbacks.ema).
EMA_BESIDE = "average_model_state"  # the EMA, beside raw weights (the monitor chose the raw ones)
RAW_BESIDE = "current_model_state"  # the raw weights, beside the EMA's (the monitor chose the EMA)
# What a checkpoint holds for resuming training, which an average of several has no single value of.
TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "rank_states", "averaging_state")


def mean_state_dict(sds: list[StateDict], names: list[str] | None = None) -> StateDict:
    """The element-wise mean of state dicts of one architecture (check_compatible first): timm's float64 sum and
    division, each tensor cast back to its dtype within that dtype's range."""
    check_compatible(sds, names or [str(i) for i in range(len(sds))])
    out = {}
    for key, first in sds[0].items():
        total = first.detach().to(torch.float64).clone()
        for sd in sds[1:]:
            total += sd[key].detach().to(torch.float64)
        total /= len(sds)
        info = torch.finfo(first.dtype) if first.is_floating_point() else torch.iinfo(first.dtype)
        total = total.clamp(info.min, info.max)
        out[key] = (total if first.is_floating_point() else total.round()).to(first.dtype)
    return out


def check_compatible(sds: list[StateDict], names: list[str]) -> None:
    """The same keys with the same shapes in every state dict, or one line naming the first that differs."""
    first = sds[0]
    for sd, name in zip(sds[1:], names[1:], strict=True):
        if missing := [k for k in first if k not in sd] or [k for k in sd if k not in first]:
            has = names[0] if missing[0] in first else name
            raise UserError(
                f"checkpoints {names[0]!r} and {name!r} are not of one architecture: key {missing[0]!r} is only in "
                f"{has!r}; average checkpoints of one model"
            )
        for key, value in first.items():
            if sd[key].shape != value.shape:
                raise UserError(
                    f"checkpoints {names[0]!r} and {name!r} are not of one architecture: {key} is "
                    f"{tuple(value.shape)} in one and {tuple(sd[key].shape)} in the other; average checkpoints of one "
                    "model"
                )


def network_weights(state: StateDict, prefixes: tuple[str, ...]) -> StateDict:
    """The networks' tensors of a vitlab state dict (model.*, an objective's decoder.* ...), not the metrics'."""
    return {k: v for k, v in state.items() if k.startswith(prefixes)}


def _prefixes(ckpt: dict[str, Any]) -> tuple[str, ...]:
    """The networks' prefixes of a checkpoint: `model.` and whatever else is not metric bookkeeping (the module's
    metrics and the best score: *_metrics.*, val_*_best.*)."""
    tops = {k.split(".")[0] for k in ckpt["state_dict"]}
    return tuple(f"{t}." for t in sorted(tops) if not t.endswith(("_metrics", "_best")))


def ema_weights(ckpt: dict[str, Any]) -> StateDict | None:
    """A callbacks=ema checkpoint's EMA weights: beside its weights, or its weights themselves; None without EMA."""
    if EMA_BESIDE in ckpt:
        return ckpt[EMA_BESIDE]
    return ckpt["state_dict"] if RAW_BESIDE in ckpt else None


def average_checkpoints(
    paths: list[str], use_ema: bool = False, read: Mapping[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One checkpoint of the mean of `paths`' weights (the module docstring says which), with the first checkpoint's
    hyper-parameters (model, data, class names) and without their training state: evaluated, exported, predicted
    with, or fine-tuned from (model.pretrained=<file>) as any other checkpoint; `averaged` says where it came from.
    `read`: checkpoints the command has read already, by path (each file is read once)."""
    ckpts = [(read or {}).get(p) or read_checkpoint(p) for p in paths]
    prefixes = _prefixes(ckpts[0])
    if use_ema:
        missing = [p for p, c in zip(paths, ckpts, strict=True) if ema_weights(c) is None]
        if missing:
            raise UserError(
                f"use_ema=true averages EMA weights, and checkpoint {missing[0]!r} holds none (it was trained without "
                "callbacks=ema); use_ema=false averages the weights the checkpoints hold"
            )
        chosen = [network_weights(ema_weights(c), prefixes) for c in ckpts]
    else:
        chosen = [network_weights(c["state_dict"], prefixes) for c in ckpts]
    out = {k: v for k, v in ckpts[0].items() if k not in (*TRAINING_STATE, EMA_BESIDE, RAW_BESIDE)}
    out["state_dict"] = mean_state_dict(chosen, [str(p) for p in paths])
    for beside in (EMA_BESIDE, RAW_BESIDE):  # the other set, where every checkpoint carries the same kind
        if not use_ema and all(beside in c for c in ckpts):
            out[beside] = mean_state_dict([network_weights(c[beside], prefixes) for c in ckpts])
    out["averaged"] = {
        "checkpoints": [str(Path(p).resolve()) for p in paths],
        "use_ema": use_ema,
        "rule": "element-wise mean in float64, cast back (timm avg_checkpoints.py)",
        "from_epochs": [c.get("epoch") for c in ckpts],
    }
    return out


def monitor_of(ckpt: dict[str, Any]) -> tuple[str, str, float | None] | None:
    """(monitored metric, mode, this checkpoint's score) of the BestCheckpoint state a checkpoint carries."""
    for key, state in (ckpt.get("callbacks") or {}).items():
        if key.startswith("BestCheckpoint{") and state.get("monitor"):
            mode = ast.literal_eval(key[len("BestCheckpoint") :]).get("mode", "max")
            score = state.get("current_score")
            return state["monitor"], mode, None if score is None else float(score)
    return None


def best_checkpoints(run_dir: str | os.PathLike, top_k: int) -> list[tuple[str, float, dict[str, Any]]]:
    """The `top_k` best checkpoints a training run kept, by the metric it monitored ((path, score, the checkpoint as
    read), best first); refused in one line where the run kept fewer (and how to keep more). Each file is read once
    (memory-mapped: its tensors are paged in when averaged); a directory of shards, whose metadata alone is read to
    rank it, is gathered whole once chosen."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        raise MissingFileError(f"run_dir {str(run_dir)!r} holds no checkpoints/ (is it a vitlab.train run directory?)")
    kept, metric = [], None
    for path in sorted(folder.iterdir()):
        ours = path.suffix == ".ckpt" or is_sharded_checkpoint(path)
        if path.name in ("last.ckpt", "interrupted.ckpt") or not ours:  # (the latest, not a best)
            continue
        ckpt = read_checkpoint(path, weights=False)
        found = monitor_of(ckpt)
        if found is not None and found[2] is not None:
            metric = found[:2]
            kept.append((str(path), found[2], ckpt))
    if len(kept) < top_k:
        raise UserError(
            f"top_k {top_k} is more than the {len(kept)} best checkpoint{'s' * (len(kept) != 1)} run_dir "
            f"{str(run_dir)!r} kept{f' (by {metric[0]})' if metric else ''}: give top_k <= {len(kept)}, or train with "
            f"callbacks.model_checkpoint.save_top_k={top_k} (or more) to keep more"
        )
    kept.sort(key=lambda t: t[1], reverse=metric[1] == "max")
    log.info("run %s: its %d best checkpoints by %s (%s): %s", run_dir, top_k, metric[0], metric[1],
             ", ".join(f"{Path(p).name} {s:.4g}" for p, s, _ in kept[:top_k]))  # fmt: skip
    return [(p, s, read_checkpoint(p) if is_sharded_checkpoint(p) else c) for p, s, c in kept[:top_k]]
