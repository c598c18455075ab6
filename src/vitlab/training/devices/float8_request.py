"""Which precisions are float8 (`trainer.precision=float8`, `float8-rowwise`) and whether the GPUs in use can run them
(`check_float8`), without torch or Lightning: the command refuses float8 on a CPU at once (cli/schemas.py's
check_train), and training/devices/float8.py builds what the names ask for."""

from __future__ import annotations

from typing import Any

from vitlab.utils.errors import UserError

# trainer.precision -> torchao's recipe name
FLOAT8_PRECISIONS = {"float8": "tensorwise", "float8-rowwise": "rowwise"}
FLOAT8_CAPABILITY = (8, 9)


def is_float8(precision: Any) -> bool:
    return str(precision) in FLOAT8_PRECISIONS


def check_float8(precision: str, gpus: list[tuple[str, tuple[int, int]]]) -> None:
    """A one-line UserError where `precision` (float8, float8-rowwise) cannot run on the GPUs in use, given as
    (name, compute capability): none, or one older than 8.9; or where torchao is not installed."""
    need = f"trainer.precision={precision} needs CUDA GPUs of compute capability 8.9 or later (Ada, Hopper, Blackwell)"
    if not gpus:
        raise UserError(f"{need}; this run uses none: use trainer.precision=bf16-mixed (or 32-true) here")
    old = sorted({f"{name} ({c[0]}.{c[1]})" for name, c in gpus if tuple(c) < FLOAT8_CAPABILITY})
    if old:
        raise UserError(f"{need}; {', '.join(old)} has not: use trainer.precision=bf16-mixed")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise UserError(f"trainer.precision={precision} needs torchao: pip install 'vitlab[float8]'") from e
