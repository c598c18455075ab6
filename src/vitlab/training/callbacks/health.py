"""What keeps a big run healthy (conf/callbacks/health.yaml, in every default callbacks group).

- **Norms** (big_vision's `l2_grads`, `l2_params`): at every logging step, the total gradient norm before any
  clipping (`train/grad_norm`), the parameter norm (`train/param_norm`) and the size of the update relative to the
  weights (`train/update_ratio` = ||θ_after − θ_before|| / ||θ_before||) of the trained parameters; with
  `per_block=true` also each encoder block's (`train/grad_norm/blocks.3`, ...). They are computed on the device and
  read only when Lightning writes its logs (no host wait on other steps). Under FSDP2 each process squares its own
  shards and one all-reduce sums them: the numbers DDP gives for the same run.
- **Spike guard** (`spike_factor=k`, off by default): the optimizer step is skipped (no update, no optimizer-state
  change: torch's optimizers pass over a parameter without a gradient) when the training loss or the gradient norm
  exceeds k × the median of the last `spike_window` accepted steps; the step count and the LR schedule go on, as
  they do past AMP's skipped steps. Each skip is logged and counted (`train/skipped_steps`), and more than
  `max_skips_in_a_row` in a row stop the run in one line naming the last good checkpoint. Its history is checkpointed,
  so a resumed run decides as the uninterrupted one would. Deciding reads two numbers on the host every step.
- **AGC** (`trainer.gradient_clip_algorithm=agc`, `trainer.gradient_clip_val` = its clip factor, timm's `--clip-mode
  agc --clip-grad`): timm's `adaptive_clip_grad`, unit-wise (per output row) on every trained parameter, after the
  norms and the guard. Lightning's Trainer knows only `value` and `norm`, so training.run.build hands AGC to
  `AdaptiveGradientClipping` instead.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from timm.utils.agc import adaptive_clip_grad, unitwise_norm
from torch.distributed.tensor import DTensor

from vitlab.training.callbacks.standard import last_good_checkpoint
from vitlab.utils.errors import TrainingFailed, UserError

log = logging.getLogger(__name__)


class LossSpikeError(TrainingFailed):
    """Too many optimizer steps in a row were skipped as spikes: the recipe (LR, warm-up, clipping), not the code."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def squared_sums(groups: list[list[torch.Tensor]], extra: torch.Tensor | None = None) -> torch.Tensor:
    """Σ t² over each group of tensors, whole over every process: DTensors (FSDP2's parameters and gradients) by
    their local shards, summed over the processes by one all-reduce; other tensors (the same on every process)
    counted once. `extra`, a per-process value, rides along averaged over the processes as the last entry."""
    sharded = [[_local(t) for t in g if isinstance(t, DTensor)] for g in groups]
    return local_squared_sums(sharded, [[t for t in g if not isinstance(t, DTensor)] for g in groups], extra)


def local_squared_sums(
    sharded: list[list[torch.Tensor]], whole: list[list[torch.Tensor]], extra: torch.Tensor | None = None
) -> torch.Tensor:
    """squared_sums with each group given as its shards (this process's part of tensors split over the processes)
    and its whole tensors."""
    device = next(
        (t.device for g in sharded + whole for t in g), torch.device("cpu") if extra is None else extra.device
    )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    sums = torch.zeros(2, len(sharded) + 1, device=device)
    for i, group in enumerate(sharded + whole):
        tensors = [t for t in group if t.numel()]
        if tensors:
            sums[i // len(sharded), i % len(sharded)] = (
                torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()
            )
    if extra is not None:
        sums[0, -1] = extra.detach().float() / (dist.get_world_size() if distributed else 1)
    if distributed and (extra is not None or any(sharded)):
        dist.all_reduce(sums[0])
    total = sums.sum(0)
    return total if extra is not None else total[:-1]


def trained(pl_module: L.LightningModule) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]


def blocks_of(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, list[int]]:
    """Each transformer block's parameters (indices into `named`), by the block's name: `blocks.3` (the ViT's),
    `student.backbone.blocks.3` (DINO's student), `decoder.decoder_blocks.1` (MAE's decoder)."""
    out: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(named):
        parts = name.split(".")
        at = next((j for j, p in enumerate(parts[:-1]) if p.endswith("blocks") and parts[j + 1].isdigit()), None)
        if at is not None:
            out.setdefault(".".join(parts[: at + 2]).removeprefix("model."), []).append(i)
    return out


class Health(L.Callback):
    def __init__(
        self,
        per_block: bool = False,
        update_ratio: bool = True,
        spike_factor: float | None = None,
        spike_window: int = 100,
        spike_min_history: int = 20,
        max_skips_in_a_row: int = 10,
    ) -> None:
        if spike_factor is not None and not spike_factor > 1:
            raise UserError(f"callbacks.health.spike_factor={spike_factor!r}: a factor over 1 (e.g. 5), or null (off)")
        for key, value, low in (("spike_window", spike_window, 1), ("spike_min_history", spike_min_history, 1),
                                ("max_skips_in_a_row", max_skips_in_a_row, 0)):  # fmt: skip
            if not isinstance(value, int) or value < low:
                raise UserError(f"callbacks.health.{key}={value!r}: an integer >= {low}")
        self.per_block, self.update_ratio = per_block, update_ratio
        self.factor, self.max_in_a_row = spike_factor, max_skips_in_a_row
        self.min_history = min(spike_min_history, spike_window)
        self.history: dict[str, deque[float]] = {k: deque(maxlen=spike_window) for k in ("loss", "grad_norm")}
        self.skipped = 0
        self.in_a_row = 0
        self._loss: list[torch.Tensor] = []
        self._before: list[torch.Tensor] | None = None
        self._param_sq: torch.Tensor | None = None

    @staticmethod
    def logs_now(trainer: L.Trainer) -> bool:
        """Whether the optimizer step about to be taken is one Lightning writes logs at (as ViTModule's loss)."""
        return (trainer.global_step + 1) % trainer.log_every_n_steps == 0

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.factor is not None:
            self._loss.append(loss.detach())  # each micro-batch's of an accumulation

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        logs, loss = self.logs_now(trainer), None
        if self._loss:
            loss, self._loss = torch.stack(self._loss).float().mean(), []
        if not logs and loss is None:
            return
        named = trained(pl_module)
        blocks = blocks_of(named) if self.per_block and logs else {}
        groups = [[p.grad for _, p in named if p.grad is not None], [p for _, p in named]]
        for idx in blocks.values():
            groups += [[named[i][1].grad for i in idx if named[i][1].grad is not None], [named[i][1] for i in idx]]
        sums = squared_sums(groups, loss)
        norms = sums[: len(groups)].sqrt()
        skip = loss is not None and self.guard(trainer, sums[-1].item(), norms[0].item())
        if skip:
            for _, p in named:
                p.grad = None
        if logs:
            values = {"train/grad_norm": norms[0], "train/param_norm": norms[1]}
            for j, name in enumerate(blocks):
                values |= {f"train/grad_norm/{name}": norms[2 + 2 * j], f"train/param_norm/{name}": norms[3 + 2 * j]}
            if self.factor is not None:
                values["train/skipped_steps"] = torch.tensor(float(self.skipped))
            pl_module.log_dict(values, on_step=True, on_epoch=False)
            if self.update_ratio:
                self._before = [_local(p.detach()).clone() for _, p in named]
                self._param_sq = sums[1]

    def guard(self, trainer: L.Trainer, loss: float, grad_norm: float) -> bool:
        """Whether this step is a spike (then skipped); the history of accepted steps otherwise grows."""
        values = {"loss": loss, "grad_norm": grad_norm}
        over = [
            f"{k} {v:.4g} > {self.factor:g} x median {statistics.median(self.history[k]):.4g}"
            for k, v in values.items()
            if len(self.history[k]) >= self.min_history and not v <= self.factor * statistics.median(self.history[k])
        ]
        if not over:
            self.in_a_row = 0
            for k, v in values.items():
                self.history[k].append(v)
            return False
        self.skipped += 1
        self.in_a_row += 1
        where = f"step {trainer.global_step} (epoch {trainer.current_epoch})"
        if self.in_a_row > self.max_in_a_row:
            raise LossSpikeError(
                f"{self.in_a_row} optimizer steps in a row skipped as spikes, the last at {where}: {', '.join(over)}; "
                f"lower the learning rate or raise callbacks.health.spike_factor; {last_good_checkpoint(trainer)}"
            )
        if trainer.is_global_zero:
            log.warning("step %d skipped (%d so far): %s", trainer.global_step, self.skipped, ", ".join(over))
        return True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._before is None:
            return
        before, self._before = self._before, None
        named = trained(pl_module)
        diff = torch._foreach_sub([_local(p.detach()) for _, p in named], before)
        shard = [isinstance(p, DTensor) for _, p in named]
        update = local_squared_sums(
            [[d for d, s in zip(diff, shard, strict=True) if s]],
            [[d for d, s in zip(diff, shard, strict=True) if not s]],
        )[0]
        ratio = update.sqrt() / self._param_sq.sqrt().clamp(min=1e-12)
        pl_module.log("train/update_ratio", ratio, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "skipped": self.skipped,
            "in_a_row": self.in_a_row,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, values in state_dict.get("history", {}).items():
            self.history[k].clear()
            self.history[k].extend(values)
        self.skipped, self.in_a_row = state_dict.get("skipped", 0), state_dict.get("in_a_row", 0)


def adaptive_clip(parameters: list[torch.Tensor], clip_factor: float, eps: float = 1e-3) -> None:
    """timm's adaptive_clip_grad: each unit's gradient (a row of a matrix or kernel, the whole of a vector) scaled
    down to at most clip_factor × max(its weights' norm, eps). FSDP2's DTensors are split by rows (dim 0), so a
    row's norms are on one process; a vector's whole norms are summed over the processes (one all-reduce)."""
    with torch.no_grad():
        adaptive_clip_grad([p for p in parameters if not isinstance(p, DTensor)], clip_factor=clip_factor, eps=eps)
        sharded = [p for p in parameters if isinstance(p, DTensor) and p.grad is not None]
        for p in sharded:
            if any(not placement.is_shard(0) for placement in p.placements):
                raise NotImplementedError(f"AGC of a DTensor placed as {p.placements}: FSDP2's Shard(0) only")
        vectors = [p for p in sharded if p.ndim <= 1]
        sums = local_squared_sums([[_local(t)] for p in vectors for t in (p, p.grad)], [[]] * 2 * len(vectors))
        whole = dict(zip([id(p) for p in vectors], sums.sqrt().view(-1, 2), strict=True))
        for p in sharded:
            w, g = _local(p.detach()), _local(p.grad)
            w_norm, g_norm = whole[id(p)] if id(p) in whole else (unitwise_norm(w), unitwise_norm(g))
            limit = w_norm.clamp(min=eps) * clip_factor
            g.copy_(torch.where(g_norm < limit, g, g * (limit / g_norm.clamp(min=1e-6))))


class AdaptiveGradientClipping(L.Callback):
    """`trainer.gradient_clip_algorithm=agc`: adaptive_clip with clip factor `trainer.gradient_clip_val` on the
    trained parameters, before each optimizer step (after Health has read the unclipped norm)."""

    def __init__(self, clip_factor: float, eps: float = 1e-3) -> None:
        self.clip_factor, self.eps = clip_factor, eps

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        adaptive_clip([p for _, p in trained(pl_module)], self.clip_factor, self.eps)
