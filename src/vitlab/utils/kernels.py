"""Which kernels a model's step runs, as a config names them: torch.compile's modes (`compile`) and the backends of
torch's scaled_dot_product_attention (`sdpa_backend`)."""

from __future__ import annotations

import typing
from typing import Literal

from vitlab.utils.errors import UserError

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "regional"]
COMPILE_MODES = typing.get_args(CompileMode)
# torch's scaled_dot_product_attention kernels (training.devices.hardware.use_sdpa_backend): auto is torch's choice
SdpaBackend = Literal["auto", "flash", "efficient", "cudnn", "math"]
SDPA_BACKENDS = typing.get_args(SdpaBackend)


def compile_mode(value: bool | str | None) -> str | None:
    """The torch.compile mode of a `compile` setting: false/null = none, true = "default", or a mode name.
    `reduce-overhead` captures CUDA graphs: one launch per compiled region instead of one per kernel, for
    small models whose GPU step is launch-bound (the digits default). `regional` (default mode) compiles one
    transformer block and reuses its code for every block (training.objectives.objective.Objective.compile)."""
    if value is None or value is False:
        return None
    if value is True or value == "regional":
        return "default"
    if value not in COMPILE_MODES:
        raise UserError(f"compile {value!r} is not one of false, true, {', '.join(COMPILE_MODES)}")
    return value
