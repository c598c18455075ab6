"""python -m vitlab.predict ckpt_path=<file.ckpt> images=[a.png,b.jpg] [top_k=5]: print the top-k
classes of each image (and write predictions.json). Each file is decoded by the same function as the
training data (`data.images.read_image`) and prepared as the checkpoint's test images were."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point


def predict(cfg: DictConfig) -> list[dict]:
    import torch

    from vitlab.data.images import read_image
    from vitlab.training import build

    module = build.load_for_inference(cfg.ckpt_path, map_location=cfg.device).eval()
    datamodule = build.inference_datamodule(module, cfg.ckpt_path)
    names = module.hparams.get("class_names") or [str(i) for i in range(module.model.cfg.num_classes)]
    images = [cfg.images] if isinstance(cfg.images, str) else list(cfg.images)
    pixels = [read_image(path, module.model.cfg.in_chans) for path in images]  # every file checked first
    results = []
    for path, img in zip(images, pixels, strict=True):
        with torch.no_grad():
            probs = module(datamodule.predict_tensor(img).to(cfg.device)).softmax(-1)[0]
        top = probs.topk(min(cfg.top_k, len(probs)))
        ranked = [
            {"class": names[i], "index": int(i), "prob": float(p)} for p, i in zip(top.values, top.indices, strict=True)
        ]
        results.append({"image": str(path), "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{r['class']} ({r['prob']:.3f})" for r in ranked))
    out = Path(cfg.paths.output_dir) / "predictions.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", flush=True)
    return results


@entry_point("predict")
def main(cfg: DictConfig) -> list[dict]:
    return predict(cfg)


if __name__ == "__main__":
    main()
