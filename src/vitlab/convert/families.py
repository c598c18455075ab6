"""The families of weights files `read_weights` (convert/weights.py) recognises, as a table of (recogniser, reader)
rows as the model's layers are tables: vitlab's training checkpoints, DINO's, DINOv2's and DINOv3's released weights.
A file of none of them is timm's keys, or MAE's (convert/mae.py: split_decoder). A new family is one row here and its
reader, beside its own keys (convert/dino_weights.py, convert/dinov3.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vitlab.convert import dino_weights as dino
from vitlab.convert.dinov3 import from_dinov3, is_dinov3

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


class Family(NamedTuple):
    """A family of weights files: what a file of it is called (read_weights' third value, the logs'), how one is
    recognised, and how it is read as (the ViT's state dict in timm's keys, an MAE decoder's in MAE's, or empty)."""

    what: str
    recognise: Callable[[Any], bool]
    read: Callable[[Any, Any], tuple[StateDict, StateDict]]


def _is_vitlab(sd: StateDict) -> bool:
    return any(k.startswith("model.") for k in sd)


def _from_vitlab(sd: StateDict, path: Any) -> tuple[StateDict, StateDict]:
    """A vitlab training checkpoint's networks (`model.*`, `decoder.*`), its other entries left out and said so (an
    objective=dino run's `model.*` is its teacher)."""
    left = sorted({k.split(".")[0] for k in sd if not k.startswith(("model.", "decoder."))})
    if left:
        log.info("%s: took its network (model.*); left out %s", path, ", ".join(f"{k}.*" for k in left))
    decoder = {k[len("decoder.") :]: v for k, v in sd.items() if k.startswith("decoder.")}
    return {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}, decoder


# First match wins. DINO's training checkpoints are recognised whole (their teacher is
# under 'teacher'), the others once the state dict is taken out of its container.
WHOLE_FILE_FAMILIES = [
    Family(
        "DINO checkpoint", dino.is_dino_training_checkpoint, lambda obj, path: (dino.teacher_backbone(obj, path), {})
    ),
]
FAMILIES = [
    Family("vitlab checkpoint", _is_vitlab, _from_vitlab),
    Family("DINOv2 weights", dino.is_dinov2, lambda sd, path: (dino.from_dinov2(sd), {})),  # convert/dino_weights.py
    Family("DINOv3 weights", is_dinov3, lambda sd, path: (from_dinov3(sd, path), {})),  # convert/dinov3.py
]
