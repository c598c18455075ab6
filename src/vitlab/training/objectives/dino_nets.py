"""The networks an objective=dino step runs (training/objectives/dino.py holds the objective, its config and its
schedules): the student as the optimizer's groups see it (`_Student`), and teacher, student and Gram teacher with the
loss as their forward (`_Nets`: what a sharded strategy shards), each term of it left on the objective for the log.
No Lightning or Hydra here."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitlab.model import ViT
from vitlab.training.objectives import dino_losses as L
from vitlab.training.objectives.gram import gram_loss


def pairs(a: nn.Module, b: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The parameters of two networks of one architecture, name by name."""
    theirs = dict(b.named_parameters())
    return [(p, theirs[name]) for name, p in a.named_parameters()]


@torch.no_grad()
def copy_weights(to: nn.Module, source: nn.Module) -> None:
    """`to`'s parameters become `source`'s (each process its shards: the two are sharded alike)."""
    for mine, theirs in pairs(to, source):
        L._local(mine).copy_(L._local(theirs))


class Student(nn.Module):
    """The student as the optimizer's groups see it: the backbone's parameters under the ViT's own names."""

    def __init__(self, student: nn.Module):
        super().__init__()
        backbone = student.backbone
        for name, child in backbone.named_children():
            self.add_module(name, child)
        for name, p in backbone.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, child in student.named_children():
            if name != "backbone":
                self.add_module(name, child)
        if hasattr(student, "mask_token"):
            self.register_parameter("mask_token", student.mask_token)
        self._no_decay = backbone.no_weight_decay() | {"mask_token"}

    def no_weight_decay(self) -> set[str]:
        return self._no_decay


class Nets(nn.Module):
    """Teacher and student, their forward the loss: what a sharded strategy shards (every view passes through here)."""

    def __init__(self, teacher: ViT, dino: Any):  # the objective (dino.py imports this module)
        super().__init__()
        self.teacher, self.student, self.teacher_heads = teacher, dino.student, dino.teacher
        self.gram_teacher = dino.gram_teacher  # None unless objective.gram.loss_weight
        self.dino = dino  # its config and losses (not a submodule: the module registers those)

    def _features(self, vit: ViT, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed tokens of a batch, the masked patches (iBOT) replaced by the mask token before the position
        embedding (dinov2's prepare_tokens_with_masks)."""
        if masks is None:
            return vit.forward_features(x)
        token = self.student.mask_token

        def mask(module, args, out):  # patch_embed's (B, h, w, D)
            return torch.where(masks.view(out.shape[:3]).unsqueeze(-1), token.to(out.dtype), out)

        handle = vit.patch_embed.register_forward_hook(mask)
        try:
            return vit.forward_features(x)
        finally:
            handle.remove()

    @staticmethod
    @torch.no_grad()
    def _frozen(vit: ViT, x: torch.Tensor) -> torch.Tensor:
        """A teacher's final normed tokens, without drop path (main_dino.py builds the teacher without)."""
        was = vit.training
        vit.eval()
        try:
            return vit.forward_features(x)
        finally:
            vit.train(was)

    def forward(self, views: list[torch.Tensor], masks: torch.Tensor | None, temp: float, update: bool):
        c, dino, t = self.dino.cfg, self.dino, self.teacher
        glob, locs = torch.cat(views[:2]), views[2:]
        prefix = t.num_prefix_tokens
        t_tokens = self._frozen(t, glob)
        with torch.no_grad():
            t_out = self.teacher_heads.dino_head(t.forward_head(t_tokens, pre_logits=True))
            targets = dino.dino_loss.targets(t_out, temp, c.centering).chunk(2)
            if update and c.centering == "center":
                dino.dino_loss.update_center(t_out)
            if masks is not None:
                head = getattr(self.teacher_heads, "ibot_head", self.teacher_heads.dino_head)
                t_patch = head(t_tokens[:, prefix:][masks])
                count = torch.tensor(float(len(t_patch)), device=t_patch.device)
                patch_targets = dino.ibot_loss.targets(t_patch, temp, c.centering, count)
                if update and c.centering == "center":
                    dino.ibot_loss.update_center(t_patch.unsqueeze(0))
        s = self.student
        s_tokens = self._features(s.backbone, glob, masks)
        cls = [s.backbone.forward_head(s_tokens, pre_logits=True)]
        if locs:  # DINO's MultiCropWrapper: the crops of one size in one forward
            cls.append(s.backbone.forward_head(s.backbone.forward_features(torch.cat(locs)), pre_logits=True))
        out = s.dino_head(torch.cat(cls)).chunk(len(views))
        terms = {"dino": dino.dino_loss(out, targets)}
        if c.koleo_weight:
            terms["koleo"] = sum(L.koleo_loss(p) for p in cls[0].chunk(2))
        if masks is not None:
            head = getattr(s, "ibot_head", s.dino_head)
            s_patch = head(s_tokens[:, prefix:][masks])
            terms["ibot"] = L.ibot_loss(s_patch, patch_targets, masks, c.student_temp)
        if c.gram.active(dino.step):  # dinov3: the student's masked global crops against the Gram teacher's
            terms["gram"] = gram_loss(s_tokens[:, prefix:], self._frozen(self.gram_teacher, glob)[:, prefix:], c.gram)
        if update:
            dino.terms = {name: term.detach() for name, term in terms.items()}
        weights = {"dino": c.dino_weight, "koleo": c.koleo_weight, "ibot": c.ibot_weight, "gram": c.gram.loss_weight}
        loss = weights["dino"] * terms.pop("dino")
        for name, term in terms.items():
            loss = loss + weights[name] * term
        return loss
