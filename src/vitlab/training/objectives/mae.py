"""`objective=mae`: masked-image pretraining (vitlab.model.mae) in vitlab.train's loop: an MAE decoder trains beside
the encoder (the ViT, its head off) on the masked-patch reconstruction loss; labels are never read. Logged:
`train/loss`, `val/loss`, `val/loss_best` (the checkpoint's choice), `test/loss`. conf/objective/mae.yaml.

Its checkpoint's `model.*` is a plain ViT encoder: `model.pretrained=<that .ckpt>` fine-tunes or linear-probes it,
`decoder.*` left out (vitlab.convert.weights.read_state_dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from vitlab.model import ViT, ViTConfig
from vitlab.model.cost import activation_values
from vitlab.model.mae import MAEConfig, MAEDecoder, flops_per_image, mae_forward
from vitlab.training.objectives.objective import Objective
from vitlab.utils.errors import UserError
from vitlab.utils.values import from_mapping


class MAE(Objective):
    """`objective=mae`: He et al.'s masked autoencoder; the encoder sees the kept patches, a light decoder predicts
    every patch's pixels, and the loss is the mean squared error on the masked ones."""

    name = "mae"
    uses_labels = False
    views = "masked"
    best = ("loss", "min")

    def __init__(self, options: Mapping[str, Any], model: ViTConfig):
        self.cfg = from_mapping(MAEConfig, options, "objective=mae")
        self.decoder = MAEDecoder(model, self.cfg)
        self.joint: _Joint | None = None  # the encoder and decoder as one network (built with the encoder's first use)

    def check(self, model: ViTConfig, optim: Any) -> None:
        if model.num_classes:
            raise UserError(
                f"objective=mae trains an encoder without a head: model.num_classes is {model.num_classes}; set "
                "model.num_classes=0"
            )
        if model.patch_drop_rate:
            raise UserError("objective=mae masks the patches itself: set model.patch_drop_rate=0")
        if optim.layer_decay:
            raise UserError(
                "objective=mae pretrains without layer decay (MAE's fine-tuning uses it): set optim.layer_decay=null"
            )

    def extra_modules(self) -> dict[str, nn.Module]:
        return {"decoder": self.decoder}

    def activation_shapes(self, model: ViTConfig) -> list[tuple[int, int, int, float]]:
        """The encoder on the prefix tokens and the kept patches, the decoder on every patch; and around them, every
        patch embedded before masking, and the decoder's input and prediction."""
        tokens, c, full = model.num_prefix_tokens + model.num_patches, self.cfg, activation_values(model)
        encoder = (model.num_prefix_tokens + c.kept(model.num_patches), model.embed_dim, model.depth, full)
        pixels = model.in_chans * model.patch_hw[0] * model.patch_hw[1]
        around = [(tokens, model.embed_dim, 1, 2), (tokens, c.decoder_embed_dim, 1, 2), (tokens, pixels, 1, 3)]
        image = (model.img_hw[0] * model.img_hw[1], model.in_chans, 1, 1)
        decoder = (tokens, c.decoder_embed_dim, c.decoder_depth, 16.0)  # plain pre-norm blocks, MLP ratio 4
        return [encoder, decoder, *around, image]

    def network(self, model: ViT) -> nn.Module:
        """Encoder and decoder together, MAE's forward theirs: what a sharded strategy shards (the ViT's forward
        never runs in pretraining)."""
        return self._joint(model)

    def metrics(self, stage: str, num_classes: int) -> dict[str, Metric]:
        return {}  # the loss alone

    def compile(self, model: ViT, mode: str, regional: bool = False) -> None:
        """The pretraining step never calls the ViT's forward (which compile=true compiles whole for evaluation),
        so each encoder and decoder block is compiled in place as well (the repeated region; state-dict keys
        unchanged); compile=regional: the blocks alone."""
        if not regional:
            super().compile(model, mode, regional=False)
        super().compile(model, mode, regional=True)

    def blocks_run(self, model: ViT) -> list[nn.Module]:
        return [*model.blocks, *self.decoder.decoder_blocks]

    def reconstruct(self, model: ViT, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, predicted pixels (B, N, ph * pw * C), mask (B, N), 1 = removed) of a batch."""
        return self._joint(model)(images)

    def _joint(self, model: ViT) -> _Joint:
        if self.joint is None or self.joint.model is not model:
            self.joint = _Joint(model, self.decoder, self.cfg)
        return self.joint

    def training_loss(
        self, model: ViT, x: torch.Tensor, y: torch.Tensor | None, epoch: int
    ) -> tuple[torch.Tensor, None]:
        return self.reconstruct(model, x)[0], None  # labels unread; no logits

    def evaluation_loss(self, model: ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.reconstruct(model, x)[0], None  # validation and testing measure the same loss

    def train_flops_per_image(self, model: ViTConfig) -> float:
        return 3 * flops_per_image(model, self.cfg)  # forward + backward

    def optimized(self, model: ViT) -> nn.Module:
        """The decoder trains with the encoder: the optimizer's groups are built over both (no weight decay on
        norms and biases; none on the tokens either unless optim.decay_tokens=true, MAE's main_pretrain.py rule)."""
        return self._joint(model)


class _Joint(nn.Module):
    """The encoder and decoder as one module (names `model.*`, `decoder.*`, as the LightningModule's): its forward is
    MAE's; the optimizer's groups are built over it."""

    def __init__(self, model: ViT, decoder: MAEDecoder, cfg: MAEConfig):
        super().__init__()
        self.model, self.decoder, self.cfg = model, decoder, cfg

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mae_forward(self.model, self.decoder, images, self.cfg)

    @property
    def blocks(self) -> nn.ModuleList:  # param_groups counts the encoder's depth
        return self.model.blocks

    def no_weight_decay(self) -> set[str]:
        enc = {f"model.{n}" for n in getattr(self.model, "no_weight_decay", lambda: set())()}
        return enc | {"decoder.mask_token"}
