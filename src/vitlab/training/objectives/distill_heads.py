"""The parts of feature and token distillation (objective=distill objective.kind=feature|tokens, feature_distill.py):
the teachers named in the config, the loss weights as timm's tasks resolve them, the projection heads, a teacher's
width and patch grid, the losses (timm's FeatureDistillationTask's MSE; AM-RADIO's cosine and smooth-L1), and the
bilinear resampling of a teacher's patch grid to the student's. No Lightning or Hydra here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.utils.errors import UserError
from vitlab.utils.values import check_range

FEATURE_KINDS = ("feature", "tokens")
HEADS = ("mlp", "linear")


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher of a feature or token distillation: where its weights are, its name in the logs, its weight."""

    name: str
    source: str
    weight: float = 1.0
    pretrained: bool = True


def teacher_specs(teacher: str | None, teachers: Sequence[Any] | None, pretrained: bool) -> tuple[TeacherSpec, ...]:
    """objective.teacher (one teacher, named `teacher`) or objective.teachers: a list of sources, or of
    {teacher, weight, name, pretrained} (its name: the one given, else the file's stem or timm name)."""
    if teacher and teachers:
        raise UserError("give objective.teacher (one teacher) or objective.teachers (several), not both")
    if not teachers:
        return (TeacherSpec("teacher", str(teacher), 1.0, pretrained),)
    specs, seen = [], set()
    for i, entry in enumerate(teachers):
        entry = {"teacher": entry} if isinstance(entry, str) else dict(entry)
        unknown = sorted(set(entry) - {"teacher", "weight", "name", "pretrained"})
        if unknown or not entry.get("teacher"):
            raise UserError(
                f"objective.teachers[{i}] {entry}: give a source, or {{teacher: <.ckpt | timm name>, weight: <w>, "
                f"name: <in the logs>, pretrained: <bool>}}{f' (unknown: {unknown})' if unknown else ''}"
            )
        source = str(entry["teacher"])
        name = re.sub(r"\W+", "_", str(entry.get("name") or Path(source).stem.split(".")[0] or source)).strip("_")
        name = name if name not in seen else f"{name}_{i}"
        seen.add(name)
        check_range(f"objective.teachers[{i}].weight", entry.get("weight", 1.0), 0, math.inf, high_open=True)
        specs.append(
            TeacherSpec(name, source, float(entry.get("weight", 1.0)), bool(entry.get("pretrained", pretrained)))
        )
    return tuple(specs)


def loss_weights(task: float | None, distill: float | None, alpha: float) -> tuple[float, float]:
    """(task, distill) weights as timm's distillation tasks resolve them; neither given: DeiT's alpha."""
    if distill is not None:
        return (1.0 if task is None else task), distill
    if task is not None:
        return task, 1.0 - task
    return 1.0 - alpha, alpha


def make_head(in_dim: int, out_dim: int, kind: str) -> nn.Module:
    """A projection head: linear (timm's feature projection), or AM-RADIO's MLP (Linear, LayerNorm, GELU, Linear;
    its hidden width the teacher's)."""
    if kind == "linear":
        return nn.Linear(in_dim, out_dim)
    return nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))


class DistillHeads(nn.ModuleDict):
    """The projection heads, `<teacher>` (feature) or `<teacher>_cls` and `<teacher>_patch` (tokens), built once the
    teachers' widths are known (fitting starts). A checkpoint loaded without a teacher (vitlab.eval, predict of the
    student) rebuilds them from its own shapes first."""

    def __init__(self):
        super().__init__()
        self._register_load_state_dict_pre_hook(self._build_from_state)

    def _build_from_state(self, state: Mapping[str, torch.Tensor], prefix: str, *args) -> None:
        names = {k[len(prefix) :].split(".")[0] for k in state if k.startswith(prefix)}
        for name in sorted(names - set(self.keys())):
            p = f"{prefix}{name}."
            if f"{p}0.weight" in state:  # the MLP
                hidden, in_dim = state[f"{p}0.weight"].shape
                self[name] = make_head(int(in_dim), int(hidden), "mlp")
            else:
                out_dim, in_dim = state[f"{p}weight"].shape
                self[name] = make_head(int(in_dim), int(out_dim), "linear")


@dataclass(frozen=True)
class TeacherShape:
    """What a teacher gives, found by one forward of a blank image: its width, prefix tokens and patch grid."""

    width: int
    prefix: int
    grid: tuple[int, int] | None  # None: no patch tokens (a CNN's feature map, pooled features only)


def probe_teacher(model: nn.Module, input_hw: Sequence[int], channels: int, source: str) -> TeacherShape:
    """The teacher's width, prefix-token count and patch grid at its input size, by one forward of a blank image (on
    the device of its weights: the meta device gives the shapes without weights)."""
    input_hw = tuple(int(v) for v in input_hw)
    with torch.no_grad():
        x = torch.zeros(1, channels, *input_hw, device=next(model.parameters()).device)
        tokens = model.forward_features(x)
        pooled = model.forward_head(tokens, pre_logits=True)
    width = int(pooled.shape[-1])
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3:
        return TeacherShape(width, 0, None)
    prefix = int(getattr(model, "num_prefix_tokens", 1))
    patches = tokens.shape[1] - prefix
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    grid = None
    if patch is not None:
        ph, pw = (patch, patch) if isinstance(patch, int) else patch
        for rounding in (math.floor, math.ceil):  # (a padded dynamic input: the ceiling)
            h, w = rounding(input_hw[0] / ph), rounding(input_hw[1] / pw)
            if h * w == patches:
                grid = (h, w)
                break
    if grid is None:
        raise UserError(
            f"objective.teacher {source!r}: its {patches} patch tokens at {input_hw[0]}x{input_hw[1]} "
            "px are no grid of its patch size, so they cannot be resampled to the student's: use objective.kind=feature"
        )
    return TeacherShape(int(tokens.shape[-1]), prefix, grid)


def build_heads(
    heads: DistillHeads, kind: str, head: str, student_dim: int, shapes: Mapping[str, TeacherShape], sources: Mapping
) -> None:
    """The heads of every teacher (those a loaded checkpoint built already are kept)."""
    for name, shape in shapes.items():
        if kind == "feature":
            if shape.width != student_dim and name not in heads:  # timm: no projection when the widths agree
                heads[name] = make_head(student_dim, shape.width, "linear")
            continue
        if shape.grid is None:
            raise UserError(
                f"objective.kind=tokens distils patch tokens, and objective.teacher {sources[name]!r} has none (its "
                "features are a map, as a CNN's): use objective.kind=feature with it"
            )
        for part in ("cls", "patch"):
            if f"{name}_{part}" not in heads:
                heads[f"{name}_{part}"] = make_head(student_dim, shape.width, head)


def feature_loss(student: torch.Tensor, teacher: torch.Tensor, head: nn.Module | None) -> torch.Tensor:
    """timm's FeatureDistillationTask: MSE of the (projected) student's pooled pre-logits to the teacher's."""
    return F.mse_loss(student if head is None else head(student), teacher)


@dataclass(frozen=True)
class TokenWeights:
    cls_weight: float = 1.0
    patch_weight: float = 1.0
    cos_weight: float = 0.9
    smooth_l1_weight: float = 0.1


def token_loss(
    s_cls: torch.Tensor, s_patch: torch.Tensor, t_cls: torch.Tensor, t_patch: torch.Tensor, w: TokenWeights
) -> torch.Tensor:
    """AM-RADIO's: cosine distance of the class tokens (B, D); cosine distance and smooth-L1 of the patch tokens
    (B, N, D), the teacher's already on the student's grid."""
    cls = 1 - F.cosine_similarity(s_cls, t_cls, dim=-1).mean()
    cos = 1 - F.cosine_similarity(s_patch, t_patch, dim=-1).mean()
    return w.cls_weight * cls + w.patch_weight * (
        w.cos_weight * cos + w.smooth_l1_weight * F.smooth_l1_loss(s_patch, t_patch)
    )


def resample_grid(tokens: torch.Tensor, grid: tuple[int, int], to: tuple[int, int]) -> torch.Tensor:
    """Patch tokens (B, h*w, D) on `grid` -> (B, H*W, D) on `to`, bilinearly (the same unless the grids differ)."""
    if tuple(grid) == tuple(to):
        return tokens
    B, _, D = tokens.shape
    x = tokens.transpose(1, 2).reshape(B, D, *grid)
    x = F.interpolate(x, size=to, mode="bilinear", align_corners=False)
    return x.flatten(2).transpose(1, 2)


def teacher_tokens(teacher: Any, x: torch.Tensor, shape: TeacherShape, to: tuple[int, int]) -> tuple:
    """The teacher's (class token or pooled features (B, D), patch tokens on the student's grid (B, N, D)), from its
    input `x` (renormalised and resized: distillation.Teacher.prepare), without gradients."""
    model = teacher.kd.model
    with torch.no_grad():
        tokens = model.forward_features(x)
        summary = model.forward_head(tokens, pre_logits=True)
        patches = resample_grid(tokens[:, shape.prefix :], shape.grid, to)
    return summary.float(), patches.float()


def student_grid(model: Any, x: torch.Tensor) -> tuple[int, int]:
    """The student's patch grid for images `x` (a padded dynamic input: the ceiling)."""
    ph, pw = model.cfg.patch_hw
    return math.ceil(x.shape[-2] / ph), math.ceil(x.shape[-1] / pw)
