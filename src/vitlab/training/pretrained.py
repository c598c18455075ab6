"""`model.pretrained=<timm name>`: the run's model becomes that timm architecture at the run's own size, channels,
classes and regularisation, and the data takes the weights' preprocessing where its config leaves it open; what the
experiment or the command line sets explicitly is kept (or refused in one line where the weights cannot serve it).
`load_pretrained` then loads the weights (a timm name or a file: vitlab's, timm's, MAE's), the MAE decoder too when
the run pretrains with objective=mae."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.convert.timm_args import RUN_FIELDS, config_from_timm, timm_model_args
from vitlab.convert.timm_hub import timm_architecture, timm_pretrained_cfg
from vitlab.convert.weights import expected_shapes, is_weights_file, load_timm_weights
from vitlab.model import ViTConfig
from vitlab.model.config import MODEL_EXTRA_KEYS, as_hw
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

# Parts a pretrained encoder need not have: a new head (and fc_norm, an attention pool) starts fresh, and its final
# norm may be dropped (MAE's fine-tuning with average pooling).
FRESH = ("head.", "head_dist.", "fc_norm.", "attn_pool.")


def apply_pretrained(cfg: DictConfig) -> None:
    """`model.pretrained=<timm name>`: the model is that timm architecture (convert.timm_args.config_from_timm), at this
    run's img_size, in_chans, num_classes and regularisation (RUN_FIELDS); a field the experiment or the command line
    sets (global_pool, fc_norm, weight_init, ...) stays the user's where the weights can serve it; data.mean/std and
    the eval crop_pct, crop_mode and interpolation left null become the weights' (timm's pretrained_cfg). Applied to
    `cfg` before it is saved, so config.yaml and the checkpoints describe what ran. A weights file keeps the model
    config."""
    source = cfg.model.get("pretrained")
    if not source or is_weights_file(source):
        return
    run_fields = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k in RUN_FIELDS}
    pretrained, explicit = timm_pretrained_cfg(source), explicit_model_keys()
    patch = cfg.model.get("patch_size") if "patch_size" in explicit else None
    _check_patch(source, patch or timm_model_args(source).get("patch_size", 16), run_fields, pretrained)
    arch = config_from_timm(source, **run_fields).to_dict()
    yours = {k: cfg.model[k] for k in arch if k in explicit and k not in RUN_FIELDS}  # in ViTConfig's order
    yours = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in yours.items()}
    yours = {k: v for k, v in yours.items() if v != arch[k] and v is not None}
    _check_servable(source, arch, yours, bool(cfg.model.get("resample_patch")))
    arch.update(yours)
    changed = sorted(k for k, v in arch.items() if cfg.model.get(k) != v)
    with open_dict(cfg):
        cfg.model.update(arch, variant=None, timm_name=timm_architecture(source))
        taken = pretrained_preprocessing(cfg.data, pretrained, arch["in_chans"])
    log.info(
        "model.pretrained=%s: timm's architecture%s%s; preprocessing of %s: %s",
        source,
        f" (model.{', model.'.join(changed)} changed)" if changed else "",
        f", yours kept: {', '.join(f'model.{k}={_show(v)}' for k, v in yours.items())}" if yours else "",
        pretrained["tag"],
        ", ".join(f"data.{k}={v}" for k, v in taken.items()) or "none taken (set in the data config)",
    )


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_patch(source: str, patch: Any, run_fields: dict, pretrained: dict) -> None:
    (ph, pw), (h, w) = as_hw(patch, "patch_size"), as_hw(run_fields["img_size"], "model.img_size")
    if h % ph or w % pw:
        raise UserError(
            f"model.img_size {run_fields['img_size']} is not a multiple of the patch size {patch} of timm's {source}; "
            f"set model.img_size (its weights were trained at {pretrained['input_size'][-1]})"
        )


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
            misfits.append(f"model.{key}={_show(value)} (the weights': {_show(arch[key])})")
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


def load_pretrained(module: Any, model_cfg: DictConfig) -> None:
    """`model.pretrained`'s weights into a new ViTModule: the encoder, and objective=mae's decoder from a file that
    holds one (MAE's released or training checkpoints, a vitlab MAE checkpoint), so pretraining goes on."""
    load_timm_weights(
        module.model,
        model_cfg.pretrained,
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
