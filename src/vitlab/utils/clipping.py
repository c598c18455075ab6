"""Gradient clipping as the trainer config names it (trainer.gradient_clip_algorithm and its value)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitlab.utils.errors import UserError

# trainer.gradient_clip_algorithm -> what its trainer.gradient_clip_val is.
CLIP_VALUE = {
    "value": "the value each gradient element is clipped to (e.g. 0.5)",
    "norm": "the norm the gradients are clipped to (timm's --clip-grad, e.g. 1.0)",
    "agc": "AGC's clip factor (timm's --clip-grad with --clip-mode agc, e.g. 0.01)",
}


def check_clipping(t: Mapping[str, Any]) -> None:
    """A clipping algorithm without its value would clip nothing (Lightning's value and norm) or cannot run (agc)."""
    algorithm, value = t.get("gradient_clip_algorithm"), t.get("gradient_clip_val")
    if algorithm in CLIP_VALUE and not value:
        raise UserError(
            f"trainer.gradient_clip_algorithm={algorithm} needs trainer.gradient_clip_val, {CLIP_VALUE[algorithm]}, "
            f"not {value!r}: without one nothing is clipped"
        )
