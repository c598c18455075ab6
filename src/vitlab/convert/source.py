"""Weights have one door: whatever names them (a timm name, with or without its tag; a `local-dir:` folder or an
`hf-hub:` repository as timm saves them; a weights file: timm's, MAE's, DINO's or DINOv2's, a vitlab checkpoint, one
file or a directory of shards) is resolved once by `resolve` into one value, `Weights`: the architecture (timm's, at
the run's size, channels, classes and regularisation, with the fields the user set where the weights can serve them),
the preprocessing the weights expect, where they came from, the rule that resamples their position table, and their
tensors, read on first use. train, eval and predict resolve `model.pretrained` at the top and pass the value down;
nothing below asks timm or the file again. `load_timm_weights(model, source)` is the two steps in one call."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from torch import nn

from vitlab.convert import dino_weights as dino
from vitlab.convert.timm_args import RUN_FIELDS, config_from_args, timm_model_args
from vitlab.convert.timm_hub import (
    PREPROCESSING,
    TIMM_SOURCES,
    source_config,
    timm_architecture,
    timm_pretrained_cfg,
    timm_pretrained_state_dict,
)
from vitlab.convert.weights import StateDict, expected_shapes, is_weights_file, load_state, read_file, read_weights
from vitlab.model import ViT, ViTConfig
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError

# Parts a pretrained encoder need not have: a new head (and fc_norm, an attention pool) starts fresh, and its final
# norm may be dropped (MAE's fine-tuning with average pooling).
FRESH = ("head.", "head_dist.", "fc_norm.", "attn_pool.")


class Tensors(NamedTuple):
    """What a source's weights hold: the ViT's state dict, an MAE decoder's in MAE's names (empty if none), and the
    source as logs and errors name it ("timm's weights of <name>", "MAE checkpoint '<path>'")."""

    encoder: StateDict
    decoder: StateDict
    origin: str


@dataclasses.dataclass(frozen=True)
class Weights:
    """One resolved weights source (`resolve`). A file carries its tensors alone: its architecture is the run's model
    config and it has no preprocessing (`arch`, `preprocessing`, `timm_name` None)."""

    source: str  # as given: a timm name, local-dir:/hf-hub:, or a path
    is_file: bool = True  # a weights file (the rest None), or a timm source
    preprocessing: dict[str, Any] | None = None  # timm's PREPROCESSING keys and the weights' `tag`
    arch: dict[str, Any] | None = None  # ViTConfig fields: timm's architecture at the run's fields, `kept` on top
    kept: dict[str, Any] = dataclasses.field(default_factory=dict)  # the user's fields kept over timm's architecture
    timm_name: str | None = None  # the registered architecture timm builds for `source`
    label_names: tuple[str, ...] | None = None  # a saved folder's class names (its config.json)
    # How a position table of another grid is resampled by the code that made the weights (model/posemb.py, the
    # model's pos_embed_resample): "dino" for DINO's training checkpoints and DINOv2's files without registers.
    posemb_rule: str = "timm"

    @functools.cached_property
    def tensors(self) -> Tensors:
        """The tensors, read (or downloaded through timm) once, on first use: a run refused before it loads them
        never reads them."""
        if self.is_file:
            encoder, decoder, kind = read_weights(self.source)
            return Tensors(encoder, decoder, f"{kind} {self.source!r}")
        return Tensors(timm_pretrained_state_dict(self.source), {}, f"timm's weights of {self.source}")

    def load_into(
        self, model: ViT, *, reset_head: bool | None = None, decoder: nn.Module | None = None, resample_patch=False
    ) -> None:
        """The weights into `model` (convert.weights.load_state: every key used, every shape matched, the position
        table resampled); timm's carry their preprocessing into the model's pretrained_cfg."""
        encoder, mae_decoder, origin = self.tensors
        if self.preprocessing is not None:
            pre = self.preprocessing
            model.pretrained_cfg.update({k: pre[k] for k in PREPROCESSING if k != "input_size"}, tag=pre["tag"])
        load_state(model, encoder, mae_decoder, origin, reset_head=reset_head, decoder=decoder,
                   resample_patch=resample_patch)  # fmt: skip


def resolve(
    source: str, *, run: dict[str, Any] | None = None, requested: dict[str, Any] | None = None, resample_patch=False
) -> Weights:
    """`source` as one `Weights` value. A file is only named (its tensors are read on first use). A timm source gives
    its preprocessing (timm's registry, or the folder's config.json), and with `run` (timm keyword arguments: the
    run's RUN_FIELDS; an img_size of None is the weights' own) its architecture at them, the `requested` fields (what
    the user set: the command line, the experiment) kept where the weights can serve them, and refused in one line
    where they cannot (`resample_patch`: patch filters of another size are resampled)."""
    if is_weights_file(source):
        return Weights(source, posemb_rule=_file_posemb_rule(source))
    preprocessing = timm_pretrained_cfg(source)  # (checks the name: one line with the closest names)
    name = timm_architecture(source)
    labels = source_config(source)[0].get("label_names") if source.startswith(TIMM_SOURCES) else None
    arch, kept = None, {}
    if run is not None:
        run = dict(run)
        if run.get("img_size", 0) is None:
            run["img_size"] = list(preprocessing["input_size"][1:])
        requested = requested or {}
        args = timm_model_args(source, **run)  # (captured, not built: an img_size of another patch is named below)
        _check_patch(source, requested.get("patch_size") or args.get("patch_size", 16), run, preprocessing)
        arch = config_from_args(name, args, given=run).to_dict()  # (a run's bad value named, not timm's architecture)
        kept = {k: requested[k] for k in arch if k in requested and k not in RUN_FIELDS}  # in ViTConfig's order
        kept = {k: v for k, v in kept.items() if v != arch[k] and v is not None}
        if kept:
            _check_servable(source, arch, kept, resample_patch)
            arch.update(kept)
    return Weights(source, False, preprocessing, arch, kept, name, tuple(labels) if labels else None)


def _file_posemb_rule(path: str) -> str:
    """The rule of a weights file's position table: the one a vitlab checkpoint's model config carries, or the one
    DINO's and DINOv2's files were made with (dino_weights.posemb_rule); read memory-mapped (the tensors' data
    untouched). A missing or unreadable file says so when it is loaded; a directory of shards is "timm"."""
    import os

    if not os.path.isfile(path):
        return "timm"
    try:
        obj = read_file(path, "weights file")
    except UserError:
        return "timm"
    stored = obj.get("hyper_parameters", {}).get("model", {}) if isinstance(obj, dict) else {}  # a vitlab checkpoint
    rule = stored.get("pos_embed_resample") or dino.posemb_rule(obj)
    return "dino" if rule == "timm" and not stored and dino.is_released_name(path) else rule


def load_timm_weights(
    model: ViT, source: str, *, reset_head: bool | None = None, decoder: nn.Module | None = None, resample_patch=False
) -> None:
    """Load pretrained weights into `model`: `source` is a local file (vitlab's checkpoint, timm's, MAE's, DINO's
    weights), or a timm name (downloaded through timm when online): `resolve(source).load_into(model, ...)`."""
    resolve(source).load_into(model, reset_head=reset_head, decoder=decoder, resample_patch=resample_patch)


def show(value: Any) -> str:
    """A config value as the command line types it (booleans lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_patch(source: str, patch: Any, run: dict, pretrained: dict) -> None:
    (ph, pw), (h, w) = as_hw(patch, "patch_size"), as_hw(run["img_size"], "model.img_size")
    if h % ph or w % pw:
        raise UserError(
            f"model.img_size {run['img_size']} is not a multiple of the patch size {patch} of timm's {source}; "
            f"set model.img_size (its weights were trained at {pretrained['input_size'][-1]})"
        )


def _check_servable(source: str, arch: dict, yours: dict, resample_patch: bool) -> None:
    """Refuse, in one line, the fields of `yours` with which the model no longer fits the weights of `arch` (each
    tried alone on timm's architecture; one that is no valid ViT there, such as class_token=false under token
    pooling, counts as not served)."""
    theirs = expected_shapes(ViTConfig.from_dict(arch))
    if _fits(theirs, expected_shapes(ViTConfig.from_dict({**arch, **yours})), resample_patch):
        return
    misfits = []
    for key, value in yours.items():
        try:
            fits = _fits(theirs, expected_shapes(ViTConfig.from_dict({**arch, key: value})), resample_patch)
        except ValueError:
            fits = False
        if not fits:
            misfits.append(f"model.{key}={show(value)} (the weights': {show(arch[key])})")
    if misfits:
        patch = any(m.startswith("model.patch_size") for m in misfits)
        raise UserError(
            f"model.pretrained={source}: timm's weights cannot serve {', '.join(misfits)}; drop "
            f"{'them' if len(misfits) > 1 else 'it'}"
            + (", set model.resample_patch=true to resample the patch filters" if patch else "")
            + ", or train without model.pretrained"
        )


def _fits(theirs: dict, mine: dict, resample_patch: bool) -> bool:
    """Whether weights of `theirs` shapes load into a model of `mine` (fresh head parts, a resampled grid)."""
    for key, shape in mine.items():
        if key.startswith(FRESH) or (key == "pos_embed" and key in theirs and theirs[key][-1] == shape[-1]):
            continue  # a fresh part, or a table resampled to this grid
        if key not in theirs or (theirs[key] != shape and not (resample_patch and key == "patch_embed.proj.weight")):
            return False
    return all(key in mine or key.startswith((*FRESH, "norm.")) for key in theirs)
