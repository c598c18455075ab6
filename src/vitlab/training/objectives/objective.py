"""What the LightningModule asks of an objective (timm's `timm/task/`: the objective is an object the training loop
calls): the loss of a training batch, the loss and metrics of an evaluation batch, the metric whose best value
chooses the checkpoint, the networks it trains beside the ViT (MAE's decoder), what it needs once fitting begins (the
distillation teacher) and what it does around each optimizer step (DINO's teacher). Each objective's options are its
config dataclass (conf/objective/<name>.yaml): `objective.name` picks the class, and only that objective's keys are
accepted. No Lightning or Hydra here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from vitlab.model import ViT, ViTConfig
from vitlab.model.cost import activation_values
from vitlab.model.recompute import recompute_region


def reads_no_labels(data: Mapping[str, Any] | None) -> bool:
    """The data config trains on images alone: data.labels=false, or a folder without classes (data.unlabeled=true)."""
    data = data or {}
    return bool(data.get("unlabeled")) or data.get("labels") is False


class Objective:
    """The classifier's defaults; classification, distillation and MAE override what differs."""

    name = ""
    uses_labels = True  # false: pretraining reads images only (data.unlabeled=true allowed)
    best = ("acc", "max")  # val/<metric>_best (max or min so far) chooses the checkpoint
    # What training shows the model (vitlab.visualize what=views, evaluation/views.py VIEW_KINDS): the training
    # transform's random resized crop ("crop"), that crop less the patches the encoder does not see ("masked"), or
    # DINO's multi-crop views ("multicrop").
    views = "crop"
    # The training schedules of varied batches it trains on (data/sizes.py's SizeSchedule.kind): "sizes", several
    # square sizes (data.train_img_sizes); "naflex", NaFlex's sequence lengths. None by default: a teacher, MAE's
    # masks and DINO's crops have sizes of their own.
    schedules: frozenset[str] = frozenset()
    # Whether its steps call the network's forward_features and forward_head themselves, not only its forward (a
    # sharded strategy then gathers the network's parameters in those too: training.devices.sharding).
    calls_features = False

    @classmethod
    def unlabeled_refusal(cls, options: Mapping[str, Any]) -> str | None:
        """Why this objective, with `options`, cannot train on images without labels (None: it can)."""
        if not cls.uses_labels:
            return None
        return "data.unlabeled=true has no labels to learn from: pretrain on it with objective=mae or dino"

    @classmethod
    def best_of(cls, options: Mapping[str, Any], unlabeled: bool = False) -> tuple[str, str]:
        """`best` of this objective with `options`, on data with or without labels (the plan reads it before the
        objective is built)."""
        return cls.best

    def read_no_labels(self) -> None:
        """The data has no labels (data.labels=false): an objective that can learn without them (unlabeled_refusal
        None) stops reading them."""
        self.uses_labels = False

    @classmethod
    def data_views(cls, options: dict[str, Any], model: ViTConfig) -> dict[str, Any]:
        """What the data module must make of each training batch for this objective (`options`: the objective's
        settings), as arguments of the data module beside its own settings; none for most objectives."""
        return {}

    def check(self, model: ViTConfig, optim: Any) -> None:
        """Refuse, in one line, model or optimizer settings this objective cannot train with."""

    def prepare(self, model: ViT) -> None:
        """Set the network up for this objective, once, when the module is built."""

    def extra_modules(self) -> dict[str, nn.Module]:
        """Networks trained beside the ViT, registered on the module under these names (checkpoint keys
        `<name>.*`) and optimised with it."""
        return {}

    def term_names(self) -> tuple[str, ...]:
        """The terms of the training loss logged beside it (train/loss_<name>, each epoch's mean), as the last
        training step left them in `self.terms` ({name: a detached scalar}; a term absent from it that step, e.g. not
        yet begun, is not counted)."""
        return ()

    def metrics(self, stage: str, num_classes: int) -> dict[str, Metric]:
        """The metrics of `stage` (train, val, test) besides the loss, updated with (logits, labels)."""
        acc = functools.partial(MulticlassAccuracy, num_classes, average="micro", validate_args=False)
        if stage == "train":
            return {"acc": acc(top_k=1)}
        return {"acc": acc(top_k=1), "acc_top5": acc(top_k=min(5, num_classes))}

    def setup_fit(self, num_classes: int) -> None:
        """Fitting is being set up (each process, before the optimizer): load what the loss needs."""

    def fit_start(self, datamodule: Any, device: torch.device) -> None:
        """Fitting begins on `device` with `datamodule`'s data."""

    def compile(self, model: ViT, mode: str, regional: bool = False) -> None:
        """compile=true: what the training step runs, compiled in place (state-dict keys unchanged), as one graph;
        `regional` (compile=regional): each transformer block the step runs instead, all of one class sharing one
        compiled code (torch's regional compilation recipe: compile time stays that of one block at any depth)."""
        for region in self.blocks_run(model) if regional else [model]:
            region.compile(mode=mode)
            if regional:  # the block under gradient checkpointing: the checkpoint compiled with it
                recompute_region(region).compile(mode=mode)

    def blocks_run(self, model: ViT) -> list[nn.Module]:
        """The transformer blocks a training step runs."""
        return list(model.blocks)

    def training_loss(
        self, model: ViT, x: torch.Tensor, y: torch.Tensor | None, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, logits the metrics read, or None) of a training batch."""
        raise NotImplementedError

    def evaluation_loss(self, model: ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, logits) of a validation or test batch: cross-entropy of the network's logits."""
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits, y), logits

    def train_flops_per_image(self, model: ViTConfig) -> float:
        """Forward + backward ~ 3x forward (callbacks.Throughput reports FLOP/s with it)."""
        return 3 * model.flops_per_image()

    def activation_shapes(self, model: ViTConfig) -> list[tuple[int, int, int, float]]:
        """(tokens, width, blocks, values kept per token and width) of the blocks a training step runs, for
        training.devices.memory's estimate: model/cost.py's activation_values for a block (8 + 2 x mlp_ratio, more
        with LayerScale, SwiGLU, RoPE); a class-token head's last block computes the class rows only and keeps its
        input, normed input and keys/values of every token (5); and the image, which the patch embedding keeps (its
        pixels as tokens of width in_chans)."""
        tokens, full = model.num_prefix_tokens + model.num_patches, activation_values(model)
        image = (model.img_hw[0] * model.img_hw[1], model.in_chans, 1, 1)
        if model.global_pool != "token":
            return [(tokens, model.embed_dim, model.depth, full), image]
        return [(tokens, model.embed_dim, model.depth - 1, full), (tokens, model.embed_dim, 1, 5), image]

    def schedule(self, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int) -> None:
        """The optimizer is built, for a run of `total_steps` optimizer steps (the objective's own schedules)."""

    def step_start(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Before the batch of optimizer step `step` (0, 1, ...)."""

    def clip_gradients(self, epoch: int) -> bool:
        """After the backward, before the optimizer step: True when the objective clipped the gradients itself (the
        trainer's gradient_clip_val is then not applied)."""
        return False

    def step_end(self, model: ViT, step: int) -> None:
        """After optimizer step `step`."""

    def network(self, model: ViT) -> nn.Module:
        """The network whose forward the training and evaluation steps call (a sharded strategy shards it)."""
        return model

    def share_fitted(self, other: Objective) -> None:
        """What fitting loads into `other` (a feature distillation's teachers, which its validation loss calls)
        shared with this objective of a second module built from the same hyper-parameters (the EMA's average of a
        sharded run), not loaded again."""

    def networks_beside(self) -> list[nn.Module]:
        """Networks the steps call beside the one `network` returns, each called as a whole (a distillation's
        teachers, frozen, once fitting has loaded them; a feature distillation's projection heads): a sharded
        strategy splits each of them too (training.devices.sharding)."""
        return []

    def per_process(self, processes: int) -> str | None:
        """What of the loss depends on how the global batch is shared among `processes` (computed over each
        process's share, not drawn: training/devices/rank_state.py watches the draws), said where a run resumes on
        another count; None for a loss that is a mean over images."""
        return None

    def taught_by(self) -> tuple[Any, ...]:
        """The teachers a distilled student learnt from (distill_heads.TeacherSpec: name, source), which vitlab.eval
        probes beside it; none for the other objectives."""
        return ()

    def optimized(self, model: ViT) -> nn.Module:
        """What the optimizer's parameter groups are built over."""
        return model
