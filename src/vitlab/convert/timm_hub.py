"""timm's names and downloads: which names timm knows (an architecture, with a pretrained tag, or a folder or
Hugging Face repository as timm saves one), what its weights expect of their input, and the weights themselves,
fetched through the hub the one way vitlab downloads (`vitlab.utils.downloads`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vitlab.utils.downloads import downloading, unless_hub_reachable_read_the_cache
from vitlab.utils.errors import MissingFileError, UserError, close_matches

# timm's modules of plain ViTs: `vision_transformer`, `deit` (DeiT's, distilled ones included, and DeiT III's), and
# `naflexvit` (NaFlex: images at their own aspect ratio, model/naflex.py)
TIMM_VIT_MODULES = ("vision_transformer", "deit", "naflexvit")


def timm_vit_names() -> list[str]:
    """Every architecture registered in timm's plain-ViT modules (TIMM_VIT_MODULES)."""
    import timm

    return [name for module in TIMM_VIT_MODULES for name in timm.list_models(module=module)]


# timm's module of RoPE ViTs (EVA, EVA02, rope-vit, PE, DINOv3, ...: its Eva class; convert/timm_eva.py)
TIMM_EVA_MODULE = "eva"


def timm_eva_names() -> list[str]:
    """Every architecture registered in timm's eva module."""
    import timm

    return timm.list_models(module=TIMM_EVA_MODULE)


def timm_model_names() -> list[str]:
    """Every architecture `vitlab.create_model` answers: timm's plain ViTs and its eva module's."""
    return timm_vit_names() + timm_eva_names()


# Where timm.create_model reads a model from instead of its registry: a folder as timm saves one (config.json
# with the architecture, its arguments and pretrained_cfg, and the weights), or a Hugging Face repository.
TIMM_SOURCES = ("local-dir:", "hf-hub:")


def source_config(name: str) -> tuple[dict, str, dict]:
    """(pretrained_cfg, architecture, model_args) of a `local-dir:` / `hf-hub:` name, read by timm."""
    from timm.models._hub import load_model_config_from_hf, load_model_config_from_path

    source, _, where = name.partition(":")
    if source == "local-dir":
        if not (Path(where) / "config.json").is_file():
            raise MissingFileError(f"{name!r}: {where}/config.json does not exist (a folder as timm saves a model)")
        return load_model_config_from_path(where)
    with from_the_hub(name):
        return load_model_config_from_hf(where)


def timm_architecture(name: str) -> str:
    """The registered architecture `name` builds: the name without its pretrained tag, or the architecture in
    the config.json of a `local-dir:` / `hf-hub:` source."""
    return source_config(name)[1] if name.startswith(TIMM_SOURCES) else name.partition(".")[0]


# What a model's pretrained configuration says of its input (timm's keys): the run's preprocessing.
PREPROCESSING = ("mean", "std", "crop_pct", "crop_mode", "interpolation", "input_size")


def timm_pretrained_cfg(name: str) -> dict[str, Any]:
    """What timm's weights `name` (an architecture, or with a pretrained tag) expect of their input, from timm's
    registry (nothing downloaded): mean, std, crop_pct, crop_mode, interpolation, input_size (C, H, W), and
    the tag (timm's default weights when `name` has none). A value the config leaves out (a saved folder's may) is
    the one timm's resolve_data_config puts in its place."""
    from timm.models import get_pretrained_cfg

    check_timm_name(name)
    if name.startswith(TIMM_SOURCES):  # the folder's or repository's own config.json
        cfg, tag = source_config(name)[0], name
    else:
        found = get_pretrained_cfg(name)
        if found is None:
            raise UserError(f"timm has no pretrained configuration for {name!r}")
        cfg, tag = found.to_dict(), f"{name.partition('.')[0]}.{found.tag}"
    return {key: cfg.get(key) or default for key, default in timm_data_defaults().items()} | {"tag": tag}


def timm_data_defaults() -> dict[str, Any]:
    """resolve_data_config's values where a pretrained config gives none (timm.data.config, timm.data.constants)."""
    from timm.data.constants import DEFAULT_CROP_MODE, DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    return {
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "crop_pct": DEFAULT_CROP_PCT,
        "crop_mode": DEFAULT_CROP_MODE,
        "interpolation": "bicubic",
        "input_size": (3, 224, 224),
    }


def check_timm_name(name: str, weights: bool = True) -> None:
    """A timm model name, optionally with a pretrained tag (`vit_base_patch16_224.augreg_in21k`), that
    timm knows; otherwise a one-line error with the closest names. A tag must have weights when `weights` is asked
    for; without, it need only be registered (`test_vit4.r160_in1k`: a configuration without published weights)."""
    import timm
    from timm.models._registry import get_arch_pretrained_cfgs

    if name.startswith(TIMM_SOURCES):
        name = timm_architecture(name)  # a folder without config.json, or an unreachable repository, fails here
    arch, _, tag = name.partition(".")
    if not timm.is_model(arch):
        close = close_matches(arch, timm.list_models())
        hint = f"did you mean {close}? " if close else ""
        raise UserError(
            f"{name!r} is neither a weights file nor a timm model name; {hint}"
            "timm.list_models('vit_*') lists timm's ViTs"
        )
    if tag and not weights:  # the registered tags, full names ('test_vit4.r160_in1k'), with weights or not
        if name not in (registered := list(get_arch_pretrained_cfgs(arch))):
            raise UserError(f"timm has no tag {tag!r} for {arch}; it has {registered[:6]}")
        return
    if tag and name not in timm.list_pretrained(f"{arch}.*"):
        raise UserError(f"timm has no pretrained weights {name!r}; it has {timm.list_pretrained(f'{arch}.*')[:6]}")


@contextlib.contextmanager
def from_the_hub(name: str) -> Iterator[None]:
    """Downloads from the Hugging Face hub: the hub looked for first (an unreachable hub reads the cache alone, at
    once), and "no network" the one-line OfflineError naming `name` and the ways out."""
    unless_hub_reachable_read_the_cache()
    with downloading(offline_message(name)):
        yield


def offline_message(name: str) -> str:
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return (
        f"cannot fetch timm weights {name!r}: no network and not in the Hugging Face cache ({cache}); "
        "run once online, or give a local .safetensors/.pth file or a timm folder (local-dir:<folder>) instead"
    )


def timm_pretrained_state_dict(name: str) -> dict[str, torch.Tensor]:
    """timm's pretrained weights for a registered name, as timm itself loads them (its checkpoint
    filter converts original JAX/npz layouts), downloaded through the Hugging Face hub and cached."""
    import timm

    check_timm_name(name)
    with from_the_hub(name):
        model = timm.create_model(name, pretrained=True)
    return model.state_dict()
