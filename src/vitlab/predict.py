"""python -m vitlab.predict ckpt_path=<file.ckpt> images=[a.png,b.jpg] [top_k=5]: print the top-k
classes of each image (and write predictions.json), preprocessed as the checkpoint's test data."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from PIL import Image, UnidentifiedImageError

from vitlab.cli import entry_point
from vitlab.lit_module import ViTModule, load_checkpoint


def open_image(path: str, channels: int) -> Image.Image:
    """An image file as the model's channel count wants it (L or RGB)."""
    try:
        with Image.open(path) as img:
            return img.convert("L" if channels == 1 else "RGB")
    except FileNotFoundError:
        raise FileNotFoundError(f"image {path!r} does not exist") from None
    except UnidentifiedImageError:
        raise ValueError(f"image {path!r} is not an image file PIL can read") from None


def preprocessing(module: ViTModule, ckpt_path: str):
    """The DataModule of the checkpoint's stored data config: its predict_tensor() prepares an image
    exactly as the test images were."""
    data = module.hparams.get("data")
    if not data:
        raise ValueError(f"checkpoint {ckpt_path!r} stores no data config to preprocess images with")
    return instantiate(OmegaConf.create(data))


def predict(cfg: DictConfig) -> list[dict]:
    module = load_checkpoint(cfg.ckpt_path, map_location=cfg.device).eval()
    datamodule = preprocessing(module, cfg.ckpt_path)
    names = module.hparams.get("class_names") or [str(i) for i in range(module.model.cfg.num_classes)]
    images = [cfg.images] if isinstance(cfg.images, str) else list(cfg.images)
    if cfg.top_k < 1:
        raise ValueError(f"top_k {cfg.top_k} must be >= 1")
    results = []
    for path in images:
        img = open_image(path, module.model.cfg.in_chans)
        with torch.no_grad():
            probs = module(datamodule.predict_tensor(img).to(cfg.device)).softmax(-1)[0]
        top = probs.topk(min(cfg.top_k, len(probs)))
        ranked = [
            {"class": names[i], "index": int(i), "prob": float(p)} for p, i in zip(top.values, top.indices, strict=True)
        ]
        results.append({"image": str(path), "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{r['class']} ({r['prob']:.3f})" for r in ranked))
    (Path(cfg.paths.output_dir) / "predictions.json").write_text(json.dumps(results, indent=2))
    return results


@entry_point("predict")
def main(cfg: DictConfig) -> list[dict]:
    return predict(cfg)


if __name__ == "__main__":
    main()
