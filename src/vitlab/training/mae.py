"""`objective=mae`: masked-image pretraining (vitlab.model.mae) in vitlab.train's loop. The module is the classifier's
(ViTModule: optimizer groups and schedule, checkpoints that resume exactly, the non-finite-loss stop) with the
head off, an MAE decoder beside the encoder, and the masked-patch reconstruction loss in place of the labels' loss:
labels are never read. Logged: `train/loss`, `val/loss`, `val/loss_best` (the checkpoint's choice), `test/loss`.

Its checkpoint's `model.*` is a plain ViT encoder: `model.pretrained=<that .ckpt>` fine-tunes or linear-probes it,
`decoder.*` left out (vitlab.convert.weights.read_state_dict).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics import MeanMetric, MinMetric

from vitlab.utils.errors import UserError
from vitlab.training.module import ViTModule
from vitlab.model import ViTConfig
from vitlab.model.mae import MAEConfig, MAEDecoder, flops_per_image, mae_forward

OBJECTIVES = ("classify", "mae")  # conf/train.yaml `objective`: the labels' loss, or masked-image pretraining


def objective_module(objective: str, unlabeled: bool, mae: dict | None) -> tuple[type[ViTModule], dict[str, Any]]:
    """The LightningModule of `objective` and the arguments it takes beside the classifier's."""
    if objective not in OBJECTIVES:
        raise UserError(f"objective {objective!r} is not one of {list(OBJECTIVES)}")
    if unlabeled and objective != "mae":
        raise UserError("data.unlabeled=true has no labels to learn from: pretrain on it with objective=mae")
    return (MAEModule, {"mae": mae}) if objective == "mae" else (ViTModule, {})


class MAEModule(ViTModule):
    def __init__(self, mae: dict[str, Any] | None = None, **kwargs: Any):
        if isinstance(kwargs.get("model"), ViTConfig):  # the hyper-parameters (this frame's too) are plain data
            kwargs["model"] = kwargs["model"].to_dict()
        super().__init__(**kwargs)
        cfg = self.model.cfg
        if cfg.num_classes:
            raise UserError(f"objective=mae trains an encoder without a head: model.num_classes is {cfg.num_classes}")
        if cfg.patch_drop_rate:
            raise UserError("objective=mae masks the patches itself: set model.patch_drop_rate=0")
        if cfg.dynamic_img_size:
            raise UserError("objective=mae needs a fixed image size: set model.dynamic_img_size=false")
        if self.optim.layer_decay:
            raise UserError(
                "objective=mae pretrains without layer decay (MAE's fine-tuning uses it): set optim.layer_decay=null"
            )
        self.mae_cfg = MAEConfig.from_dict(mae)
        self.decoder = MAEDecoder(cfg, self.mae_cfg)

    def _make_metrics(self) -> None:
        self.train_metrics = nn.ModuleDict({"loss": MeanMetric(nan_strategy="disable")})
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric()})
        self.test_metrics = nn.ModuleDict({"loss": MeanMetric()})
        self.val_loss_best = MinMetric()
        for metric in [self.train_metrics["loss"], self.val_loss_best]:
            metric.persistent(True)  # a resumed run logs what the uninterrupted one would

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.compile_mode and stage == "fit":
            self.compile_blocks()
        self.train_flops_per_image = 3 * flops_per_image(self.model.cfg, self.mae_cfg)  # forward + backward

    def compile_blocks(self) -> None:
        """compile=true: the pretraining step never calls the ViT's forward (which the classifier compiles), so each
        encoder and decoder block is compiled in place instead (the repeated region; state-dict keys unchanged)."""
        for block in [*self.model.blocks, *self.decoder.decoder_blocks]:
            block.compile(mode=self.compile_mode)

    def reconstruct(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, predicted pixels (B, N, ph * pw * C), mask (B, N), 1 = removed) of a batch."""
        return mae_forward(self.model, self.decoder, images, self.mae_cfg)

    # The classifier's training step runs as it is (the finite-loss check, the running mean, the step's log) with
    # this loss in place of the labels'; validation and testing measure the same loss.
    def loss(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """The batch's reconstruction loss (labels unread; no logits)."""
        return self.reconstruct(x)[0], None

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self._update("val", self.loss(x)[0], None, y)

    def on_validation_epoch_end(self) -> None:
        values = self._log_epoch("val")
        if not self.trainer.sanity_checking:
            self.val_loss_best.update(values["val/loss"])
            self.log("val/loss_best", self.val_loss_best.compute(), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self._update("test", self.loss(x)[0], None, y)

    def optimized(self) -> nn.Module:
        """The decoder trains with the encoder: the optimizer's groups are built over both (no weight decay on
        norms, biases, tokens, position embeddings), as MAE's param_groups_weight_decay does."""
        return _Joint(self.model, self.decoder)


class _Joint(nn.Module):
    """The encoder and decoder as one module for the optimizer's groups (names `model.*`, `decoder.*`)."""

    def __init__(self, model: nn.Module, decoder: nn.Module):
        super().__init__()
        self.model, self.decoder = model, decoder

    @property
    def blocks(self) -> nn.ModuleList:  # param_groups counts the encoder's depth
        return self.model.blocks

    def no_weight_decay(self) -> set[str]:
        enc = {f"model.{n}" for n in getattr(self.model, "no_weight_decay", lambda: set())()}
        return enc | {"decoder.mask_token"}
