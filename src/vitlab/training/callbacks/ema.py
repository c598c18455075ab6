"""The weights' moving average (EMA) as timm validates it: Lightning's EMA callback, the raw and the averaged weights
validated side by side, the checkpoint holding the set its monitor chooses, and timm's warm-up of the decay."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim.swa_utils import AveragedModel

from vitlab.training.callbacks.standard import BestCheckpoint
from vitlab.training.devices.full_state import load_full_module_state
from vitlab.training.devices.sharding import is_sharded
from vitlab.utils.values import check_range


class EMA(EMAWeightAveraging):
    """Lightning's EMA of the weights, validated as timm's train.py validates it: the raw weights give `val/acc`
    and `val/loss`, the average `val/acc_ema` and `val/loss_ema`, every validation. The best checkpoint is chosen
    by the metric `model_checkpoint.monitor` names, and every checkpoint holds those weights as its weights (tested
    after training, evaluated, exported): the average's when it is an `_ema` metric, else the raw ones; the other
    set travels along for resuming. `warmup`: timm's EMA warm-up, decay min(decay, 1 - (1 + step / gamma) ** -power)
    from optimizer step `step`, so the average follows the fast-moving early weights instead of keeping the initial
    ones for thousands of steps."""

    def __init__(
        self,
        decay: float = 0.999,
        warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        **kwargs: Any,
    ):
        check_range("callbacks.ema.decay", decay, 0, 1)
        for key, value in (("warmup_gamma", warmup_gamma), ("warmup_power", warmup_power)):
            check_range(f"callbacks.ema.{key}", value, 0, math.inf, low_open=True, high_open=True)
        self.decay, self.warmup, self.warmup_gamma, self.warmup_power = decay, warmup, warmup_gamma, warmup_power
        # EMAWeightAveraging's schedule of updates, with an average of our own (the warm-up's decay)
        WeightAveraging.__init__(self, use_buffers=True, multi_avg_fn=self._lerp, **kwargs)
        self.update_every_n_steps, self.update_starting_at_step = update_every_n_steps, update_starting_at_step
        self.update_starting_at_epoch = None
        self._step, self.keep_average = 0, True

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step `step` (1, 2, ...), as timm's ModelEmaV3.get_decay: the first
        update copies the weights, warm-up counts from the second."""
        if not self.warmup:
            return self.decay
        since = step - 1
        if since <= 0:
            return 0.0
        return min(self.decay, max(0.0, 1 - (1 + since / self.warmup_gamma) ** -self.warmup_power))

    def _lerp(self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged) -> None:
        weight = 1.0 - self.decay_at(self._step)  # a Python number: no device read per step
        floats = [(a, c) for a, c in zip(averaged, current, strict=True) if a.is_floating_point()]
        if floats:
            torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], weight)
        for a, c in zip(averaged, current, strict=True):
            if not a.is_floating_point():
                a.copy_(c)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning's setup would call configure_model (which shards under trainer=fsdp) and deep-copy the module; a
        # sharded module cannot be copied, so its average is built once it is sharded (on_fit_start).
        if stage == "fit" and not is_sharded(trainer):
            device = torch.device(self._device or pl_module.device)
            share = device == pl_module.device
            self._average_model = CountedAverage(
                pl_module, device=device, use_buffers=self._use_buffers, share=share, **self._kwargs
            )
        best = [c for c in trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint)]
        self.keep_average = not best or str(best[0].monitor).endswith("_ema")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if is_sharded(trainer):  # before a checkpoint is restored: it loads into the average too
            self._average_model = ShardedAverage(pl_module, trainer.strategy, self._lerp)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._step = trainer.global_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.keep_average:  # the module ends with the weights the checkpoints hold
            super().on_train_end(trainer, pl_module)

    # Validation: both weights, side by side (Lightning's callback would swap the average in instead).
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is not None:
            self._average_model.module.eval()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._average_model is None:
            return
        with trainer.precision_plugin.forward_context(), pl_module.evaluation_draws("val", batch_idx):
            self._average_model.module.evaluate("val", batch)  # (in bf16-mixed's autocast; its draws the batch's)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is None:
            return
        average = self._average_model.module
        values = {}
        for name, metric in average.val_metrics.items():
            values[f"val/{name}_ema"] = metric.compute()
            metric.reset()
        pl_module.log_dict(values, prog_bar=False, sync_dist=True)
        if self.keep_average:  # the checkpoints hold the average: its numbers are the run's best (val/acc_best)
            pl_module.kept_values = {k.removesuffix("_ema"): v for k, v in values.items()}
        average.train()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.keep_average or self._average_model is None:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)
            return
        state = self._average_model.state_dict()
        checkpoint["average_model_state"] = {k[7:]: v for k, v in state.items() if k.startswith("module.")}
        checkpoint["averaging_state"] = {k: v for k, v in state.items() if not k.startswith("module.")}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            # Tested, validated or predicted: the file's weights are the ones it names (the average where the monitor
            # chose it), as `vitlab.eval` of the file reads them. Lightning's callback would put the raw weights back
            # (its current_model_state), so a run's test/acc was the raw weights' while its best checkpoint held the
            # average's.
            return
        if self._average_model is not None and "average_model_state" in checkpoint:  # saved with the raw weights kept
            state = {"module." + k: v for k, v in checkpoint["average_model_state"].items()}
            self._average_model.load_state_dict(state | checkpoint["averaging_state"])
            return
        if isinstance(self._average_model, ShardedAverage) and "current_model_state" in checkpoint:
            # The file's weights (the average) went into the module when the strategy loaded it: the average takes
            # them, the module its own (every process reads the whole file and keeps its shard).
            state = {"module." + k: v for k, v in checkpoint["state_dict"].items()}
            self._average_model.load_state_dict(state | checkpoint["averaging_state"])
            load_full_module_state(pl_module, checkpoint["current_model_state"])
            return
        super().on_load_checkpoint(trainer, pl_module, checkpoint)


class CountedAverage(AveragedModel):
    """torch's AveragedModel with its count of updates known on the host: torch's `update_parameters` reads the count
    on the device (`n_averaged == 0`, `n_averaged > 0`), which makes the host wait for the GPU after every step. The
    same update (the first copies the weights, the others call `multi_avg_fn`: EMA's lerp); the device count is
    read once, when a run (resumed) first updates."""

    _updates: int | None = None

    def __init__(self, model: nn.Module, share: bool = False, **kwargs: Any):
        """`share`: the copy to average into keeps `model`'s frozen tensors (a PEFT run's base, a distillation's
        teacher: constant, so their average is themselves) and its hyper-parameters (the config, read only) as they
        are instead of copying them (on the same device only): a LoRA run of a ViT-L held its base twice."""
        memo: dict[int, Any] = {}
        if share:
            shared = [t for t in model.parameters() if not t.requires_grad]
            shared += [getattr(model, k) for k in ("_hparams", "_hparams_initial") if hasattr(model, k)]
            memo = {id(o): o for o in shared}
        super().__init__(_Copied(copy.deepcopy(model, memo)), **kwargs)  # (AveragedModel deep-copies what it gets)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self._updates is None:
            self._updates = int(self.n_averaged)
        everything = zip((*self.module.parameters(), *self.module.buffers()), (*model.parameters(), *model.buffers()),
                         strict=True)  # fmt: skip
        pairs = [(a, t) for a, t in everything if a is not t]  # (a tensor shared with the model: itself already)
        ours = [a.detach() for a, _ in pairs]
        theirs = [t.detach().to(a.device) for a, t in pairs]
        if self._updates == 0:
            for a, t in zip(ours, theirs, strict=True):
                a.copy_(t)
        else:
            self.multi_avg_fn(ours, theirs, self.n_averaged)
        self.n_averaged += 1
        self._updates += 1

    def load_state_dict(self, *args, **kwargs):
        self._updates = None  # the loaded count, read at the next update
        return super().load_state_dict(*args, **kwargs)


class _Copied:
    """A module already copied (CountedAverage's, sharing what does not train): AveragedModel's deep copy of it is
    itself."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __deepcopy__(self, memo: dict) -> nn.Module:
        return self.module


class ShardedAverage(nn.Module):
    """The average of a sharded module (trainer=fsdp), sharded as the module is: a second module built from the same
    hyper-parameters and sharded over the same processes, each process averaging its own shards (no communication
    per step). Its state dict, as AveragedModel's (`module.*`, `n_averaged`), is gathered whole on rank 0 for a
    checkpoint and taken apart again on loading."""

    def __init__(self, pl_module: L.LightningModule, strategy: Any, lerp: Callable):
        super().__init__()
        module = type(pl_module)(**pl_module.hparams).to(pl_module.device)
        module.objective.share_fitted(pl_module.objective)  # (a feature distillation's teachers)
        strategy.shard_module(module)  # (the teachers it shares are sharded already)
        with torch.no_grad():
            for mine, theirs in zip(_tensors(module), _tensors(pl_module), strict=True):
                mine.copy_(theirs)
        self.module = module.requires_grad_(False)
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=pl_module.device))
        self._lerp, self._updates = lerp, 0

    @torch.no_grad()
    def update_parameters(self, model: L.LightningModule) -> None:
        """As AveragedModel.update_parameters: the first update copies the weights, the others average."""
        if self._updates == 0:
            torch._foreach_copy_(_tensors(self.module), _tensors(model))
        else:
            self._lerp(_tensors(self.module), _tensors(model), self.n_averaged)
        self.n_averaged += 1
        self._updates += 1  # n_averaged on the host: no device read per step

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {f"module.{k}": v for k, v in full.items()} | {"n_averaged": self.n_averaged.cpu()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, assign: bool = False):
        load_full_module_state(self.module, {k[7:]: v for k, v in state.items() if k.startswith("module.")})
        self._updates = int(state["n_averaged"])
        self.n_averaged.fill_(self._updates)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """This process's part of each parameter and buffer (a DTensor's local shard), in the module's order."""
    return [getattr(t, "_local_tensor", t) for t in (*module.parameters(), *module.buffers())]
