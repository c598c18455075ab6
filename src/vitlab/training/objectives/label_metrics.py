"""The metrics of `objective=classify` beyond top-1 (torchmetrics'): several labels an image (mAP over classes and
over every (image, class) pair, F1 at objective.threshold, each class's AP on the test split), and for one label
an image the numbers a long tail is judged by (the mean of the classes' recalls on val and test, each class's
accuracy on the test split). A metric whose value is one number a class (a (C,) tensor) goes to metrics.json only,
as `<stage>/<name>/<class name>` (training.module: a console table or a logger of 1,000 rows is no summary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassRecall,
    MultilabelAveragePrecision,
    MultilabelF1Score,
)


def multilabel_metrics(stage: str, num_classes: int, threshold: float) -> dict[str, Metric]:
    """train: F1 at the threshold (cheap, no scores kept); val: mAP (the checkpoint's choice), micro mAP, F1; test:
    those and each class's AP. Targets are int 0/1 (num_classes) rows."""
    f1 = MultilabelF1Score(num_classes, threshold=threshold, average="macro", validate_args=False)
    if stage == "train":
        return {"f1": f1}
    out = {
        "map": MultilabelAveragePrecision(num_classes, average="macro"),
        "map_micro": MultilabelAveragePrecision(num_classes, average="micro"),
        "f1": f1,
        "f1_micro": MultilabelF1Score(num_classes, threshold=threshold, average="micro", validate_args=False),
    }
    if stage == "test":
        out["ap"] = MultilabelAveragePrecision(num_classes, average=None)
    return out


def long_tail_metrics(stage: str, num_classes: int) -> dict[str, Metric]:
    """One label an image, besides top-1 and top-5: the mean of the classes' recalls (balanced accuracy) on val and
    test, and each class's accuracy (its recall) on test."""
    if stage == "train":
        return {}
    out: dict[str, Metric] = {"recall_mean": MulticlassRecall(num_classes, average="macro", validate_args=False)}
    if stage == "test":
        out["acc_class"] = MulticlassAccuracy(num_classes, average=None, validate_args=False)
    return out


def class_values(stage: str, name: str, value: torch.Tensor, hparams: Mapping[str, Any]) -> dict[str, float]:
    """A metric of one value a class as metrics.json's `<stage>/<name>/<class name>` (the index where the run knows
    no names)."""
    names = hparams.get("class_names") or [str(i) for i in range(len(value))]
    return {f"{stage}/{name}/{names[i]}": float(v) for i, v in enumerate(value.tolist())}
