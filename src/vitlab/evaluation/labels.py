"""What `vitlab.predict` gives an image: a classifier's top-k classes (softmax), or the labels a multi-label
classifier (objective.multilabel=true) gives it: every class whose sigmoid is above a threshold, highest first, with
its probability, not a top-k."""

from __future__ import annotations

import torch

from vitlab.utils.errors import UserError


def threshold_of(asked: float | None, trained: float | None) -> float | None:
    """The threshold to predict with: `asked` (predict's `threshold`), else the checkpoint's objective.threshold
    (`trained`; None: the model gives one label an image, and a threshold asked for is refused)."""
    if trained is None and asked is not None:
        raise UserError(
            f"threshold {asked} picks the labels of a multi-label checkpoint (objective.multilabel=true), and this "
            "model gives one label an image: rank its classes with top_k"
        )
    return trained if asked is None else asked


def over_threshold(logits: torch.Tensor, names: list[str], threshold: float) -> list[dict]:
    """An image's (C,) logits as its labels: [{class, index, prob}] of the classes above `threshold`."""
    probs = logits.float().sigmoid()
    order = [int(i) for i in probs.argsort(descending=True) if probs[i] > threshold]
    return [{"class": names[i], "index": i, "prob": float(probs[i])} for i in order]


def top_classes(logits: torch.Tensor, names: list[str], k: int) -> list[dict]:
    """An image's (C,) logits as its `k` likeliest classes: [{class, index, prob}] (softmax)."""
    top = logits.float().softmax(-1).topk(k)
    pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
    return [{"class": names[i], "index": i, "prob": p} for p, i in pairs]
