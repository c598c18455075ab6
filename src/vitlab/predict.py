"""python -m vitlab.predict ckpt_path=<file.ckpt> images=[a.png,b.jpg] [top_k=5]: print the top-k
classes of each image (and write predictions.json; top_k's default: 5, or every class of a model with fewer). Each
file is decoded by the same function as the training data (`data.images.read_image`) and prepared as the
checkpoint's test images were.

Without a checkpoint, `model.pretrained=<timm name | local-dir:<folder> | hf-hub:<repo>>` ranks the classes of timm's
weights' own head, each image prepared by their eval transform (crop_mode, crop_pct, interpolation, mean, std: what
timm's resolve_data_config gives), so the probabilities are timm's (vitlab.evaluation.classifier).

A multi-label checkpoint (objective.multilabel=true) gives each image every label whose sigmoid probability is above
`threshold` (null: the checkpoint's objective.threshold), highest first, with its score: not a top-k."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import UserError


@dataclass(frozen=True)
class PredictPlan:
    """predict's checked config (cli/schemas.py's PredictSettings) as the values it runs on, made once."""

    ckpt_path: str | None
    pretrained: str | None  # without a checkpoint: timm's weights, at img_size (None: the size they were trained at)
    img_size: Any
    images: list[str]
    top_k: int | None
    device: str
    output_dir: Path
    threshold: float | None = None  # multi-label checkpoints: the labels above it (None: the objective's)

    @classmethod
    def of(cls, cfg: DictConfig) -> PredictPlan:
        model = OmegaConf.to_container(cfg.model, resolve=True) if "model" in cfg else {}
        images = [cfg.images] if isinstance(cfg.images, str) else list(cfg.images)
        return cls(cfg.ckpt_path, model.get("pretrained"), model.get("img_size"), images, cfg.top_k, cfg.device,
                   Path(cfg.paths.output_dir), cfg.get("threshold"))  # fmt: skip


def predict(cfg: DictConfig) -> list[dict]:
    import torch

    from vitlab.data.images import read_image
    from vitlab.evaluation.labels import over_threshold, threshold_of, top_classes

    plan = PredictPlan.of(cfg)
    model, prepare, names, trained = _checkpoint(plan) if plan.ckpt_path is not None else _pretrained(plan)
    threshold = threshold_of(plan.threshold, trained)  # a multi-label model's; None: one label an image
    top_k = min(5, len(names)) if plan.top_k is None else plan.top_k  # (a model of 3 classes ranks 3 by default)
    if top_k > len(names):  # (it was clamped silently)
        raise UserError(f"top_k {top_k} is more than the model's {len(names)} classes: give top_k up to {len(names)}")
    pixels = [read_image(path, model.cfg.in_chans) for path in plan.images]  # every file checked first
    results = []
    for path, img in zip(plan.images, pixels, strict=True):
        with torch.no_grad():
            logits = model(prepare(img).to(plan.device)).float()[0]  # (NaFlex's: a NaFlexBatch)
        if threshold is not None:  # every label over the threshold, with its score
            labels = over_threshold(logits, names, threshold)
            results.append({"image": str(path), "threshold": threshold, "labels": labels})
            print(f"{path}: " + (", ".join(f"{r['class']} ({r['prob']:.3f})" for r in labels) or "no label"))
            continue
        ranked = top_classes(logits, names, top_k)
        results.append({"image": str(path), "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{r['class']} ({r['prob']:.3f})" for r in ranked))
    out = plan.output_dir / "predictions.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", flush=True)
    return results


def _checkpoint(plan: PredictPlan) -> tuple:
    """A trained checkpoint's model, its test images' preparation, its class names (the file read once)."""
    from vitlab.training.run import inference

    module = inference.load_for_inference(plan.ckpt_path, map_location=plan.device).eval()
    if not module.objective.uses_labels:  # an encoder: no classifier to rank classes with (as eval task=test says)
        raise UserError(
            f"checkpoint {plan.ckpt_path!r} is objective={module.objective.name} pretraining (an encoder without a "
            "classifier): it has no classes to predict; fine-tune it first (python -m vitlab.train "
            f"model.pretrained={plan.ckpt_path} ...) or evaluate its features with vitlab.eval task=knn|linear|fewshot"
        )
    datamodule = inference.inference_datamodule(module, plan.ckpt_path)
    names = module.hparams.get("class_names") or [str(i) for i in range(module.model.cfg.num_classes)]
    cfg = module.objective.cfg
    trained = cfg.threshold if getattr(cfg, "multilabel", False) else None  # its threshold; None: one label an image
    return module.model, datamodule.predict_tensor, names, trained


def _pretrained(plan: PredictPlan) -> tuple:
    """timm's weights with their own head, their eval transform, and their class names where timm knows them."""
    from vitlab.convert.source import resolve
    from vitlab.evaluation import classifier

    weights = resolve(plan.pretrained, run={"img_size": plan.img_size})  # the one look at timm or the folder
    model = classifier.classifier(weights).to(plan.device)
    prepare: Callable = classifier.preprocess(weights, model.cfg.img_hw)
    return model, prepare, classifier.class_names(weights, model.cfg.num_classes), None


@entry_point("predict")
def main(cfg: DictConfig) -> list[dict]:
    return predict(cfg)


if __name__ == "__main__":
    main()
