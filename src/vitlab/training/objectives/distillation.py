"""`objective=distill`: knowledge distillation as DeiT trains it (Touvron et al. 2021; deit's losses.py
`DistillationLoss`): a teacher in eval mode, without gradients, gives logits for each training batch (the same mixed
images the student sees), and the student's loss is (1 - alpha) x its label loss + alpha x a distillation term:

- `soft`: KL(student / tau || teacher / tau) x tau^2, summed and divided by the logits' count (DeiT's exactly; timm's
  TokenDistillationTask divides by the batch alone, K times DeiT's for K classes);
- `hard`: cross-entropy against the teacher's top class (DeiT's and timm's).

A distilled student (`model.distilled=true`) distils through its distillation token's head, the class token's head
learning from the labels (DeiT's "hard distillation" with the token); any other student distils through its one head
(plain logit distillation, Hinton et al. 2015).

The label loss is objective=classify's (its options: label smoothing, CE/BCE, MixUp/CutMix, which the teacher sees as
the student does). The teacher is a vitlab training checkpoint (.ckpt) or a timm model name (its pretrained weights),
wrapped in timm's DistillationTeacher (eval mode). Its input is made from the student's on the device: renormalised by
timm's `normalize_input` with the teacher's own mean and std (its pretrained configuration; a checkpoint's data
settings), resized to the teacher's input size. It is not part of the student's checkpoint: a resumed run loads it again
from where the config says. Under DDP each process runs its own copy on its own shard. No Lightning or Hydra here.

This is `objective.kind=logits`, the default; `feature` and `tokens` (feature_distill.py) distil a teacher's features
with the same config, Teacher and loading; distill_kinds.py picks the kind's class.
"""

from __future__ import annotations

import pydoc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model import ViT, ViTConfig
from vitlab.training.objectives.classification import Classification, ClassifyConfig
from vitlab.training.objectives.distill_heads import FEATURE_KINDS, HEADS, teacher_specs
from vitlab.utils.errors import MissingFileError, UserError
from vitlab.utils.values import check_range

if TYPE_CHECKING:
    from vitlab.data.naflex_batch import NaFlexBatch

DISTILL_TYPES = ("soft", "hard")
DISTILL_KINDS = ("logits", *FEATURE_KINDS)  # logits: DeiT's (here); feature, tokens: feature_distill.py


@dataclass(frozen=True)
class DistillConfig(ClassifyConfig):
    """conf/objective/distill.yaml: objective=classify's options and DeiT's --distillation-type, --distillation-alpha,
    --distillation-tau, --teacher-model."""

    type: str = "hard"  # DISTILL_TYPES
    alpha: float = 0.5  # the distillation term's weight; the label loss gets 1 - alpha
    tau: float = 1.0  # soft: the temperature
    teacher: str | None = None  # a vitlab checkpoint (.ckpt) or a timm model name
    teacher_pretrained: bool = True  # a timm name: its pretrained weights (false: random ones, to try the wiring)
    # Feature and token distillation (feature_distill.py): what is distilled, from whom, how the terms weigh.
    kind: str = "logits"  # DISTILL_KINDS
    teachers: list[Any] | None = None  # feature, tokens: several teachers (sources, or {teacher, weight, name})
    task_weight: float | None = None  # feature, tokens: timm's task_loss_weight (null: 1 - alpha, or 1)
    distill_weight: float | None = None  # feature, tokens: timm's distill_loss_weight (null: alpha, or 1 - task)
    head: str = "mlp"  # tokens: the projection heads, HEADS
    cls_weight: float = 1.0  # tokens: the class token's cosine distance
    patch_weight: float = 1.0  # tokens: the patch tokens' term
    cos_weight: float = 0.9  # tokens: the patch tokens' cosine distance (AM-RADIO's 0.9)
    smooth_l1_weight: float = 0.1  # tokens: the patch tokens' smooth-L1 (AM-RADIO's 0.1)

    def __post_init__(self):
        super().__post_init__()
        if self.type not in DISTILL_TYPES:
            raise UserError(f"objective.type {self.type!r} is not one of {list(DISTILL_TYPES)}")
        check_range("objective.alpha", self.alpha, 0, 1)
        check_range("objective.tau", self.tau, 0, float("inf"), low_open=True, high_open=True)
        if self.kind not in DISTILL_KINDS:
            raise UserError(f"objective.kind {self.kind!r} is not one of {list(DISTILL_KINDS)}")
        if self.head not in HEADS:
            raise UserError(f"objective.head {self.head!r} is not one of {list(HEADS)}")
        for key in ("task_weight", "distill_weight", "cls_weight", "patch_weight", "cos_weight", "smooth_l1_weight"):
            if getattr(self, key) is not None:
                check_range(f"objective.{key}", getattr(self, key), 0, float("inf"), high_open=True)
        if self.teachers and self.kind == "logits":
            raise UserError(
                "objective.teachers (several teachers) distil features: give objective.kind=feature or tokens, or one "
                "objective.teacher for kind=logits"
            )
        if self.multilabel:
            raise UserError(
                f"objective=distill is DeiT's distillation of one label an image (type {self.type}: the teacher's "
                f"{'top class' if self.type == 'hard' else 'softmax'}), and objective.multilabel=true asks for "
                "several: train objective=classify objective.multilabel=true"
            )
        if not self.teacher and not self.teachers:
            raise UserError(
                "objective=distill needs objective.teacher: a vitlab checkpoint (.ckpt) or a timm model name"
            )
        teacher_specs(self.teacher, self.teachers, self.teacher_pretrained)  # (their entries checked)


class Distillation(Classification):
    """The label loss of objective=classify, (1 - alpha) of it, plus alpha x the distillation term against the
    teacher's logits on the same (mixed) images."""

    name = "distill"
    config_class = DistillConfig
    schedules = frozenset({"naflex"})  # the teacher sees each NaFlex batch (NaFlexBatch.teacher_logits)

    def __init__(self, options: Mapping[str, Any], model: ViTConfig):
        super().__init__(options, model)
        # The teacher: loaded when fitting begins, never saved with the student nor wrapped by DDP (not a submodule).
        self.teacher: Teacher | None = None
        self.student_norm: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, model: ViT) -> None:
        super().prepare(model)
        if model.cfg.distilled:
            model.set_distilled_training(True)  # training returns (class, distillation) logits apart

    def setup_fit(self, num_classes: int) -> None:
        self.teacher = load_teacher(self.cfg, num_classes)

    def taught_by(self) -> tuple[Any, ...]:
        return teacher_specs(self.cfg.teacher, self.cfg.teachers, self.cfg.teacher_pretrained)

    def teacher_networks(self) -> list[nn.Module]:
        """The teachers' networks, once fitting has loaded them."""
        return [self.teacher.kd.model] if self.teacher is not None else []

    def networks_beside(self) -> list[nn.Module]:
        return self.teacher_networks()

    def compile(self, model: ViT, mode: str, regional: bool = False) -> None:
        """The student as every objective compiles it, and each teacher's blocks with it (whichever of its methods
        the step calls runs them: forward, or forward_features for kind=tokens), forward graphs only."""
        super().compile(model, mode, regional)
        for teacher in self.teacher_networks():
            for block in getattr(teacher, "blocks", ()):
                block.compile(mode=mode)

    def fit_start(self, datamodule: Any, device: torch.device) -> None:
        """The teacher on this process's device, with the student's normalisation to undo."""
        super().fit_start(datamodule, device)  # (the label loss's class weights)
        if len(datamodule.mean) != (channels := self.teacher.kd.mean_kd.shape[1]):
            raise UserError(
                f"objective.teacher takes {channels}-channel images, and the data has {len(datamodule.mean)}"
            )
        self.teacher.to(device)
        self.student_norm = tuple(
            torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
            for v in (datamodule.mean, datamodule.std)
        )

    def training_loss(
        self, model: ViT, x: torch.Tensor, y: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.teacher is None or self.student_norm is None:
            raise RuntimeError("distillation needs the teacher: fit the module with a Trainer (its setup loads it)")
        x, target = self.mix(x, y, epoch)  # the teacher sees the images the student saw, mixed as they were
        out = model(x)
        logits, logits_kd = out if isinstance(out, tuple) else (out, out)  # distilled: the class token's, the other's
        loss = distillation_loss(
            self.label_loss(logits, target), logits_kd, self.teacher(x, *self.student_norm), self.cfg
        )
        if isinstance(out, tuple):
            logits = (out[0] + out[1]) / 2  # the metrics read the two heads' average, as evaluation does
        return loss, logits


def distillation_loss(
    label_loss: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, cfg: DistillConfig
) -> torch.Tensor:
    """DeiT's DistillationLoss, given the label loss and the logits the distillation term compares."""
    if cfg.type == "soft":
        T = cfg.tau
        kd = (
            F.kl_div(
                F.log_softmax(student / T, dim=1), F.log_softmax(teacher / T, dim=1), reduction="sum", log_target=True
            )
            * (T * T)
            / student.numel()
        )
    else:
        kd = F.cross_entropy(student, teacher.argmax(dim=1))
    return label_loss * (1 - cfg.alpha) + kd * cfg.alpha


class Teacher(nn.Module):
    """timm's DistillationTeacher around a frozen classifier, and the input size it takes: called on the student's
    normalised batch (and the student's mean and std), it returns its logits."""

    def __init__(self, model: nn.Module, input_hw: Sequence[int]):
        from timm.task.distillation import DistillationTeacher

        super().__init__()
        self.kd = DistillationTeacher(model.requires_grad_(False))  # mean and std: the model's pretrained_cfg
        self.input_hw = tuple(int(s) for s in input_hw)

    def train(self, mode: bool = True) -> Teacher:
        return super().train(False)  # always in eval mode (dropout, stochastic depth off)

    @torch.no_grad()
    def forward(self, x: torch.Tensor | NaFlexBatch, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # a batch of another kind (NaFlex's patches) readies itself for a teacher
            return x.teacher_logits(self.kd, mean, std)
        return self.kd(self.prepare(x, mean, std)).float()

    def prepare(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """The student's normalised batch as the teacher takes it: renormalised to its mean and std, resized to its
        input size."""
        channels = self.kd.mean_kd.shape[1]
        if x.shape[1] != channels:
            raise UserError(
                f"objective.teacher takes {channels}-channel images, and the data has {x.shape[1]} channels"
            )
        x = self.kd.normalize_input(x, mean, std)
        if tuple(x.shape[-2:]) != self.input_hw:
            x = F.interpolate(x, size=self.input_hw, mode="bicubic", align_corners=False, antialias=True)
        return x


def load_teacher(cfg: DistillConfig, num_classes: int) -> Teacher:
    """The teacher `cfg.teacher` names, checked to predict the student's `num_classes` classes."""
    source = str(cfg.teacher)
    teacher = open_teacher(source, cfg.teacher_pretrained, num_classes)
    classes = getattr(teacher.kd.model, "num_classes", None)
    if classes != num_classes:
        raise UserError(
            f"objective.teacher {source!r} predicts {classes} classes and the student {num_classes}: a teacher of the "
            "same classes is needed"
        )
    return teacher


def open_teacher(source: str, pretrained: bool, num_classes: int) -> Teacher:
    """The teacher `source` names: a vitlab checkpoint (.ckpt) or a timm name (`num_classes`: its head without
    pretrained weights)."""
    return _from_checkpoint(source) if source.endswith(".ckpt") else _from_timm(source, pretrained, num_classes)


def _from_checkpoint(path: str) -> Teacher:
    """A vitlab training checkpoint: its model (the weights the checkpoint holds: the best's, EMA's where chosen)
    and its data's normalisation (the data module's own when the config left it null)."""
    from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint

    if not Path(path).is_file() and not is_sharded_checkpoint(path):  # (read_checkpoint's message names ckpt_path)
        raise MissingFileError(f"objective.teacher {path!r} does not exist: a vitlab checkpoint (.ckpt) or a timm name")
    ckpt = read_checkpoint(path)
    hp = ckpt["hyper_parameters"]
    model = ViT(ViTConfig.from_dict(hp["model"]))
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(weights)
    mean, std = normalisation(hp.get("data") or {})
    if mean is None or std is None:
        raise UserError(f"objective.teacher {path!r}: its checkpoint does not say how its images were normalised")
    model.pretrained_cfg.update(mean=tuple(mean), std=tuple(std))
    return Teacher(model, model.cfg.img_hw)


def normalisation(data: Mapping[str, Any]) -> tuple[Any, Any]:
    """(mean, std) a checkpoint's images were normalised with: its data config's, or its data module's own where the
    config left them null (None where neither says)."""
    kind = pydoc.locate(str(data.get("_target_", "")))
    return data.get("mean") or getattr(kind, "mean", None), data.get("std") or getattr(kind, "std", None)


def _from_timm(name: str, pretrained: bool, num_classes: int) -> Teacher:
    """A timm model name: timm's model and weights (fetched through the hub, one-line error offline), its
    pretrained configuration's mean, std and input size."""
    import timm
    from timm.data import resolve_data_config

    from vitlab.convert.timm_hub import check_timm_name, from_the_hub

    check_timm_name(name)
    if pretrained:  # its own head: the classes it was trained on
        with from_the_hub(name):
            model = timm.create_model(name, pretrained=True)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    return Teacher(model, resolve_data_config({}, model=model)["input_size"][-2:])
