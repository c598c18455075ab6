"""The arithmetic of self-distillation, written as its references compute it
(tests/training/objectives/test_dino_losses.py holds each to the reference's code, written out): DINO's schedules (dino
utils.py cosine_scheduler; main_dino.py's teacher temperature), its cross-entropy over view pairs and teacher centering
(main_dino.py DINOLoss), DINOv2's Sinkhorn-Knopp teacher (loss/dino_clstoken_loss.py), iBOT's masked-patch loss
(loss/ibot_patch_loss.py), the KoLeo regulariser (loss/koleo_loss.py), the teacher's EMA step and DINO's per-parameter
gradient clipping (utils.clip_gradients); iBOT's block masks are the data's (data/multicrop.py). No Lightning or Hydra
here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# ---- schedules ---------------------------------------------------------------------------------------------------
def cosine_schedule(step: int, base: float, final: float, total: int, warmup: int = 0, start: float = 0.0) -> float:
    """utils.cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs, start_warmup_value)[step], with
    `total` = epochs x niter_per_ep and `warmup` = warmup_epochs x niter_per_ep iterations: np.linspace(start, base,
    warmup) first, then final + (base - final) (1 + cos(pi i / (total - warmup))) / 2 for i = 0 .. total - warmup - 1.
    A step past the end keeps the last value."""
    step = min(step, total - 1)
    if step < warmup:
        return start + (base - start) * step / (warmup - 1) if warmup > 1 else start
    i, n = step - warmup, total - warmup
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * i / n))


def teacher_temperature(epoch: int, warmup_temp: float, temp: float, warmup_epochs: int) -> float:
    """main_dino.py DINOLoss.teacher_temp_schedule[epoch]: np.linspace(warmup_temp, temp, warmup_epochs), then temp."""
    if epoch < warmup_epochs:
        return warmup_temp + (temp - warmup_temp) * epoch / (warmup_epochs - 1) if warmup_epochs > 1 else warmup_temp
    return temp


# ---- across processes --------------------------------------------------------------------------------------------
def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if _world() > 1:
        dist.all_reduce(t)
    return t


# ---- the teacher's targets ---------------------------------------------------------------------------------------
@torch.no_grad()
def sinkhorn_knopp(teacher: torch.Tensor, temp: float, iterations: int = 3, count: torch.Tensor | None = None):
    """dinov2 DINOLoss.sinkhorn_knopp_teacher (and iBOTPatchLoss's, whose batch `count` is the masked patches of
    every process): (B, K) logits -> (B, K) targets whose prototypes are used equally over the global batch."""
    Q = torch.exp(teacher.float() / temp).t()  # K x B
    B = _all_reduce(count.clone()) if count is not None else Q.shape[1] * _world()
    K = Q.shape[0]
    Q /= _all_reduce(torch.sum(Q))
    for _ in range(iterations):
        Q /= _all_reduce(torch.sum(Q, dim=1, keepdim=True))
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


class DINOLoss(nn.Module):
    """The class-token loss: targets from the teacher (centred softmax at the teacher's temperature, or Sinkhorn-Knopp),
    the cross-entropy of each student view against each teacher (global) view but its own, averaged over the pairs
    (DINO's; DINOv2's global and local terms with their scales add up to the same mean). `center`: the running mean
    of the teacher's outputs (momentum 0.9), a buffer (checkpointed; DINO saves it as 'dino_loss')."""

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9, patch: bool = False):
        super().__init__()
        self.student_temp, self.center_momentum = student_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, 1, out_dim) if patch else torch.zeros(1, out_dim))

    @torch.no_grad()
    def targets(self, teacher: torch.Tensor, temp: float, centering: str, count: torch.Tensor | None = None):
        if centering == "sinkhorn_knopp":
            return sinkhorn_knopp(teacher, temp, count=count)
        return F.softmax((teacher - self.center.reshape(-1)) / temp, dim=-1)

    def forward(self, student: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """`student`: each view's outputs (B, K); `targets`: each global view's, the first len(targets) views of the
        student being the same images' global views (skipped against their own target)."""
        total, terms = 0.0, 0
        for iq, q in enumerate(targets):
            for v, s in enumerate(student):
                if v == iq:
                    continue
                total = total + torch.sum(-q * F.log_softmax(s / self.student_temp, dim=-1), dim=-1).mean()
                terms += 1
        return total / terms

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor) -> None:
        """DINO's update_center over the global batch; iBOT's (`patch`) of (1, M, K) masked-patch outputs."""
        if self.center.dim() == 3:
            batch_center = _all_reduce(torch.sum(teacher.mean(1), dim=0, keepdim=True))
        else:
            batch_center = _all_reduce(torch.sum(teacher, dim=0, keepdim=True))
        batch_center = batch_center / (len(teacher) * _world())
        self.center.mul_(self.center_momentum).add_(batch_center.view_as(self.center) * (1 - self.center_momentum))


def ibot_loss(student: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor, student_temp: float) -> torch.Tensor:
    """dinov2 iBOTPatchLoss.forward_masked: the cross-entropy of the student's outputs at the masked patches (M, K)
    against the teacher's targets there, each patch weighted by 1 / the masked patches of its image, summed and
    divided by the images (`masks`: (images, patches), bool)."""
    loss = torch.sum(targets * F.log_softmax(student / student_temp, dim=-1), dim=-1)
    weight = (1 / masks.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(masks)[masks]
    return -(loss * weight).sum() / masks.shape[0]


def koleo_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """dinov2 KoLeoLoss: -mean log distance of each L2-normalised feature to its nearest neighbour in the batch."""
    x = F.normalize(x.float(), eps=eps, p=2, dim=-1)
    dots = torch.mm(x, x.t())
    n = x.shape[0]
    dots.view(-1)[:: (n + 1)].fill_(-1)  # not itself
    nearest = torch.max(dots, dim=1).indices
    distances = F.pairwise_distance(x, x[nearest], p=2, eps=eps)
    return -torch.log(distances + eps).mean()


# ---- the teacher's step, the student's gradients ----------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's shard on this process (teacher and student are sharded alike), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def ema_update(teacher: Iterable[torch.Tensor], student: Iterable[torch.Tensor], momentum: float) -> None:
    """teacher = teacher x m + student x (1 - m), parameter by parameter (main_dino.py's; dinov2's _foreach form)."""
    t, s = [_local(p) for p in teacher], [_local(p).detach() for p in student]
    torch._foreach_mul_(t, momentum)
    torch._foreach_add_(t, s, alpha=1 - momentum)


@torch.no_grad()
def clip_per_parameter(params: Iterable[torch.Tensor], clip: float) -> None:
    """DINO's utils.clip_gradients: each parameter's gradient scaled to norm `clip` where larger (norm + 1e-6).
    Sharded gradients: each norm summed over the shards in one all-reduce."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    grads = [_local(p.grad) for p in params]
    squares = torch.stack([g.float().pow(2).sum() for g in grads])
    mesh = getattr(params[0].grad, "device_mesh", None)
    if mesh is not None:
        dist.all_reduce(squares, group=mesh.get_group())
    coef = (clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, list(coef.to(grads[0].dtype).unbind()))
