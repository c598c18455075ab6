"""timm's pretrained classifiers scored without a checkpoint (`model.pretrained=<timm name | local-dir:<folder> |
hf-hub:<repo>>`), as timm's own validate.py scores them: the weights with their own head, in our ViT; each image
through the weights' eval transform (crop_mode, crop_pct, interpolation, mean, std: timm's resolve_data_config);
top-1/top-5 counted as timm.utils.accuracy counts them (torch.topk over the logits). `vitlab.predict` ranks the
classes of image files (`classifier`, `preprocess`); `vitlab.eval task=test` scores a folder of class folders
(`score`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vitlab.convert.source import Weights
from vitlab.data import transforms
from vitlab.model import ViT, ViTConfig
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

EVAL_KEYS = ("crop_pct", "crop_mode", "interpolation")


def classifier(weights: Weights) -> ViT:
    """The weights (resolved at the size to run at: `resolve(source, run={"img_size": ...})`), head included, in our
    ViT, in eval mode: what timm.create_model(source, pretrained=True) computes."""
    if weights.is_file:
        raise UserError(
            f"model.pretrained={weights.source}: a weights file carries no preprocessing to run its head with; give a "
            "timm name or a timm folder (local-dir:<folder>, with its config.json)"
        )
    model = ViT(ViTConfig.from_dict(weights.arch))
    if not model.cfg.num_classes:
        raise UserError(f"model.pretrained={weights.source} has no classifier head (num_classes 0): nothing to predict")
    weights.load_into(model, reset_head=False)
    return model.eval()


def preprocess(weights: Weights, img_hw: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A uint8 (C, H, W) image -> the (1, C, H, W) input the weights expect: their eval transform and normalisation,
    the two halves an evaluation DataModule runs (its workers', then the device's)."""
    pre = weights.preprocessing
    eval_tf = transforms.eval_transform(img_hw, pre["mean"], **{k: pre[k] for k in EVAL_KEYS})
    to_input = transforms.DeviceTransform(pre["mean"], pre["std"])
    return lambda img: to_input(eval_tf(img).unsqueeze(0), train=False)


def score(data: Mapping[str, Any], weights: Weights, device: torch.device) -> tuple[dict[str, float], str]:
    """task=test on the weights' own head (resolved at model.img_size; null: their own): top-1, top-5 and the
    cross-entropy (fractions, as a checkpoint's test/acc) over a folder of class folders, or the data's test split (its
    val split, named so, where it has none), as timm's validate.py computes them; and which images those were. `data`:
    the data mapping with the weights' preprocessing laid in where it was left null (the plan's, cli/eval_plans.py)."""
    from vitlab.training.run import build

    datamodule = build.build_datamodule(data)
    dataset, split = _split(datamodule, _class_folders_alone(data))
    source, arch = weights.source, ViTConfig.from_dict(weights.arch)
    if (datamodule.num_classes, datamodule.channels) != (arch.num_classes, arch.in_chans):
        raise UserError(
            f"the data has {datamodule.num_classes} classes and {datamodule.channels} channels, and "
            f"model.pretrained={source}'s head {arch.num_classes} classes of {arch.in_chans}-channel images: task=test "
            "scores the weights' own head, on class folders that are its classes"
        )
    model = classifier(weights).to(device)
    hits, loss, n = torch.zeros(2, dtype=torch.long), 0.0, 0
    with torch.no_grad():
        for batch in datamodule._loader(dataset, train=False):
            x, y = datamodule.device_transform([t.to(device) for t in batch], train=False)
            logits = model(x).float()
            top = logits.topk(min(5, logits.shape[-1]), -1).indices  # (B, 5): timm.utils.accuracy's ranking
            found = top == y[:, None]
            hits += torch.stack([found[:, 0].sum(), found.any(-1).sum()]).cpu()
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            n += len(y)
    stage = "val" if split == "val/" else "test"
    metrics = {f"{stage}/acc": hits[0].item() / n, f"{stage}/acc_top5": hits[1].item() / n, f"{stage}/loss": loss / n}
    return metrics, f"{n:,} images of {split}"


def _class_folders_alone(data: Mapping[str, Any]) -> bool:
    """data=imagefolder with a data_dir of class folders and no train/ (timm's validate.py --data-dir <val>)."""
    root = data.get("data_dir")
    folder = data.get("_target_") == "vitlab.data.ImageFolderDataModule"
    return folder and root is not None and Path(root).is_dir() and not (Path(root) / "train").is_dir()


def _split(datamodule, class_folders_alone: bool) -> tuple[Any, str]:
    """The images task=test scores: data_dir's class folders, or the data's test split (else its val split)."""
    from torchvision import datasets

    from vitlab.data.imagefolder import rgb_loader
    from vitlab.data.images import is_image_file
    from vitlab.data.seeded import TransformDataset

    if class_folders_alone:
        root = str(datamodule.data_dir)
        folder = datasets.ImageFolder(root, loader=rgb_loader, is_valid_file=is_image_file)
        datamodule.num_classes, datamodule.class_names = len(folder.classes), list(folder.classes)
        return TransformDataset(folder, datamodule.eval_tf), f"{root} (its class folders)"
    datamodule.setup("test")
    if datamodule.test_set is None:
        return datamodule.val_set, "val/"
    return datamodule.test_set, datamodule.splits.get("test", "the test split")


def class_names(weights: Weights, num_classes: int) -> list[str]:
    """The head's class names: a saved folder's label_names (its config.json), else ImageNet's descriptions for an
    ImageNet-sized head (timm.data.ImageNetInfo, as timm's inference.py names them), else the indices."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    names = weights.label_names
    if names and len(names) == num_classes:
        return list(names)
    subset = infer_imagenet_subset({"num_classes": num_classes})
    if subset:
        return ImageNetInfo(subset).label_descriptions()
    return [str(i) for i in range(num_classes)]
