"""ViTModule: the LightningModule around our ViT: loss (with MixUp/CutMix and label smoothing),
metrics, and the optimisation recipe of vitlab.training.optim wired into Lightning.

Its constructor takes plain data only (dicts, lists, numbers), saved as the checkpoint's
hyper-parameters, so `ViTModule.load_from_checkpoint(path)` rebuilds the model without Hydra and
without executing anything from the file (weights_only loading works).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy
from timm.scheduler.scheduler import Scheduler as TimmScheduler
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from vitlab.training import rank_state
from vitlab.training.distillation import DistillConfig, distillation_loss, load_teacher
from vitlab.utils.errors import NonFiniteLossError, UserError
from vitlab.model import ViT, ViTConfig
from vitlab.model.init import log_prior_head_bias_
from vitlab.training.optim import PLATEAU_MODES, OptimConfig, SchedulerConfig, make_optimizer, make_scheduler
from vitlab.utils.checks import check_at_least, check_range, compile_mode, from_mapping

log = logging.getLogger(__name__)

# The training losses: softmax cross-entropy, or sigmoid binary cross-entropy (validation and test report
# cross-entropy either way).
LOSSES = ("ce", "bce")


MIXUP_MODES = ("batch", "pair", "elem")  # timm's: one draw a batch, a pair of images, an image


@dataclass(frozen=True)
class MixupConfig:
    """timm's Mixup (MixUp/CutMix, as DeiT's main.py builds it) on each training batch; both alphas 0 = off
    (conf/train.yaml `mixup`)."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: tuple[float, float] | None = None  # CutMix box as a fraction of the image, instead of alpha's
    prob: float = 1.0  # chance a batch (pair, image) is mixed
    switch_prob: float = 0.5  # chance of CutMix rather than MixUp when both are on
    mode: str = "batch"  # MIXUP_MODES
    off_epoch: int = 0  # from this epoch on, no mixing (timm's mixup_off_epoch; DeiT III); 0: mix throughout

    def __post_init__(self):
        for key in ("mixup_alpha", "cutmix_alpha"):
            check_at_least(f"mixup.{key}", getattr(self, key))
        for key in ("prob", "switch_prob"):
            check_range(f"mixup.{key}", getattr(self, key), 0, 1)
        if self.mode not in MIXUP_MODES:
            raise UserError(f"mixup.mode {self.mode!r} is not one of {list(MIXUP_MODES)}")
        if self.cutmix_minmax is not None:
            mm = self.cutmix_minmax
            if len(mm) != 2 or not 0 < mm[0] <= mm[1] <= 1:
                raise UserError(f"mixup.cutmix_minmax {list(mm)} must be [min, max] with 0 < min <= max <= 1, or null")
            object.__setattr__(self, "cutmix_minmax", tuple(mm))
        if not isinstance(self.off_epoch, int) or isinstance(self.off_epoch, bool) or self.off_epoch < 0:
            raise UserError(f"mixup.off_epoch {self.off_epoch!r} must be an epoch number >= 0 (0: never off)")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> MixupConfig:
        return from_mapping(cls, values, "mixup")

    def build(self, num_classes: int) -> Mixup | None:
        """timm's Mixup, its targets unsmoothed (the loss smooths them, as it smooths class indices)."""
        if not self.mixup_alpha and not self.cutmix_alpha and self.cutmix_minmax is None:
            return None
        return Mixup(
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            cutmix_minmax=self.cutmix_minmax,
            prob=self.prob,
            switch_prob=self.switch_prob,
            mode=self.mode,
            label_smoothing=0.0,
            num_classes=num_classes,
        )


class ViTModule(L.LightningModule):
    def __init__(
        self,
        model: ViTConfig | dict[str, Any],  # a dict: the plain data a checkpoint carries
        optim: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
        label_smoothing: float = 0.0,
        loss: str = "ce",  # LOSSES
        bce_target_thresh: float | None = None,  # bce: targets above it become 1, the rest 0 (DeiT III: 0.2)
        mixup: dict[str, Any] | None = None,
        distill: dict[str, Any] | None = None,  # DeiT's distillation from a teacher (vitlab.training.distillation)
        compile: bool | str = False,  # or a torch.compile mode (COMPILE_MODES)
        class_names: list[str] | None = None,
        data: dict[str, Any] | None = None,  # the data config that trained it, for vitlab.eval/predict
        freeze_backbone: bool = False,  # linear probe: train the head (and fc_norm) only
    ):
        super().__init__()
        cfg = model if isinstance(model, ViTConfig) else ViTConfig.from_dict(model)
        model = cfg.to_dict()  # what save_hyperparameters keeps: a checkpoint carries the config as plain data
        self.save_hyperparameters()
        self.model = ViT(cfg)
        if freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(("head.", "fc_norm.")))
        self.optim = OptimConfig.from_dict(optim)  # omitted keys: the same defaults as conf/optim/adamw.yaml
        self.scheduler_cfg = SchedulerConfig.from_dict(scheduler)  # conf/scheduler/warmup_cosine.yaml's
        check_range("label_smoothing", label_smoothing, 0, 1, high_open=True)
        self.label_smoothing = label_smoothing
        if loss not in LOSSES:
            raise UserError(f"loss {loss!r} is not one of {list(LOSSES)}")
        self.loss_kind, self.bce = loss, None
        if loss == "bce":
            self.bce = BinaryCrossEntropy(smoothing=label_smoothing, target_threshold=bce_target_thresh)
            if isinstance(self.model.head, nn.Linear):  # sigmoid targets are mostly 0: start every class improbable
                log_prior_head_bias_(self.model.head, self.model.cfg.num_classes)
        self.mixup_cfg = MixupConfig.from_dict(mixup)
        self.mixup = self.mixup_cfg.build(self.model.cfg.num_classes)
        self.distill = DistillConfig.from_dict(distill)
        if self.distill.on and self.model.cfg.distilled:
            self.model.set_distilled_training(True)  # training returns (class, distillation) logits apart
        # The teacher: loaded when fitting begins, never saved with the student nor wrapped by DDP (not a submodule).
        object.__setattr__(self, "teacher", None)
        self.compile_mode = compile_mode(compile)
        self._make_metrics()

    def _make_metrics(self) -> None:
        k = self.model.cfg.num_classes
        if k < 2:
            raise UserError(f"model.num_classes {k} must be >= 2 to train a classifier")
        # Updated every step, computed (and synced across processes) once per epoch: logging a value
        # costs ~1 ms in Lightning, as much as the forward pass of the digits model.
        acc = functools.partial(MulticlassAccuracy, k, average="micro", validate_args=False)
        # A non-finite training loss stops the run before it is averaged, so its mean skips the NaN check
        # (a device sync per step on a GPU).
        self.train_metrics = nn.ModuleDict({"loss": MeanMetric(nan_strategy="disable"), "acc": acc(top_k=1)})
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": acc(top_k=1), "acc_top5": acc(top_k=min(5, k))})
        self.test_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": acc(top_k=1), "acc_top5": acc(top_k=min(5, k))})
        self.val_acc_best = MaxMetric()
        # Running training metrics and the best accuracy so far are checkpointed, so a run resumed
        # mid-epoch logs the same values as one that was never interrupted.
        for metric in [*self.train_metrics.values(), self.val_acc_best]:
            metric.persistent(True)

    # ---- steps -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            rank_state.seed_process(self.trainer)
            if self.distill.on:
                object.__setattr__(self, "teacher", load_teacher(self.distill, self.model.cfg.num_classes))
        if self.compile_mode and stage == "fit":
            self.model.compile(mode=self.compile_mode)  # in place: state-dict keys stay the same
        # forward + backward ~ 3x forward: callbacks.Throughput reports FLOP/s with it
        self.train_flops_per_image = 3 * self.model.cfg.flops_per_image()

    def on_fit_start(self) -> None:
        if self.teacher is not None:  # on this process's device, with the student's normalisation to undo
            dm = self.trainer.datamodule
            if len(dm.mean) != (channels := self.teacher.kd.mean_kd.shape[1]):
                raise UserError(f"distill.teacher takes {channels}-channel images, and the data has {len(dm.mean)}")
            self.teacher.to(self.device)
            self._student_norm = tuple(
                torch.tensor(v, dtype=torch.float32, device=self.device).view(1, -1, 1, 1) for v in (dm.mean, dm.std)
            )
        names = getattr(self.trainer.datamodule, "class_names", None)
        if names:  # known once the dataset is read (CIFAR, ImageFolder); saved with the checkpoint
            self.hparams["class_names"] = list(names)

    def _update(self, stage: str, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        m = getattr(self, f"{stage}_metrics")
        # The weight is made on the device: a Python number would be copied there, and that copy waits.
        m["loss"].update(loss.detach(), weight=torch.full((), len(y), dtype=loss.dtype, device=loss.device))
        for name, metric in m.items():
            if name != "loss":
                metric.update(logits.detach(), y)

    def _log_epoch(self, stage: str) -> dict[str, torch.Tensor]:
        values = {}
        for name, metric in getattr(self, f"{stage}_metrics").items():
            values[f"{stage}/{name}"] = metric.compute()
            metric.reset()
        # torchmetrics has already reduced these over processes; sync_dist=True averages equal values (and
        # keeps Lightning from warning, under DDP, that epoch-level values were not synced).
        self.log_dict(values, prog_bar=stage == "val", sync_dist=True)
        return values

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss of a batch and its logits: MixUp/CutMix (when on), then, with label smoothing,
        softmax cross-entropy (`ce`: class indices or the mixed targets, the same as timm's SoftTargetCrossEntropy)
        or sigmoid binary cross-entropy (`bce`: timm's BinaryCrossEntropy, as DeiT III and big_vision train). A
        plain training loop calls this too, so both optimise the same objective."""
        target = y
        if self.mixup is not None and not self._mixing_off():
            if len(x) % 2:
                raise UserError(
                    f"mixup pairs the images of a batch, and this process's batch has {len(x)}: make "
                    "data.batch_size / the processes even"
                )
            x, target = self.mixup(x, y)  # prob: timm's draw (numpy's generator, checkpointed with the others)
        out = self.model(x)
        logits, logits_kd = out if isinstance(out, tuple) else (out, out)  # distilled: the class token's, the other's
        if self.loss_kind == "ce":
            loss = F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)
        else:
            if target.ndim == 2:  # mixed targets, smoothed as timm's Mixup smooths them (its BCE smooths indices only)
                target = target * (1 - self.label_smoothing) + self.label_smoothing / logits.shape[-1]
            loss = self.bce(logits, target)
        if self.distill.on:  # the teacher sees the images the student saw, mixed as they were
            if self.teacher is None:
                raise RuntimeError("distillation needs the teacher: fit the module with a Trainer (setup loads it)")
            loss = distillation_loss(loss, logits_kd, self.teacher(x, *self._student_norm), self.distill)
        if isinstance(out, tuple):
            logits = (out[0] + out[1]) / 2  # the metrics read the two heads' average, as evaluation does
        return loss, logits

    def _mixing_off(self) -> bool:
        """mixup.off_epoch reached (Lightning's epoch; 0 without a trainer, so a plain loop mixes throughout)."""
        return bool(self.mixup_cfg.off_epoch) and self.current_epoch >= self.mixup_cfg.off_epoch

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss, logits = self.loss(x, y)
        log_step = (self.global_step + 1) % self.trainer.log_every_n_steps == 0  # the steps Lightning writes logs at
        self._check_finite(loss, now=log_step)
        self._update("train", loss, logits, y)  # accuracy against the unmixed labels
        if log_step:
            # Read here, on a step that logs (and waits) anyway: a device tensor in the progress bar would be
            # read again, and waited for, after every later step.
            self.log("train/loss_step", loss.detach().float().cpu(), prog_bar=True)
        return loss

    # A non-finite loss stops the run, and no checkpoint ever holds the weights it produced. On the CPU the
    # loss is read every step and the run stops before the update. On a GPU reading it would make the host
    # wait for every step: the first bad step is recorded on the device and read at logging steps, at the
    # end of each epoch and before every checkpoint is written.
    def _check_finite(self, loss: torch.Tensor, now: bool = False) -> None:
        if loss.device.type == "cpu":
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    self._non_finite_message(loss.item(), self.global_step, "stopped before the update")
                )
            return
        if getattr(self, "_bad", None) is None or self._bad.device != loss.device:
            self._bad = torch.full((2,), -1.0, device=loss.device)  # (first bad step, its loss)
        first = ~torch.isfinite(loss.detach()) & (self._bad[0] < 0)
        step = torch.full((), float(self.global_step), device=loss.device)  # a fill on the device, not a copy
        self._bad.copy_(torch.where(first, torch.stack([step, loss.detach().float()]), self._bad))
        if now:
            self._raise_if_not_finite()

    def _raise_if_not_finite(self) -> None:
        bad = getattr(self, "_bad", None)
        if bad is not None and bad[0].item() >= 0:
            step, value = int(bad[0].item()), bad[1].item()
            raise NonFiniteLossError(
                self._non_finite_message(
                    value, step, f"the weights from then on (step {self.global_step}) were not saved"
                )
            )

    def _non_finite_message(self, value: float, step: int, stopped: str) -> str:
        saved = [Path(p) for cb in self.trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path)]
        saved = [p for p in saved if str(p) not in ("", ".") and p.is_file()]
        # the newest; of one file under two names (last.ckpt linked to the best), the one saved later
        last = max(reversed(saved), key=lambda p: p.stat().st_mtime_ns) if saved else None
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved yet"
        return f"training loss became {value} at step {step} (epoch {self.current_epoch}); {stopped}; {where}"

    # Each process's random generators (dropout, stochastic depth, MixUp), loader position, augmentation generator
    # and running metrics travel with checkpoints (vitlab.training.rank_state), so a resumed run, with one process or
    # many, draws and sees exactly what the uninterrupted run would have.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._raise_if_not_finite()  # before anything is written
        rank_state.save(self.trainer, self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        self._rank_state = rank_state.take(self.trainer, checkpoint) if fitting else None
        # Metric states are bookkeeping, not weights: a checkpoint without them (older, or written
        # elsewhere) starts them fresh; the model's own keys stay strictly checked.
        state = checkpoint.get("state_dict", {})
        for key, value in self.state_dict().items():
            if not key.startswith("model.") and key not in state:
                state[key] = value

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if getattr(self, "_rank_state", None):
            rank_state.restore(self, self._rank_state)
            self._rank_state = None

    def on_train_epoch_end(self) -> None:
        self._raise_if_not_finite()
        self._log_epoch("train")
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, TimmScheduler):  # timm's epoch step, after validation (a plateau watches it)
            watched = self.trainer.callback_metrics.get(PLATEAU_MODES[self.scheduler_cfg.plateau_mode])
            scheduler.step(self.current_epoch + 1, None if watched is None else watched.item())

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """timm's schedulers take the number of updates so far (Lightning's steps: exact on resume); PyTorch's
        step as Lightning steps them."""
        if isinstance(scheduler, TimmScheduler):
            scheduler.step_update(num_updates=self.trainer.global_step)
        else:
            super().lr_scheduler_step(scheduler, metric)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self._update("val", F.cross_entropy(logits, y), logits, y)

    def on_validation_epoch_end(self) -> None:
        values = self._log_epoch("val")
        if not self.trainer.sanity_checking:  # the sanity check's numbers are no result
            self.val_acc_best.update(values["val/acc"])
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self._update("test", F.cross_entropy(logits, y), logits, y)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    # ---- optimisation ----------------------------------------------------------------------------
    def optimized(self) -> nn.Module:
        """What the optimizer's groups are built over (the network; MAE adds its decoder)."""
        return self.model

    def configure_optimizers(self):
        optimizer = make_optimizer(self.optimized(), self.optim)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        # Counting the steps builds the train loader before a checkpoint's loader position is restored,
        # and fit then never applies that position (Lightning-AI/pytorch-lightning#20550, open): drop the
        # early loader so fit builds it again after the restore. tests/test_reliability.py guards this.
        self.trainer.fit_loop._combined_loader = None
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        if 0 < total // epochs < self.trainer.log_every_n_steps:
            # Epochs shorter than the logging interval would log no step at all (no loss or LR curve for a
            # short run): log once per epoch's worth of steps instead.
            self.trainer.log_every_n_steps = total // epochs
        scheduler = make_scheduler(optimizer, self.scheduler_cfg, total, epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
