"""`model.pretrained=<weights>` in a run's config: the source is resolved once (convert.source.resolve: a timm name,
`local-dir:`/`hf-hub:`, a weights file) into one `Weights` value and the model group it makes (`pretrained_model`: the
run's model becomes that timm architecture at the run's own size, channels, classes and regularisation; what the
experiment or the command line sets explicitly is kept, or refused in one line where the weights cannot serve it); the
data takes the weights' preprocessing where its settings leave it open (`take_preprocessing`). A command's plan
(vitlab.cli.plans) takes both before anything is built, so config.yaml and the checkpoints describe what ran;
the new module starts from them (ViTModule: the MAE decoder too when the run pretrains with objective=mae); peft='s base
is checked by sha256 when a module of adapters is rebuilt from its checkpoint (`checked_base`)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from vitlab.convert.source import Weights, resolve, show
from vitlab.convert.timm_args import RUN_FIELDS
from vitlab.model.config import MODEL_EXTRA_KEYS
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


def pretrained_model(model: Mapping[str, Any], explicit: set[str]) -> tuple[Weights | None, dict[str, Any]]:
    """`model.pretrained` (in `model`, the run's resolved model group), resolved once: the weights (None without
    any) and the model group as they make it. A timm source's architecture (convert.source.resolve), at this run's
    img_size, in_chans, num_classes and regularisation (RUN_FIELDS), replaces the group's; a field the run sets itself
    (`explicit`: explicit_model_keys, e.g. global_pool, fc_norm, weight_init) stays the user's where the weights can
    serve it. A weights file keeps the group (its position-table rule aside: _posemb_rule)."""
    model = dict(model)
    if not (source := model.get("pretrained")):
        return None, model
    run_fields = {k: v for k, v in model.items() if k in RUN_FIELDS}
    requested = {k: model[k] for k in explicit if k in model}
    weights = resolve(source, run=run_fields, requested=requested, resample_patch=bool(model.get("resample_patch")))
    if weights.is_file:
        return weights, model | _posemb_rule(model, weights, "pos_embed_resample" in requested)
    return weights, model | weights.arch | {"variant": None, "timm_name": weights.timm_name}


def take_preprocessing(data: MutableMapping[str, Any], weights: Weights, before: Mapping[str, Any]) -> None:
    """The data settings left null (data.mean/std, the eval crop_pct, crop_mode and interpolation) become the timm
    weights' (their pretrained_cfg), in `data`; said in one line with what the architecture changed of the model
    group `before` it (pretrained_model) and what of the user's it kept."""
    if weights.is_file:
        return
    arch, yours = weights.arch, weights.kept
    changed = sorted(k for k, v in arch.items() if before.get(k) != v)
    taken = pretrained_preprocessing(data, weights.preprocessing, arch["in_chans"])
    log.info(
        "model.pretrained=%s: timm's architecture%s%s; preprocessing of %s: %s",
        weights.source,
        f" (model.{', model.'.join(changed)} changed)" if changed else "",
        f", yours kept: {', '.join(f'model.{k}={show(v)}' for k, v in yours.items())}" if yours else "",
        weights.preprocessing["tag"],
        ", ".join(f"data.{k}={v}" for k, v in taken.items()) or "none taken (set in the data config)",
    )


def _posemb_rule(model: Mapping[str, Any], weights: Weights, yours: bool) -> dict[str, Any]:
    """A file whose code resampled its position table otherwise (DINO's, DINOv2's): the model takes that rule, unless
    the run sets model.pos_embed_resample itself."""
    if weights.posemb_rule == model.get("pos_embed_resample", "timm") or yours:
        return {}
    log.info("model.pretrained=%s: model.pos_embed_resample=%s, as the code that made these weights resamples its "
             "position table", weights.source, weights.posemb_rule)  # fmt: skip
    return {"pos_embed_resample": weights.posemb_rule}


def explicit_model_keys() -> set[str]:
    """The model fields this run sets itself: typed on the command line (model.<field>=...), or in the chosen
    experiment's `model:` node. Without a Hydra run (a module built from Python) none."""
    if not HydraConfig.initialized():
        return set()
    hc = HydraConfig.get()
    keys = {o.lstrip("+~").split("=", 1)[0] for o in hc.overrides.task}
    found = {k.split(".")[1] for k in keys if k.startswith("model.") and k.count(".") >= 1}
    experiment = hc.runtime.choices.get("experiment")
    for source in hc.runtime.config_sources if experiment else ():
        path = Path(source.path) / "experiment" / f"{experiment}.yaml"
        if source.schema == "file" and path.is_file():
            node = OmegaConf.load(path).get("model") or {}
            found |= set(node) if isinstance(node, DictConfig) else set()
            break
    return found - set(MODEL_EXTRA_KEYS)


def checked_base(base: Mapping[str, Any]) -> Weights:
    """The base weights a checkpoint's adapters were trained on, resolved from their source (convert.source.Weights),
    refused in one line where the file is gone or its sha256 is not the one the adapters were trained on."""
    if base.get("is_file", True) and not Path(base["source"]).is_file():
        raise UserError(f"the base weights {base['source']!r} the adapters were trained on are not there")
    weights = resolve(base["source"])  # (a file: its position rule too, as model.pretrained resolves it)
    if (found := weights_digest(weights)) != base["sha256"]:
        raise UserError(
            f"base weights {base['source']!r} have sha256 {found[:12]}..., not the {base['sha256'][:12]}... the "
            "adapters were trained on: give the original file"
        )
    return weights


def weights_digest(weights: Any) -> str:
    """sha256 of a weights file's bytes; of the state dict's tensors for a timm source (its cache's file is timm's)."""
    h = hashlib.sha256()
    if weights.is_file:
        with open(weights.source, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        return h.hexdigest()
    for key, tensor in sorted(weights.tensors.encoder.items()):
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pretrained_preprocessing(data: MutableMapping[str, Any], pretrained: dict, channels: int) -> dict[str, Any]:
    """Fill the data settings left null with the pretrained weights' (mean/std averaged over channels when the
    data has another channel count); returns what was filled."""
    taken: dict[str, Any] = {}
    for key in ("mean", "std"):
        if key in data and data[key] is None:
            values = list(pretrained[key])
            data[key] = taken[key] = values if len(values) == channels else [sum(values) / len(values)] * channels
    for key in ("crop_pct", "crop_mode", "interpolation"):
        if "eval_transform" in data and key in data["eval_transform"] and data["eval_transform"][key] is None:
            data["eval_transform"][key] = taken[f"eval_transform.{key}"] = pretrained[key]
    return taken
