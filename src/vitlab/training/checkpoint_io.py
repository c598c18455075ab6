"""Checkpoint IO: every checkpoint written atomically (a Trainer plugin, conf/trainer/default.yaml: trainer.plugins),
and the hyper-parameters of checkpoints written before objectives were objects, read as today's."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from vitlab.utils.atomic import atomic_write


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into a temporary file beside the target, fsync, then rename over the target: a crash or
    a full disk never leaves a truncated or half-written checkpoint where a good one was. A failed write
    raises (torch.save and fsync report it), so the file is not read back: for ViT-B/16 with AdamW that
    would read 1 GB per save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        protocols = get_filesystem(path).protocol
        if "file" not in (protocols if isinstance(protocols, tuple) else (protocols,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores: their own semantics
        atomic_write(path, lambda f: torch.save(checkpoint, f), what="checkpoint")


# The hyper-parameters a checkpoint carried before objectives were objects (up to 23cbadb): the objective's options
# sat beside the model's, MAE's under `mae`, distillation's under `distill` (its type `none` when off).
LEGACY_CLASSIFY = ("label_smoothing", "loss", "bce_target_thresh", "mixup")


def upgrade_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """The `objective` a checkpoint of the old layout trained (nothing for one of today's), to pass to
    ViTModule.load_from_checkpoint beside its stored hyper-parameters (which drop the old keys)."""
    if "objective" in hparams:
        return {}
    if hparams.get("mae") is not None:
        return {"objective": {"name": "mae", **hparams["mae"]}}
    objective = {"name": "classify", **{k: hparams[k] for k in LEGACY_CLASSIFY if k in hparams}}
    distill = hparams.get("distill") or {}
    if distill.get("type", "none") != "none":
        objective |= {**distill, "name": "distill"}
    return {"objective": objective}
