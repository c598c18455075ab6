"""The one way a config's values are checked (`check_arguments`): against the types a target declares, its
constructor's parameters or a schema (a TypedDict: each command's top-level keys, its groups nested), with ranges
as `Annotated` constraints (`PositiveInt`, `Fraction`, annotated_types' Ge/Gt/Interval/MinLen), judged by pydantic;
a refusal names the type as a user reads it (`describe`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Gt, Interval, MinLen

from vitlab.utils.errors import UserError

T = TypeVar("T")

# Ranges as types: a schema (or a constructor) annotated with these is range-checked by check_arguments.
PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveNumber = Annotated[float, Gt(0)]
NonNegativeNumber = Annotated[float, Ge(0)]
Fraction = Annotated[float, Interval(ge=0, le=1)]
OpenUnit = Annotated[float, Interval(gt=0, lt=1)]  # a probability threshold: (0, 1)
Seed = Annotated[int, Interval(ge=0, le=2**32 - 1)]  # what Lightning's seed_everything (numpy's) takes
NonEmpty = Annotated[list[T], MinLen(1)]  # NonEmpty[PositiveInt]: a list of one or more


@dataclasses.dataclass(frozen=True)
class Said:
    """How `describe` names a type whose constraint it cannot put in words (a string of a given form)."""

    text: str


def _byte_size() -> Any:
    from pydantic import StringConstraints

    # LitData's sizes (litdata.utilities.format): a number and a unit, read case-blind
    units = "tb|gb|mb|kb|t|g|m|k|b"
    return Annotated[str, StringConstraints(pattern=rf"(?i)^\s*\d+(\.\d*)?\s*({units})\s*$"), Said(
        "a size such as 64MB (a number and one of b, kb, mb, gb, tb)")]  # fmt: skip


ByteSize = _byte_size()


def check_arguments(target: Any, values: Mapping[str, Any], group: str, narrower: Any = None) -> None:
    """Each of `values` has the type `target` (a class, a function, or a TypedDict schema) declares for its parameter
    or key of that name, or a one-line UserError names the key, the value and the type: `data.batch_size 'abc' must
    be an integer`, `knn.k [0] must be a non-empty list of integers >= 1`. Ranges are part of the type (`Annotated`
    constraints); `narrower`, a function or TypedDict, replaces the types of the parameters it names (a library's
    documented ranges that its own signature leaves out). A value for a TypedDict-typed key is checked key by key
    (`knn.temperature`). Parameters passed on through **kwargs are looked up in the base classes. Values that are
    themselves configs of something to build (a `_target_`) are checked on their own; undeclared parameters are left
    to the target. pydantic judges; a value it would have to convert ('5' for an integer, true for an integer, 8.5
    for an integer, nan for a number) is refused, as the target would receive it unconverted."""
    hints, open_ended = _parameter_hints(target)
    if narrower is not None:
        hints = hints | _parameter_hints(narrower)[0]
    prefix = group + "." if group else ""
    for key, value in values.items():
        if key not in hints and not open_ended and not key.startswith("_"):
            if typing.is_typeddict(target):
                raise UserError(f"{prefix}{key} is not a key of {group or 'the config'}; its keys: {sorted(hints)}")
            name = getattr(target, "__name__", str(target))
            raise UserError(f"{prefix}{key} is not an argument of {name}; its arguments: {sorted(hints)}")
        hint = hints.get(key, Any)
        if hint is Any or key.startswith("_") or _is_node(value):
            continue
        if typing.is_typeddict(hint) and isinstance(value, Mapping):
            check_arguments(hint, value, prefix + key)
        elif not _fits(value, hint):
            raise UserError(f"{prefix}{key} {value!r} must be {describe(hint)}")


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
    if typing.is_typeddict(target):  # a schema: its keys, all of them (the YAML file has each)
        return typing.get_type_hints(target, include_extras=True), False
    hints: dict[str, Any] = {}
    for owner in target.__mro__ if inspect.isclass(target) else (target,):
        init = owner.__dict__.get("__init__") if inspect.isclass(target) else owner
        if init is None or init is object.__init__:
            continue
        try:
            found = typing.get_type_hints(init, include_extras=True)
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

    return TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False))


def _fits(value: Any, hint: Any) -> bool:
    from pydantic import ValidationError

    try:
        out = _adapter(hint).validate_python(value)
    except ValidationError:
        return False
    except Exception:  # a type pydantic cannot check: the target will
        return True
    return _unconverted(value, out)


def _unconverted(value: Any, out: Any) -> bool:
    """pydantic's result `out` is `value` itself, not a conversion of it (an int where a number is asked for, and a
    list where a tuple is, are taken as they are)."""
    if isinstance(value, (list, tuple)) and isinstance(out, (list, tuple)):
        return len(value) == len(out) and all(map(_unconverted, value, out))
    if isinstance(value, Mapping) and isinstance(out, Mapping):
        return all(k in out and _unconverted(v, out[k]) for k, v in value.items())
    return type(value) is type(out) or (type(value), type(out)) == (int, float)


def describe(hint: Any) -> str:
    """A type as a user reads it: `an integer or null`, `one of 'a', 'b'`, `an integer >= 1`, `a number in [0, 1]`,
    `a non-empty list of integers >= 1`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        said = [m.text for m in args[1:] if isinstance(m, Said)]
        if said:
            return said[0]
        base, bounds = describe(args[0]), _bounds(args[1:])
        if any(isinstance(m, MinLen) and m.min_length > 0 for m in args[1:]):
            base = base.replace("a list", "a non-empty list", 1)
        return f"{base} {bounds}" if bounds else base
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
        items = [a for a in args if a is not Ellipsis]
        return f"a list of {_plural(describe(items[0]))}" if len(set(items)) == 1 and items[0] is not Any else "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    if typing.is_typeddict(hint):
        return "a mapping"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _bounds(metadata: tuple) -> str:
    """annotated_types' Ge/Gt/Le/Lt/Interval as maths writes them: `>= 1`, `in (0, 1]`."""
    low = high = None  # (value, open)
    for m in metadata:
        for name, value in ((n, getattr(m, n, None)) for n in ("ge", "gt", "le", "lt")):
            if value is not None and name[0] == "g":
                low = (value, name == "gt")
            elif value is not None:
                high = (value, name == "lt")

    def num(v: float) -> str:
        return str(v) if isinstance(v, int) else f"{v:g}"

    if low and high:
        return f"in {'(' if low[1] else '['}{num(low[0])}, {num(high[0])}{')' if high[1] else ']'}"
    if low:
        return f"{'>' if low[1] else '>='} {num(low[0])}"
    return f"{'<' if high[1] else '<='} {num(high[0])}" if high else ""


def _plural(described: str) -> str:
    """`an integer >= 1` -> `integers >= 1`: the items of a list."""
    for one, many in PLURALS:
        described = described.replace(one, many)
    return described


PLURALS = (("an integer", "integers"), ("a number", "numbers"), ("a string", "strings"),
           ("true or false", "true or false values"), ("a list", "lists"), ("a mapping", "mappings"))  # fmt: skip
