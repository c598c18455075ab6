"""python -m vitlab.predict ckpt_path=<file.ckpt> images=[a.png,b.jpg] [top_k=5]: print the top-k
classes of each image (and write predictions.json; top_k's default: 5, or every class of a model with fewer). Each
file is decoded by the same function as the training data (`data.images.read_image`) and prepared as the
checkpoint's test images were.

Without a checkpoint, `model.pretrained=<timm name | local-dir:<folder> | hf-hub:<repo>>` ranks the classes of timm's
weights' own head, each image prepared by their eval transform (crop_mode, crop_pct, interpolation, mean, std: what
timm's resolve_data_config gives), so the probabilities are timm's (vitlab.evaluation.classifier)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import UserError


def predict(cfg: DictConfig) -> list[dict]:
    import torch

    from vitlab.data.images import read_image

    model, prepare, names = _checkpoint(cfg) if cfg.ckpt_path is not None else _pretrained(cfg)
    top_k = min(5, len(names)) if cfg.top_k is None else cfg.top_k  # (a model of 3 classes ranks 3 by default)
    if top_k > len(names):  # (it was clamped silently)
        raise UserError(f"top_k {top_k} is more than the model's {len(names)} classes: give top_k up to {len(names)}")
    images = [cfg.images] if isinstance(cfg.images, str) else list(cfg.images)
    pixels = [read_image(path, model.cfg.in_chans) for path in images]  # every file checked first
    results = []
    for path, img in zip(images, pixels, strict=True):
        with torch.no_grad():
            probs = model(prepare(img).to(cfg.device)).float().softmax(-1)[0]  # (NaFlex's: a NaFlexBatch)
        top = probs.topk(top_k)
        ranked = [
            {"class": names[i], "index": int(i), "prob": float(p)} for p, i in zip(top.values, top.indices, strict=True)
        ]
        results.append({"image": str(path), "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{r['class']} ({r['prob']:.3f})" for r in ranked))
    out = Path(cfg.paths.output_dir) / "predictions.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", flush=True)
    return results


def _checkpoint(cfg: DictConfig) -> tuple:
    """A trained checkpoint's model, its test images' preparation, its class names."""
    from vitlab.training.run import build

    module = build.load_for_inference(cfg.ckpt_path, map_location=cfg.device).eval()
    if not module.objective.uses_labels:  # an encoder: no classifier to rank classes with (as eval task=test says)
        raise UserError(
            f"checkpoint {cfg.ckpt_path!r} is objective={module.objective.name} pretraining (an encoder without a "
            "classifier): it has no classes to predict; fine-tune it first (python -m vitlab.train "
            f"model.pretrained={cfg.ckpt_path} ...) or evaluate its features with vitlab.eval task=knn|linear|fewshot"
        )
    datamodule = build.inference_datamodule(module, cfg.ckpt_path)
    names = module.hparams.get("class_names") or [str(i) for i in range(module.model.cfg.num_classes)]
    return module.model, datamodule.predict_tensor, names


def _pretrained(cfg: DictConfig) -> tuple:
    """timm's weights with their own head, their eval transform, and their class names where timm knows them."""
    from vitlab.convert.source import resolve
    from vitlab.evaluation import classifier

    img_size = OmegaConf.to_container(cfg.model, resolve=True)["img_size"]  # null: the size they were trained at
    weights = resolve(cfg.model.pretrained, run={"img_size": img_size})  # the one look at timm or the folder
    model = classifier.classifier(weights).to(cfg.device)
    prepare: Callable = classifier.preprocess(weights, model.cfg.img_hw)
    return model, prepare, classifier.class_names(weights, model.cfg.num_classes)


@entry_point("predict")
def main(cfg: DictConfig) -> list[dict]:
    return predict(cfg)


if __name__ == "__main__":
    main()
