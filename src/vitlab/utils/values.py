"""What the config dataclasses of vitlab share (OptimConfig, MixupConfig, the transform and benchmark
settings; ViTConfig has its own): built from a plain mapping with unknown keys refused, checks that name the field
as the user writes it (`optim.lr`), and the plain data they are saved as. No Hydra here: Python callers get the same
defaults and the same checks as the command line, and a test keeps each YAML file equal to its dataclass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from vitlab.utils.errors import UserError

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, group: str) -> T:
    """`cls(**values)`, refusing keys `cls` does not have in one line that lists those it has."""
    values = dict(values or {})
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise UserError(f"unknown {group} key(s) {unknown}; allowed: {sorted(names)}")
    return cls(**values)


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool, not nan or inf)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_range(key: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """`value` must be a number in the interval; the message shows the interval as written in maths."""
    ok = (
        is_number(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise UserError(f"{key} {value!r} must be in {interval}")


def check_at_least(key: str, value: Any, low: float = 0, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_number(value) or value < low:
        raise UserError(f"{key} {value!r} must be a number >= {low:g}{' or null' if optional else ''}")


def to_dict(obj: Any) -> dict[str, Any]:
    """A config dataclass as plain data (tuples as lists, nested ones too), for checkpoints and YAML."""

    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v

    return {k: plain(v) for k, v in dataclasses.asdict(obj).items()}
