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

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point


def predict(cfg: DictConfig) -> list[dict]:
    """Plan (vitlab.cli.predict_plan: the model, how an image is prepared for it, the classes), then each image read,
    ranked and printed; predictions.json written."""
    import torch

    from vitlab.cli.predict_plan import predict_plan
    from vitlab.data.images import read_image
    from vitlab.evaluation.labels import over_threshold, top_classes

    plan = predict_plan(cfg)
    pixels = [read_image(path, plan.model.cfg.in_chans) for path in plan.images]  # every file checked first
    results = []
    for path, img in zip(plan.images, pixels, strict=True):
        with torch.no_grad():
            logits = plan.model(plan.prepare(img).to(plan.device)).float()[0]  # (NaFlex's: a NaFlexBatch)
        if plan.threshold is not None:  # every label over the threshold, with its score
            labels = over_threshold(logits, plan.names, plan.threshold)
            results.append({"image": str(path), "threshold": plan.threshold, "labels": labels})
            print(f"{path}: " + (", ".join(f"{r['class']} ({r['prob']:.3f})" for r in labels) or "no label"))
            continue
        ranked = top_classes(logits, plan.names, plan.top_k)
        results.append({"image": str(path), "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{r['class']} ({r['prob']:.3f})" for r in ranked))
    out = plan.output_dir / "predictions.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", flush=True)
    return results


@entry_point("predict")
def main(cfg: DictConfig) -> list[dict]:
    return predict(cfg)


if __name__ == "__main__":
    main()
