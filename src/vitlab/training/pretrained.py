"""`model.pretrained=<timm name>`: the run's model becomes that timm architecture at the run's own size, channels,
classes and regularisation, and the data takes the weights' preprocessing where its config leaves it open.
`load_pretrained` then loads the weights (a timm name or a file: vitlab's, timm's, MAE's), the MAE decoder too when
the run pretrains with objective=mae."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from vitlab.convert.timm_args import RUN_FIELDS, config_from_timm, timm_model_args
from vitlab.convert.timm_hub import timm_architecture, timm_pretrained_cfg
from vitlab.convert.weights import is_weights_file, load_timm_weights
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


def apply_pretrained(cfg: DictConfig) -> None:
    """`model.pretrained=<timm name>`: the model is that timm architecture (convert.timm_args.config_from_timm), at this
    run's img_size, in_chans, num_classes and regularisation (RUN_FIELDS); data.mean/std and the eval crop and
    interpolation left null become the weights' (timm's pretrained_cfg). Applied to `cfg` before it is saved,
    so config.yaml and the checkpoints describe what ran. A weights file keeps the model config as it is."""
    source = cfg.model.get("pretrained")
    if not source or is_weights_file(source):
        return
    run_fields = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k in RUN_FIELDS}
    pretrained = timm_pretrained_cfg(source)
    patch, img = timm_model_args(source).get("patch_size", 16), run_fields["img_size"]
    (ph, pw), (h, w) = as_hw(patch, "patch_size"), as_hw(img, "model.img_size")
    if h % ph or w % pw:
        raise UserError(
            f"model.img_size {img} is not a multiple of the patch size {patch} of timm's {source}; set model.img_size "
            f"(its weights were trained at {pretrained['input_size'][-1]})"
        )
    arch = config_from_timm(source, **run_fields).to_dict()
    changed = sorted(k for k, v in arch.items() if cfg.model.get(k) != v)
    with open_dict(cfg):
        cfg.model.update(arch, variant=None, timm_name=timm_architecture(source))
        taken = _pretrained_preprocessing(cfg.data, pretrained, arch["in_chans"])
    log.info(
        "model.pretrained=%s: timm's architecture%s; preprocessing of %s: %s",
        source,
        f" (model.{', model.'.join(changed)} changed)" if changed else "",
        pretrained["tag"],
        ", ".join(f"data.{k}={v}" for k, v in taken.items()) or "none taken (set in the data config)",
    )


def load_pretrained(module: Any, model_cfg: DictConfig) -> None:
    """`model.pretrained`'s weights into a new ViTModule: the encoder, and objective=mae's decoder from a file that
    holds one (MAE's released or training checkpoints, a vitlab MAE checkpoint), so pretraining goes on."""
    load_timm_weights(
        module.model,
        model_cfg.pretrained,
        decoder=module.objective.extra_modules().get("decoder"),
        resample_patch=bool(model_cfg.get("resample_patch")),
    )


def _pretrained_preprocessing(data: DictConfig, pretrained: dict, channels: int) -> dict[str, Any]:
    """Fill the data settings left null with the pretrained weights' (mean/std averaged over channels when the
    data has another channel count); returns what was filled."""
    taken: dict[str, Any] = {}
    for key in ("mean", "std"):
        if key in data and data[key] is None:
            values = list(pretrained[key])
            data[key] = taken[key] = values if len(values) == channels else [sum(values) / len(values)] * channels
    for key in ("crop_pct", "interpolation"):
        if "eval_transform" in data and key in data.eval_transform and data.eval_transform[key] is None:
            data.eval_transform[key] = taken[f"eval_transform.{key}"] = pretrained[key]
    return taken
