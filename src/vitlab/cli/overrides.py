"""The command line's overrides, checked before Hydra composes them (vitlab.cli.startup.prepare): a key given twice
(Hydra keeps the last without a word: an unquoted brace pattern is one argument a shard in the shell), a `+key` at
the top level that no command reads (Hydra adds it, and it does nothing), and a value whose characters Hydra's
override grammar reads as its own, for which the error says how to quote it."""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitlab.utils.errors import fail

# What Hydra's override grammar reads as its own in an unquoted value (besides any character outside ASCII).
GRAMMAR = ",()[]{}='\""


def _parsed(overrides: list[str]) -> list[Any] | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None  # Hydra reports a malformed override itself (quoting_hint says how to quote it)


def refuse_repeated(overrides: list[str]) -> None:
    """A key (or config group) given twice: Hydra would keep the last silently."""
    seen: dict[str, str] = {}
    for o in _parsed(overrides) or []:
        if o.is_delete():
            continue
        key = o.get_key_element()
        if key in seen:
            fail(
                f"{seen[key]} and {o.input_line}: {key} is given twice and only the last would count; give it once "
                "(a brace pattern left unquoted, data.urls=/data/train-{0..9}.tar, is one argument a shard in the "
                """shell: quote it for the shell and for Hydra, 'data.urls="/data/train-{0..9}.tar"')"""
            )
        seen[key] = o.input_line


def refuse_unread_keys(config_name: str, overrides: list[str], groups: list[str], compose: Callable) -> None:
    """`+key=value` (or `++key=`) at the top level, where the command has no such key: Hydra adds it and no command
    reads it (`+max_epochs=1` trained the default 300 epochs). A config group is refused elsewhere
    (config_tree.refuse_unread_groups); `compose(overrides)` gives the config the others make, to point at the key
    that was meant."""
    from vitlab.cli.config_tree import config_dir, user_config_dir

    own = set(OmegaConf.load(config_dir() / f"{config_name}.yaml")) - {"defaults"}
    for o in _parsed(overrides) or []:
        key = o.key_or_group
        if not (o.is_add() or o.is_force_add()) or "." in key or "/" in key or key in groups or key in own:
            continue
        if key in {p.name for p in config_dir().iterdir() if p.is_dir()}:
            continue  # a group this command does not read: refuse_unread_groups says so
        if (mine := user_config_dir()) is not None and (mine / key).is_dir():
            continue  # a group of the user's own tree (--config-dir): its files may set any key (@package _global_)
        rest = [x for x in overrides if x != o.input_line]
        try:
            meant = _meant(key, compose(rest))
        except Exception:  # (the others have an error of their own, said once this one is fixed)
            meant = []
        hint = f"did you mean {' or '.join(f'{m}={o.value()}' for m in meant)}? " if meant else ""
        fail(
            f"{o.input_line}: vitlab.{config_name} has no key {key!r} and would ignore it (a + adds a key no command "
            f"reads); {hint}its top-level keys: {sorted(own)}, its groups: {groups}"
        )


def _meant(key: str, cfg: DictConfig) -> list[str]:
    """The keys one level down (`trainer.max_epochs`) named `key`, else the closest such names."""
    below = [f"{top}.{k}" for top, node in cfg.items() if OmegaConf.is_dict(node) and top != "hydra" for k in node]
    exact = [path for path in below if path.rpartition(".")[2] == key]
    if exact:
        return exact[:3]
    names = difflib.get_close_matches(key, [p.rpartition(".")[2] for p in below], n=2, cutoff=0.7)
    return [p for p in below if p.rpartition(".")[2] in names][:3]


def quoting_hint(overrides: list[str]) -> str | None:
    """For the first override Hydra cannot parse whose value holds its grammar's characters, or any outside ASCII:
    the line saying how to quote it (None where no such override is to blame)."""
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq or _parsed([override]) is not None:
            continue
        odd = sorted({c for c in value if c in GRAMMAR}, key=GRAMMAR.index)
        if value.isascii() and not odd:
            continue
        quoted = shlex.quote(f"{key}={quoted_for_hydra(value)}")
        if not value.isascii():
            return (
                f"{override}: an unquoted value may hold only ASCII characters; quote it for Hydra as well as for the "
                f"shell: {quoted}"
            )
        return (
            f"{override}: Hydra's override grammar reads {' '.join(odd)} in a value as its own; quote the value for "
            f"Hydra as well as for the shell: {quoted}"
        )
    return None


def quoted_for_hydra(value: str) -> str:
    """`value` as typed, quoted as Hydra's grammar takes it: a list's elements each (`[a, b]` -> `["a", "b"]`:
    the list quoted whole would be one string), anything else whole."""
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else None
    if inner is None:
        return _double_quoted(value)
    items = [item.strip() for item in inner.split(",")] if inner.strip() else []
    return "[" + ", ".join(_double_quoted(i.strip("\"'")) if _needs_quotes(i) else i for i in items) + "]"


def _needs_quotes(item: str) -> bool:
    return not item.isascii() or any(c in GRAMMAR for c in item) or item.startswith(":")


def _double_quoted(value: str) -> str:
    """A Hydra double-quoted string: a quote escaped, and so are the backslashes before a quote or at the end."""
    return '"' + re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), value) + '"'


def override_value(argv: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as `key=`, `+key=` or `++key=`), or None."""
    parsed = _parsed([a for a in argv if not a.startswith("-")])
    found = [o for o in parsed or [] if o.key_or_group == key and not o.is_delete()]
    return str(found[-1].value()) if found else None


def refuse_wrong_forms(overrides: list[str], compose: Callable) -> None:
    """A group of keys given a single value (`objective.mixup=0.8`: its code met a float where it iterates over keys,
    a TypeError deep in the build) or a single value given a group (`optim.lr={a: 1}`), refused in one line naming the
    key and its form. `compose(overrides)` gives the config the group choices make (`model=`, `experiment=`), where each
    dotted key's form is read; null stays allowed for a group (it turns a callback or logger off)."""
    parsed = _parsed(overrides) or []
    dotted = [o for o in parsed if "." in o.key_or_group and not o.is_delete() and not o.is_sweep_override()]
    if not dotted:
        return
    try:
        base = compose([x for x in overrides if x not in {o.input_line for o in dotted}])
    except Exception:  # (an error of the others' own, said as they are composed with the rest)
        return
    for o in dotted:
        node, value = _node(base, o.key_or_group), o.value()
        if node is None or node._is_none() or node._is_interpolation() or node._is_missing():
            continue
        if OmegaConf.is_dict(node) and value is not None and not isinstance(value, dict):
            keys = [str(k) for k in node.keys() if not str(k).startswith("_")]
            example = f"{o.key_or_group}.{keys[0]}={o.input_line.partition('=')[2]}" if keys else None
            fail(
                f"{o.input_line}: {o.key_or_group} is a group of keys {keys}, not a single value; set one of them"
                + (f", e.g. {example}" if example else "")
            )
        if not OmegaConf.is_config(node) and isinstance(value, dict):
            fail(
                f"{o.input_line}: {o.key_or_group} takes a single value (its default: {node._value()!r}), not a group "
                "of keys"
            )


def _node(cfg: DictConfig, dotted: str) -> Any:
    """The node at `dotted` in `cfg`, unresolved, or None where there is none."""
    node: Any = cfg
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node.keys():
            return None
        node = node._get_node(part)
    return node
