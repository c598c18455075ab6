"""What the config dataclasses of vitlab share (OptimConfig, MixupConfig, the transform and benchmark
settings; ViTConfig has its own): built from a plain mapping with unknown keys refused, and checks that
name the field as the user writes it (`optim.lr`). No Hydra here: Python callers get the same defaults
and the same checks as the command line, and a test keeps each YAML file equal to its dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
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


def check_arguments(target: Any, values: Mapping[str, Any], group: str) -> None:
    """Each of `values` has the type `target` (a class or function) declares for its parameter of that name, or
    a one-line UserError names the key, the value and the type: `data.batch_size 'abc' must be an integer`.
    Parameters passed on through **kwargs are looked up in the base classes. Values that are themselves
    configs of something to build (a `_target_`) are checked on their own; undeclared parameters are left to
    the target. pydantic judges; a value it would have to convert ('5' for an integer, true for an integer,
    8.5 for an integer) is refused, as the target would receive it unconverted."""
    hints, open_ended = _parameter_hints(target)
    for key, value in values.items():
        if key not in hints and not open_ended and not key.startswith("_"):
            name = getattr(target, "__name__", str(target))
            raise UserError(
                f"{group + '.' if group else ''}{key} is not an argument of {name}; its arguments: {sorted(hints)}"
            )
        hint = hints.get(key, Any)
        if hint is Any or key.startswith("_") or _is_node(value):
            continue
        if not _fits(value, hint):
            raise UserError(f"{group + '.' if group else ''}{key} {value!r} must be {describe(hint)}")


def _is_node(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and "_target_" in value
        or (isinstance(value, list) and any(_is_node(v) for v in value))
    )


@functools.cache
def _parameter_hints(target: Any) -> tuple[dict[str, Any], bool]:
    """The parameters of `target` with their types (Any where none is declared), and whether it takes any
    keyword besides (a **kwargs that no base class's __init__ in its MRO takes up)."""
    hints: dict[str, Any] = {}
    for owner in target.__mro__ if inspect.isclass(target) else (target,):
        init = owner.__dict__.get("__init__") if inspect.isclass(target) else owner
        if init is None or init is object.__init__:
            continue
        try:
            found = typing.get_type_hints(init)
        except Exception:  # an annotation that names what its module imports only for type checkers
            found = {}
        params = inspect.signature(init).parameters
        for name, p in params.items():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self":
                hints.setdefault(name, found.get(name, Any))
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return hints, False  # nothing is passed further up
    return hints, True


@functools.cache
def _adapter(hint: Any):
    from pydantic import ConfigDict, TypeAdapter

    return TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))


def _fits(value: Any, hint: Any) -> bool:
    from pydantic import ValidationError

    try:
        out = _adapter(hint).validate_python(value)
    except ValidationError:
        return False
    except Exception:  # a type pydantic cannot check: the target will
        return True
    kinds = (type(value), type(out))
    return kinds[0] is kinds[1] or kinds == (int, float) or (isinstance(value, list) and isinstance(out, tuple))


def describe(hint: Any) -> str:
    """A type as a user reads it: `an integer or null`, `one of 'a', 'b'`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        literals = [a for m in args if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
        parts = [describe(typing.Literal[tuple(literals)])] if literals else []
        parts += [describe(m) for m in args if typing.get_origin(m) is not typing.Literal]
        if "a number" in parts and "an integer" in parts:  # int | float: any number
            parts.remove("an integer")
        return " or ".join(dict.fromkeys(parts))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args) if len(args) > 1 else repr(args[0])
    if origin in (list, tuple) or hint in (list, tuple) or str(origin).endswith("Sequence'>"):
        return "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def to_dict(obj: Any) -> dict[str, Any]:
    """A config dataclass as plain data (tuples as lists, nested ones too), for checkpoints and YAML."""

    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v

    return {k: plain(v) for k, v in dataclasses.asdict(obj).items()}


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(value: bool | str | None) -> str | None:
    """The torch.compile mode of a `compile` setting: false/null = none, true = "default", or a mode name.
    `reduce-overhead` captures CUDA graphs: one launch per compiled region instead of one per kernel, for
    small models whose GPU step is launch-bound (the digits default)."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if value not in COMPILE_MODES:
        raise UserError(f"compile {value!r} is not one of false, true, {', '.join(COMPILE_MODES)}")
    return value
