"""The data formats `data=<name>` selects (conf/data/<name>.yaml), each registered here once: the DataModule that
reads it and the module of vitlab.data that holds it (imported when first asked for: data/__init__.py), how a config's
classes are counted before torch is imported (`${data_classes:}`, cli/config_tree.py), what its values must satisfy
before it is built (training/run/node_checks.py), and the key that says where its images are (the benchmark's
`pipeline.readers`).

Imports only the standard library, vitlab.utils and vitlab.data.indexes: no torch, Lightning or Hydra.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitlab.data import indexes


@dataclass(frozen=True)
class Format:
    """One data format: its DataModule (`cls`, in vitlab.data's `module`) and what the steps before its build ask."""

    cls: str  # the DataModule's class name: the config's `_target_` is vitlab.data.<cls>
    module: str  # the module of vitlab.data that holds it
    count_classes: Callable[..., int] | None = None  # ${data_classes:}, from the config's keys it takes
    before_build: Callable[[dict[str, Any]], None] | None = None  # a check of the config's values (the files they name)
    where: str | None = None  # the key that says where its images are (benchmark.pipeline.readers: <name>=<where>)

    @property
    def target(self) -> str:
        return f"vitlab.data.{self.cls}"


def _class_folders(values: dict[str, Any]) -> None:
    """data.num_classes against an image folder's class folders (imagefolder.check_class_folders)."""
    if isinstance(values.get("num_classes"), int) and isinstance(values.get("data_dir"), str):
        from vitlab.data.imagefolder import check_class_folders  # (torch's: imported once a folder is named)

        check_class_folders(values["data_dir"], values["num_classes"], bool(values.get("unlabeled")))


FORMATS: dict[str, Format] = {
    "cifar10": Format("CIFAR10DataModule", "cifar"),
    "cifar100": Format("CIFAR100DataModule", "cifar"),
    "digits": Format("DigitsDataModule", "digits"),
    "digit_pairs": Format("DigitPairsDataModule", "digit_pairs"),
    "fake": Format("FakeDataModule", "fake"),
    "hf": Format("HFDataModule", "hf", indexes.hf_classes, where="name"),
    "imagefolder": Format("ImageFolderDataModule", "imagefolder", before_build=_class_folders),
    "list": Format("ListDataModule", "lists", indexes.list_classes, where="train_file"),
    "segmentation": Format("SegmentationDataModule", "segmentation"),
    "streaming": Format("StreamingDataModule", "streaming"),
    "wds": Format("WDSDataModule", "wds", indexes.wds_classes, where="urls"),
}


def class_count(target: str) -> Callable[..., int] | None:
    """The class count of the format whose DataModule `target` names, where it is counted before torch (None: the
    target's module counts them, cli/config_tree.py)."""
    return next((f.count_classes for f in FORMATS.values() if f.target == target), None)


def readers() -> dict[str, tuple[str, str]]:
    """Each format whose images are named by one key: its name -> (its DataModule's target, that key)."""
    return {name: (f.target, f.where) for name, f in FORMATS.items() if f.where is not None}
