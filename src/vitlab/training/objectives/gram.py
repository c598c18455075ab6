"""DINOv3's Gram anchoring (Siméoni et al. 2025, sec. 4; facebookresearch/dinov3 loss/gram_loss.py,
train/ssl_meta_arch.py, train/train.py), `objective.gram` of objective=dino: long DINO runs keep improving the class
token while their patch features lose their locality; the Gram loss holds the student's patch-to-patch similarities
on the global crops (the Gram matrix of its L2-normalised final patch tokens, iBOT's masks applied as the student sees
them) to those of the Gram teacher, an earlier copy of the EMA teacher's backbone, by their mean squared difference.

The Gram teacher is taken from the EMA teacher before optimizer step `start` (dinov3's gram.it_load_ema_teacher),
the loss counts from that step on, and the Gram teacher is taken again after every `update_every` steps from there
(its rep_update / update_frequency; dinov3 counts from iteration 0 and from it_first_update, with max_updates; 0 here:
never again). It runs without drop path on the unmasked global crops, at the student's size: dinov3's high-resolution
option (the Gram teacher fed crops of gram_teacher_crops_size from the data pipeline, its patch features resized to
the student's grid) needs a third view from the loader and is not here. The loss weight is constant (dinov3's
ViT-7B recipe ramps it from 1 to 2 by gram.loss_weight_schedule). No Lightning or Hydra here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, from_mapping


@dataclass(frozen=True)
class GramConfig:
    """`objective.gram` (conf/objective/dino.yaml): dinov3's `gram:` keys, the ViT-7B anchoring recipe's values
    (configs/train/dinov3_vit7b16_gram_anchor.yaml) but the loss off."""

    loss_weight: float = 0.0  # 0: off (dinov3's gram.use_loss false); its recipe: 1.0 (ramped to 2.0)
    update_every: int = 10000  # optimizer steps between refreshes of the Gram teacher; 0: never refreshed
    start: int = 0  # the optimizer step before which the Gram teacher is taken and from which the loss counts
    normalized: bool = True  # L2-normalise each patch feature first (gram.normalized)
    img_level: bool = True  # one Gram matrix per image; false: one over the batch's patches (dinov3's default)
    remove_neg: bool = False  # negative similarities set to 0 in both matrices
    remove_only_teacher_neg: bool = False  # the teacher's negative similarities set to 0 (see gram_loss)

    def __post_init__(self):
        check_at_least("objective.gram.loss_weight", self.loss_weight, 0)
        check_at_least("objective.gram.update_every", self.update_every, 0)
        check_at_least("objective.gram.start", self.start, 0)
        if self.remove_neg and self.remove_only_teacher_neg:  # dinov3's GramLoss asserts one at most
            raise UserError("objective.gram.remove_neg and objective.gram.remove_only_teacher_neg exclude each other")

    @classmethod
    def from_dict(cls, values: Any) -> GramConfig:
        return from_mapping(cls, values or {}, "objective.gram")

    @property
    def on(self) -> bool:
        return self.loss_weight > 0

    def active(self, step: int) -> bool:
        """Whether the loss counts at optimizer step `step`."""
        return self.on and step >= self.start

    def taken_after(self, step: int) -> bool:
        """Whether the Gram teacher is taken from the EMA teacher after optimizer step `step`: just before `start`
        (at 0 it starts as the teacher does), then every `update_every` steps."""
        done = step + 1 - self.start
        return self.on and (done == 0 or (self.update_every > 0 and done > 0 and done % self.update_every == 0))


def gram_loss(student: torch.Tensor, teacher: torch.Tensor, cfg: GramConfig) -> torch.Tensor:
    """dinov3 GramLoss.forward: patch features (B, N, D) of student and Gram teacher -> the MSE of their Gram
    matrices (B, N, N), or with img_level false of the (B*N, B*N) one, in float32. remove_only_teacher_neg does what
    dinov3's code does: its second line, meant to zero the student's similarities where both are negative, reads the
    teacher's matrix after its negatives were set to 0, so it changes nothing: the teacher's alone are clamped."""
    s, t = student.float(), teacher.float()
    if cfg.normalized:
        s, t = F.normalize(s, dim=-1), F.normalize(t, dim=-1)
    if not cfg.img_level:
        s, t = s.flatten(0, 1), t.flatten(0, 1)
    s_sim, t_sim = s @ s.transpose(-1, -2), t @ t.transpose(-1, -2)
    if cfg.remove_neg:
        t_sim, s_sim = t_sim.clamp(min=0), torch.where(s_sim < 0, 0.0, s_sim)
    elif cfg.remove_only_teacher_neg:
        t_sim = t_sim.clamp(min=0)
    return F.mse_loss(s_sim, t_sim)
