"""vitlab.predict's checked config (cli/schemas.py's PredictSettings) as its plan (`predict_plan`), every decision in it
taken once, before an image is read: the model that ranks the images and how an image is prepared for it (a trained
checkpoint's module, its file read once, with its test images' preparation; or, without one, timm's weights resolved
once, with their own head and eval transform), its class names, the labels a multi-label model gives (the threshold
asked for, else the one it was trained with) or the top-k of a one-label model, the images, where predictions.json
goes. The config is made plain data first; nothing here writes into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitlab.utils.errors import UserError


@dataclass(frozen=True)
class PredictPlan:
    """What vitlab.predict runs: `model` (eval mode, on its device) on each of `images` prepared by `prepare`, ranked
    over `names`: every label above `threshold` (a multi-label model), else the `top_k` classes."""

    model: Any  # the ViT (vitlab.model.ViT) with its classifier
    prepare: Callable  # an image as data.images.read_image gives it -> the model's input (NaFlex's: a NaFlexBatch)
    names: list[str]
    threshold: float | None  # a multi-label model's; None: one label an image
    top_k: int
    images: list[str]
    device: str
    output_dir: Path


def predict_plan(cfg: DictConfig) -> PredictPlan:
    """predict's checked config -> its plan."""
    from vitlab.evaluation.labels import threshold_of

    settings = OmegaConf.to_container(cfg, resolve=True)
    device, images = settings["device"], settings["images"]
    if settings["ckpt_path"] is not None:
        model, prepare, names, trained = _checkpoint(settings["ckpt_path"], device)
    else:
        model_settings = settings.get("model") or {}
        model, prepare, names, trained = _pretrained(model_settings.get("pretrained"), model_settings.get("img_size"),
                                                     device)  # fmt: skip
    top_k = min(5, len(names)) if settings["top_k"] is None else settings["top_k"]  # (3 classes: 3 by default)
    if top_k > len(names):  # (it was clamped silently)
        raise UserError(f"top_k {top_k} is more than the model's {len(names)} classes: give top_k up to {len(names)}")
    return PredictPlan(
        model=model,
        prepare=prepare,
        names=names,
        threshold=threshold_of(settings.get("threshold"), trained),
        top_k=top_k,
        images=[images] if isinstance(images, str) else list(images),
        device=device,
        output_dir=Path(settings["paths"]["output_dir"]),
    )


def _checkpoint(ckpt_path: str, device: str) -> tuple:
    """A trained checkpoint's model, its test images' preparation, its class names, the threshold it was trained with
    where it gives several labels an image (None: one label); the file read once."""
    from vitlab.training.run import inference

    module = inference.load_for_inference(ckpt_path, map_location=device).eval()
    if not module.objective.uses_labels:  # an encoder: no classifier to rank classes with (as eval task=test says)
        raise UserError(
            f"checkpoint {ckpt_path!r} is objective={module.objective.name} pretraining (an encoder without a "
            "classifier): it has no classes to predict; fine-tune it first (python -m vitlab.train "
            f"model.pretrained={ckpt_path} ...) or evaluate its features with vitlab.eval task=knn|linear|fewshot"
        )
    datamodule = inference.inference_datamodule(module, ckpt_path)
    names = module.hparams.get("class_names") or [str(i) for i in range(module.model.cfg.num_classes)]
    objective = module.objective.cfg
    trained = objective.threshold if getattr(objective, "multilabel", False) else None
    return module.model, datamodule.predict_tensor, names, trained


def _pretrained(source: str, img_size: Any, device: str) -> tuple:
    """timm's weights (`source`, at `img_size`; None: the size they were trained at) with their own head, their eval
    transform, and their class names where timm knows them."""
    from vitlab.convert.source import resolve
    from vitlab.evaluation import classifier

    weights = resolve(source, run={"img_size": img_size})  # the one look at timm or the folder
    model = classifier.classifier(weights).to(device)
    prepare = classifier.preprocess(weights, model.cfg.img_hw)
    return model, prepare, classifier.class_names(weights, model.cfg.num_classes), None
