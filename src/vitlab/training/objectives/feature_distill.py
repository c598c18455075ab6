"""`objective=distill objective.kind=feature|tokens`: distilling a teacher's features, not its logits, so that a small
backbone learns from a big one (self-supervised or not, of any classes), with or without labels.

- `feature`: timm 1.0.31's `FeatureDistillationTask`: the student's pooled pre-logits (forward_head(pre_logits=True))
  through a learned linear projection to the teacher's width (none when the widths agree, as timm), mean squared error
  to the teacher's pooled pre-logits. The same loss and gradients as timm's task (tests/training/objectives).
- `tokens`: AM-RADIO's (Ranzinger et al. 2024): the student's class token (its pooled pre-logits where it pools
  otherwise) and its patch tokens, each through its own projection head (`objective.head`: mlp, AM-RADIO's
  Linear-LayerNorm-GELU-Linear, or linear) to the teacher's; class token: cosine distance; patch tokens: cos_weight x
  cosine distance + smooth_l1_weight x smooth-L1 (AM-RADIO's 0.9 and 0.1). Where the grids differ (a /14 teacher at
  224 px and a /16 student; other input sizes) the teacher's patch grid is resampled bilinearly to the student's.
  timm's `token_distillation.py` is DeiT's distillation token (kind=logits here), not patch tokens.

The label loss (objective=classify's, MixUp/CutMix included: the teachers see the mixed images) is weighted with the
distillation term as timm's tasks weigh it (distill_heads.loss_weights). Without labels (data.labels=false) the loss
is the distillation term alone, the classifier head (if any) frozen, and the best checkpoint the one of the lowest
val/loss, the same term on the validation images. Several teachers (`objective.teachers`) each have their weight and
their own heads; each one's term is logged as train/loss_<name> (the label loss as train/loss_task). The teachers:
loaded as objective=distill loads its one (a vitlab .ckpt or a timm name), in eval mode, under torch.no_grad, on each
process's device, never saved with the student. The heads train with the student (checkpoint keys `distill_heads.*`);
vitlab.export writes the plain ViT without them. No Lightning or Hydra here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from vitlab.model import ViT, ViTConfig
from vitlab.training.objectives.classification import Classification
from vitlab.training.objectives.distill_heads import (
    DistillHeads,
    TeacherShape,
    TeacherSpec,
    TokenWeights,
    build_heads,
    feature_loss,
    loss_weights,
    probe_teacher,
    student_grid,
    teacher_specs,
    teacher_tokens,
    token_loss,
)
from vitlab.training.objectives.distillation import Distillation, DistillConfig, Teacher, open_teacher
from vitlab.utils.errors import UserError
from vitlab.utils.values import from_mapping


class FeatureDistillation(Distillation):
    """objective=distill with kind=feature (timm's FeatureDistillationTask) or tokens (AM-RADIO's), one teacher or
    several, with or without labels."""

    calls_features = True  # the student's pooled features and tokens, each step

    def __init__(self, options: Mapping[str, Any], model: ViTConfig):
        if model.num_classes >= 2:
            Classification.__init__(self, options, model)  # the label loss's settings (a head to train)
        else:  # a backbone without a head: distilled without labels (check() says so where labels are read)
            self.cfg, self.mixup, self.bce = from_mapping(DistillConfig, options, "objective=distill"), None, None
        c = self.cfg
        self.specs = teacher_specs(c.teacher, c.teachers, c.teacher_pretrained)
        self.task_weight, self.distill_weight = loss_weights(c.task_weight, c.distill_weight, c.alpha)
        self.token_weights = TokenWeights(c.cls_weight, c.patch_weight, c.cos_weight, c.smooth_l1_weight)
        self.student_dim = model.embed_dim
        # What fitting loads (the teachers, the student's normalisation) is shared with a copy of the module (EMA's
        # average deep-copies it before fitting begins), not copied.
        self.fitted = SimpleNamespace(teachers={}, student_norm=None)
        self.terms: dict[str, torch.Tensor] = {}
        # The heads, from the teachers' shapes read without their weights (the meta device); a teacher not at hand
        # (a student's checkpoint read for evaluation) leaves its heads to the checkpoint's shapes (DistillHeads).
        self.heads = DistillHeads()
        self.shapes = {s.name: shape for s in self.specs if (shape := _meta_shape(s, model.num_classes)) is not None}
        self._build_heads()

    @property
    def teachers(self) -> dict[str, Teacher]:
        return self.fitted.teachers

    @property
    def student_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.fitted.student_norm

    def teacher_networks(self) -> list[nn.Module]:
        return [t.kd.model for t in self.teachers.values()]

    def networks_beside(self) -> list[nn.Module]:
        return [*self.teacher_networks(), *self.heads.values()]

    def share_fitted(self, other: FeatureDistillation) -> None:
        self.fitted = other.fitted  # (as __deepcopy__ shares it)

    def __deepcopy__(self, memo: dict) -> FeatureDistillation:
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, value if key == "fitted" else copy.deepcopy(value, memo))
        return copied

    def _build_heads(self) -> None:
        build_heads(self.heads, self.cfg.kind, self.cfg.head, self.student_dim, self.shapes,
                    {s.name: s.source for s in self.specs})  # fmt: skip

    def read_no_labels(self) -> None:
        super().read_no_labels()
        self.best = ("loss", "min")  # the distillation term on the validation images

    def check(self, model: ViTConfig, optim: Any) -> None:
        if self.uses_labels and model.num_classes < 2:
            raise UserError(
                f"model.num_classes {model.num_classes}: objective.kind={self.cfg.kind} with labels trains a "
                "classifier head beside the distillation; distil the backbone alone with data.labels=false"
            )

    def prepare(self, model: ViT) -> None:
        if self.uses_labels:
            super().prepare(model)
        else:  # no labels: the head (if any) learns nothing and stays out of DDP's gradients
            for head in (model.head, getattr(model, "head_dist", None)):
                if isinstance(head, nn.Module):
                    head.requires_grad_(False)

    def extra_modules(self) -> dict[str, nn.Module]:
        return {"distill_heads": self.heads}

    def term_names(self) -> tuple[str, ...]:
        return (*(s.name for s in self.specs), *(("task",) if self.uses_labels else ()))

    def metrics(self, stage: str, num_classes: int) -> dict[str, Metric]:
        return super().metrics(stage, num_classes) if self.uses_labels else {}

    def setup_fit(self, num_classes: int) -> None:
        """Each teacher loaded, its width and patch grid found, and the heads built (kept where a checkpoint loaded
        them already)."""
        for spec in self.specs:
            if spec.name not in self.teachers:
                self.teachers[spec.name] = open_teacher(spec.source, spec.pretrained, num_classes)
            if spec.name not in self.shapes:
                t = self.teachers[spec.name]
                self.shapes[spec.name] = probe_teacher(t.kd.model, t.input_hw, t.kd.mean_kd.shape[1], spec.source)
        self._build_heads()

    def fit_start(self, datamodule: Any, device: torch.device) -> None:
        for teacher in self.teachers.values():
            if len(datamodule.mean) != (channels := teacher.kd.mean_kd.shape[1]):
                raise UserError(
                    f"objective.teacher takes {channels}-channel images, and the data has {len(datamodule.mean)}"
                )
            teacher.to(device)
        self.heads.to(device)
        self.fitted.student_norm = tuple(
            torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
            for v in (datamodule.mean, datamodule.std)
        )

    def training_loss(
        self, model: ViT, x: torch.Tensor, y: torch.Tensor | None, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """timm's order: the student's tokens, its logits and pooled pre-logits from them, the label loss, then each
        teacher's term; task_weight x label loss + distill_weight x the teachers' weighted sum."""
        if not isinstance(x, torch.Tensor):
            raise UserError(  # (NaFlex's patch sequences: kind=logits takes them)
                f"objective.kind={self.cfg.kind} distils image batches, and this batch is {type(x).__name__}'s: use "
                "objective.kind=logits with it"
            )
        target = None
        if self.uses_labels:
            x, target = self.mix(x, y, epoch)  # the teachers see the images the student saw, mixed as they were
        tokens = model.forward_features(x)
        logits = model.forward_head(tokens) if self.uses_labels else None
        distill = self.distillation(model, tokens, x)
        if not self.uses_labels:
            return distill, None
        task = self.label_loss(logits, target)
        self.terms["task"] = task.detach()
        return self.task_weight * task + self.distill_weight * distill, logits

    def evaluation_loss(self, model: ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With labels: the classifier's cross-entropy (val/acc chooses the checkpoint); without: the distillation
        term on the validation images."""
        if self.uses_labels:
            return super().evaluation_loss(model, x, y)
        return self.distillation(model, model.forward_features(x), x), None

    def distillation(self, model: ViT, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The teachers' terms, each weighted, summed (each kept in `terms` under the teacher's name)."""
        if not self.teachers or self.student_norm is None:
            raise RuntimeError("distillation needs its teachers: fit the module with a Trainer (its setup loads them)")
        pooled = model.forward_head(tokens, pre_logits=True)  # (B, D): the class token, or the pooled features
        grid = student_grid(model, x)
        total = None
        for spec in self.specs:
            teacher, shape = self.teachers[spec.name], self.shapes[spec.name]
            seen = teacher.prepare(x, *self.student_norm)
            if self.cfg.kind == "feature":
                with torch.no_grad():
                    target = teacher.kd(seen, return_features=True).float()
                term = feature_loss(pooled, target, self.heads[spec.name] if spec.name in self.heads else None)
            else:
                t_cls, t_patch = teacher_tokens(teacher, seen, shape, grid)
                s_cls = self.heads[f"{spec.name}_cls"](pooled)
                s_patch = self.heads[f"{spec.name}_patch"](tokens[:, model.num_prefix_tokens :])  # (B, N, D_t)
                term = token_loss(s_cls, s_patch, t_cls, t_patch, self.token_weights)
            self.terms[spec.name] = term.detach()
            total = spec.weight * term if total is None else total + spec.weight * term
        return total

    def optimized(self, model: ViT) -> nn.Module:
        """The heads train with the student: the optimizer's groups are built over both."""
        return _WithHeads(model, self.heads)


class _WithHeads(nn.Module):
    """The student and the heads as one module (names `model.*`, `distill_heads.*`, as the LightningModule's), for
    the optimizer's groups (no weight decay on the heads' biases and norms, as on the student's)."""

    def __init__(self, model: ViT, heads: DistillHeads):
        super().__init__()
        self.model, self.distill_heads = model, heads

    @property
    def blocks(self) -> nn.ModuleList:  # param_groups counts the student's depth
        return self.model.blocks

    def no_weight_decay(self) -> set[str]:
        return {f"model.{n}" for n in getattr(self.model, "no_weight_decay", lambda: set())()}


def _meta_shape(spec: TeacherSpec, num_classes: int) -> TeacherShape | None:
    """A teacher's shapes from its architecture alone, built on the meta device (no weights read): a vitlab
    checkpoint's model config (its file opened memory-mapped), a timm name's model. None where the source is not at
    hand; a teacher that cannot serve (no patch tokens, no grid) is refused here, before anything is built."""
    import timm
    from timm.data import resolve_data_config

    if spec.source.endswith(".ckpt"):
        if not Path(spec.source).is_file():
            return None
        hp = torch.load(spec.source, map_location="meta", mmap=True, weights_only=True).get("hyper_parameters") or {}
        if not isinstance(hp.get("model"), dict):
            return None
        cfg = ViTConfig.from_dict(hp["model"])
        with torch.device("meta"):
            model = ViT(cfg)
        return probe_teacher(model, cfg.img_hw, cfg.in_chans, spec.source)
    from vitlab.convert.timm_hub import check_timm_name

    check_timm_name(spec.source)  # (one line naming an unknown model)
    with torch.device("meta"):
        model = timm.create_model(
            spec.source, pretrained=False, **({} if spec.pretrained else {"num_classes": num_classes})
        )
    info = resolve_data_config({}, model=model)
    return probe_teacher(model, info["input_size"][-2:], info["input_size"][0], spec.source)
