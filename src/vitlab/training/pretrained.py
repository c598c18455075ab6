"""`model.pretrained=<weights>` in a run's config: the source is resolved once (convert.source.resolve: a timm name,
`local-dir:`/`hf-hub:`, a weights file) into one `Weights` value, which `apply_pretrained` writes into the config (the
run's model becomes that timm architecture at the run's own size, channels, classes and regularisation, and the data
takes the weights' preprocessing where its config leaves it open; what the experiment or the command line sets
explicitly is kept, or refused in one line where the weights cannot serve it) and returns; `load_pretrained` then
loads that value into the new module, the MAE decoder too when the run pretrains with objective=mae."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.convert.source import Weights, resolve, show
from vitlab.convert.timm_args import RUN_FIELDS
from vitlab.model.config import MODEL_EXTRA_KEYS

log = logging.getLogger(__name__)


def apply_pretrained(cfg: DictConfig) -> Weights | None:
    """`model.pretrained`, resolved once (None without one): a timm source's architecture (convert.source.resolve), at
    this run's img_size, in_chans, num_classes and regularisation (RUN_FIELDS), becomes the model config; a field the
    experiment or the command line sets (global_pool, fc_norm, weight_init, ...) stays the user's where the weights can
    serve it; data.mean/std and the eval crop_pct, crop_mode and interpolation left null become the weights' (timm's
    pretrained_cfg). Applied to `cfg` before it is saved, so config.yaml and the checkpoints describe what ran. A
    weights file keeps the model config. Returns the value to load (`load_pretrained`)."""
    source = cfg.model.get("pretrained")
    if not source:
        return None
    model = OmegaConf.to_container(cfg.model, resolve=True)
    run_fields = {k: v for k, v in model.items() if k in RUN_FIELDS}
    requested = {k: model[k] for k in explicit_model_keys() if k in model}
    weights = resolve(source, run=run_fields, requested=requested, resample_patch=bool(model.get("resample_patch")))
    if weights.is_file:
        _take_posemb_rule(cfg, weights, "pos_embed_resample" in requested)
        return weights
    arch, yours = weights.arch, weights.kept
    changed = sorted(k for k, v in arch.items() if cfg.model.get(k) != v)
    with open_dict(cfg):
        cfg.model.update(arch, variant=None, timm_name=weights.timm_name)
        taken = pretrained_preprocessing(cfg.data, weights.preprocessing, arch["in_chans"])
    log.info(
        "model.pretrained=%s: timm's architecture%s%s; preprocessing of %s: %s",
        source,
        f" (model.{', model.'.join(changed)} changed)" if changed else "",
        f", yours kept: {', '.join(f'model.{k}={show(v)}' for k, v in yours.items())}" if yours else "",
        weights.preprocessing["tag"],
        ", ".join(f"data.{k}={v}" for k, v in taken.items()) or "none taken (set in the data config)",
    )
    return weights


def _take_posemb_rule(cfg: DictConfig, weights: Weights, yours: bool) -> None:
    """A file whose code resampled its position table otherwise (DINO's, DINOv2's): the model takes that rule, unless
    the run sets model.pos_embed_resample itself."""
    if weights.posemb_rule == cfg.model.get("pos_embed_resample", "timm") or yours:
        return
    with open_dict(cfg):
        cfg.model.pos_embed_resample = weights.posemb_rule
    log.info("model.pretrained=%s: model.pos_embed_resample=%s, as the code that made these weights resamples its "
             "position table", weights.source, weights.posemb_rule)  # fmt: skip


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


def load_pretrained(module: Any, model_cfg: DictConfig, weights: Weights | None = None) -> None:
    """`model.pretrained`'s weights (`weights`, apply_pretrained's value; resolved here when not given) into a new
    ViTModule: the encoder, and objective=mae's decoder from a file that holds one (MAE's released or training
    checkpoints, a vitlab MAE checkpoint), so pretraining goes on."""
    weights = weights or resolve(model_cfg.pretrained)
    weights.load_into(
        module.model,
        decoder=module.objective.extra_modules().get("decoder"),
        resample_patch=bool(model_cfg.get("resample_patch")),
    )
    module.objective.prepare(module.model)  # what it sets from the weights (objective=dino: the student starts as them)


def pretrained_preprocessing(data: DictConfig, pretrained: dict, channels: int) -> dict[str, Any]:
    """Fill the data settings left null with the pretrained weights' (mean/std averaged over channels when the
    data has another channel count); returns what was filled."""
    taken: dict[str, Any] = {}
    for key in ("mean", "std"):
        if key in data and data[key] is None:
            values = list(pretrained[key])
            data[key] = taken[key] = values if len(values) == channels else [sum(values) / len(values)] * channels
    for key in ("crop_pct", "crop_mode", "interpolation"):
        if "eval_transform" in data and key in data.eval_transform and data.eval_transform[key] is None:
            data.eval_transform[key] = taken[f"eval_transform.{key}"] = pretrained[key]
    return taken
