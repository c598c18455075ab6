"""The metrics of `objective=classify` beyond top-1 (torchmetrics'): several labels an image (mAP over classes and
over every (image, class) pair, F1 at objective.threshold, each class's AP on the test split), and for one label
an image the numbers a long tail is judged by (the mean of the classes' recalls on val and test, each class's
accuracy on the test split). A metric whose value is one number a class comes back as a dict (torchmetrics'
ClasswiseWrapper): `<stage>/<prefix><class index>` in the logs and metrics.json (the class names: the run's
class_names, metrics.json's class_counts).
"""

from __future__ import annotations

from torchmetrics import Metric
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassRecall,
    MultilabelAveragePrecision,
    MultilabelF1Score,
)
from torchmetrics.wrappers import ClasswiseWrapper


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
        out["ap"] = ClasswiseWrapper(
            MultilabelAveragePrecision(num_classes, average=None), labels=[str(i) for i in range(num_classes)],
            prefix="ap_",
        )  # fmt: skip
    return out


def long_tail_metrics(stage: str, num_classes: int) -> dict[str, Metric]:
    """One label an image, besides top-1 and top-5: the mean of the classes' recalls (balanced accuracy) on val and
    test, and each class's accuracy (its recall) on test."""
    if stage == "train":
        return {}
    out: dict[str, Metric] = {"recall_mean": MulticlassRecall(num_classes, average="macro", validate_args=False)}
    if stage == "test":
        out["acc_class"] = ClasswiseWrapper(
            MulticlassAccuracy(num_classes, average=None, validate_args=False),
            labels=[str(i) for i in range(num_classes)], prefix="acc_class_",
        )  # fmt: skip
    return out
