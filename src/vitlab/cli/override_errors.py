"""A bad override said in one line before Hydra starts (vitlab.cli.startup.prepare): the config composed as the job
will compose it, and Hydra's report, several lines and sometimes misleading, put in other words where it would mislead
(an unknown key names the keys there are, or the objective whose option it is)."""

from __future__ import annotations

import re
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf

from vitlab.cli.config_tree import config_dir, yaml_error
from vitlab.cli.overrides import override_value, quoting_hint, refuse_wrong_forms
from vitlab.utils.errors import config_errors, fail, one_line, user_error


def compose(config_name: str, overrides: list[str], with_hydra: bool = False):
    """The config `config_name` with `overrides`, composed from conf/ (Hydra's node too, `with_hydra`)."""
    import hydra
    import yaml
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return hydra.compose(config_name, overrides=overrides, return_hydra_config=with_hydra)
    except yaml.YAMLError as e:  # a file of the user's --config-dir (or ours) that does not parse
        raise yaml_error(e) from None
    finally:
        GlobalHydra.instance().clear()


def compose_first_job(config_name: str, overrides: list[str]) -> None:
    """A sweep's first job's overrides (each swept key at its first value) composed, a bad override refused in one
    line as a single run's is (Hydra's own report is several lines and exit 1)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports a malformed override itself
    first = []
    for o in parsed:
        try:
            value = next(o.sweep_string_iterator()) if o.is_sweep_override() else None
        except (HydraException, StopIteration, TypeError):
            continue  # a search space (Optuna's interval(...)): the sweeper draws its values
        first.append(o.input_line if value is None else f"{o.get_key_element()}={value}")
    refuse_wrong_forms(first, lambda o: compose(config_name, o))
    try:
        compose(config_name, first)
    except config_errors() as e:
        fail(explain(e, config_name, first))


def explain(e: Exception, config_name: str, overrides: list[str]) -> str:
    """Hydra's report of a bad override in one line, in other words where its own would mislead: an unknown key
    (Hydra's hint, `+key=...`, only leads to a second error) names the keys there are; a value with characters
    the override grammar does not take unquoted says how to quote it."""
    text = str(e)
    if (hint := quoting_hint(overrides)) is not None:
        return hint
    unknown = re.match(r"Could not override '([^']+)'", text)
    if unknown and "not in struct" in str(e.__cause__):
        key = unknown[1]
        parent = key.rpartition(".")[0]
        rest = [o for o in overrides if override_value([o], key) is None]
        try:
            node = compose(config_name, rest)
            there = OmegaConf.select(node, parent) if parent else node
        except config_errors():
            there = None
        if (elsewhere := _objective_option(key, config_name, rest)) is not None:
            return elsewhere
        if (data := _other_data(key, config_name, rest)) is not None:
            return data
        if config_name == "eval" and key.startswith("model.") and (ckpt := override_value(rest, "ckpt_path")):
            return (
                f"{key}: the model of ckpt_path {ckpt!r} is taken from the checkpoint (the one it stores), not set "
                "here; drop it, or evaluate timm's weights instead: model.pretrained=<timm name> data=<name> without "
                "ckpt_path"
            )
        if there is not None:
            keys = sorted(k for k in there if not str(k).startswith("_"))
            more = f"; add another argument of its {there._target_} with +{key}=..." if "_target_" in there else ""
            return f"{key} is not a key of {parent or 'the config'}; its keys: {keys}{more}"
    return one_line(user_error(e) or e)


def _objective_option(key: str, config_name: str, overrides: list[str]) -> str | None:
    """An unknown key that is an option of another objective (conf/objective/), or an objective's option given at the
    top level as before objectives were a config group (`label_smoothing`, `mixup.*`, `distill.*`, `mae.*`): say
    which objective has it and how to give it."""
    if config_name != "train":
        return None
    head, _, rest = key.partition(".")
    option = rest if head in ("objective", "distill", "mae") else key
    others = [o for o in overrides if not o.lstrip("+~").startswith("objective=")]
    try:
        current = compose(config_name, overrides).objective.name
        having = [name for name in sorted(p.stem for p in (config_dir() / "objective").glob("*.yaml"))
                  if _has(compose(config_name, [*others, f"objective={name}"]).objective, option)]  # fmt: skip
    except config_errors():
        return None
    if current in having:
        return f"{key} is an option of the objective (objective={current}): give it as objective.{option}=..."
    if having:  # (every objective that has it: mask_ratio is MAE's and DINO's)
        which = " and ".join(f"objective={name}" for name in having)
        chosen = having[0] if len(having) == 1 else f"<{'|'.join(having)}>"
        return (
            f"{key} is an option of {which}, and this run's objective is {current}: give it as objective={chosen} "
            f"objective.{option}=..."
        )
    return None


def _other_data(key: str, config_name: str, overrides: list[str]) -> str | None:
    """data.<group>.<key> on data whose config has no such group (data.naflex.seq_lens on the digits): Hydra's hint,
    `+data.naflex...`, would only lead to the data module refusing it. Name the data formats that have it."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "data":
        return None
    try:
        node = compose(config_name, overrides, with_hydra=True)
    except config_errors():
        return None
    data, group = node.get("data"), parts[1]
    if data is None or group in data:
        return None
    having = sorted(p.stem for p in (config_dir() / "data").glob("*.yaml") if group in (OmegaConf.load(p) or {}))
    if not having:
        return None
    chosen = node.hydra.runtime.choices.get("data") or "<none>"
    which = ", ".join(f"data={g}" for g in having[:-1]) + (" or " if len(having) > 1 else "") + f"data={having[-1]}"
    return f"{key}: data={chosen} has no data.{group}; it is a key of {which} (the data formats that read it)"


def _has(node: Any, dotted: str) -> bool:
    """Whether `node` has the key `dotted`, its value given or required (`???`: objective=distill's teacher)."""
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node.keys():
            return False
        node = node._get_node(part)
    return True
