"""`objective=dino`: self-distillation pretraining as DINO runs it (Caron et al. 2021, facebookresearch/dino
main_dino.py), with DINOv2's options (Oquab et al. 2023, facebookresearch/dinov2 train/ssl_meta_arch.py): iBOT's
masked-patch loss, the KoLeo regulariser, Sinkhorn-Knopp targets; and DINOv3's Gram anchoring (Siméoni et al. 2025:
training/objectives/gram.py). Labels are never read.

A student (a ViT and DINO's head, trained) and a teacher (the same networks, an EMA of the student: no gradient) see
the data module's multi-crop views (data/multicrop.py: 2 global, N local); the teacher the global ones. The loss is
the cross-entropy of each student view against each teacher view but its own, the teacher's outputs centred (running
mean, momentum 0.9) and sharpened (its temperature, warmed up), or balanced by Sinkhorn-Knopp. After each optimizer
step the teacher moves towards the student (momentum cosine from `momentum_teacher` to 1); before it the weight decay
follows its cosine (0.04 to 0.4), the gradients are clipped (3.0, each parameter's norm as DINO, or each network's as
DINOv2) and the head's last layer gets none for the first `freeze_last_layer` epochs. The arithmetic is
training/objectives/dino_losses.py's.

The module's `model` is the teacher's backbone, the network DINO evaluates and releases: vitlab.eval (k-NN, linear,
few-shot), callbacks=representation, model.pretrained=<the .ckpt> and vitlab.export read it. The student is
`student.backbone.*`, `student.dino_head.*` (`student.ibot_head.*`, `student.mask_token`), the teacher's heads
`teacher.*`, the centres `dino_loss.center` (`ibot_loss.center`), the Gram teacher `gram_teacher.*`. Each term of
the loss is logged beside it (train/loss_dino, _koleo, _ibot, _gram: their epoch means, before their weights).
conf/objective/dino.yaml.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitlab.data.multicrop import MultiCropConfig, Views
from vitlab.model import ViT, ViTConfig
from vitlab.model.cost import activation_values
from vitlab.model.dino_head import DINOHead
from vitlab.training.devices.sharding import new_vit
from vitlab.training.objectives import dino_losses as L
from vitlab.training.objectives.dino_nets import Nets, Student, copy_weights, pairs
from vitlab.training.objectives.gram import GramConfig
from vitlab.training.objectives.objective import Objective
from vitlab.utils.errors import UserError
from vitlab.utils.values import check_at_least, check_range, from_mapping

CENTERINGS = ("center", "sinkhorn_knopp")
CLIP_MODES = ("parameter", "network")
TEMP_WARMUPS = ("epoch", "step")


@dataclass(frozen=True)
class DINOConfig:
    """conf/objective/dino.yaml: main_dino.py's argparse defaults; DINOv2's options off."""

    out_dim: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    head_layers: int = 3
    norm_last_layer: bool = True  # the last layer's norms fixed at 1
    freeze_last_layer: int = 1  # epochs without a gradient to the last layer
    momentum_teacher: float = 0.996
    momentum_teacher_end: float = 1.0
    student_temp: float = 0.1
    teacher_temp: float = 0.04
    warmup_teacher_temp: float = 0.04
    warmup_teacher_temp_epochs: int = 0
    teacher_temp_warmup: str = "epoch"  # epoch (DINO: one value an epoch) | step (DINOv2: every iteration)
    centering: str = "center"  # center | sinkhorn_knopp
    center_momentum: float = 0.9
    weight_decay_end: float | None = 0.4  # optim.weight_decay's cosine ends here; null: constant
    clip_grad: float = 3.0  # 0: off (then trainer.gradient_clip_val applies)
    clip_mode: str = "parameter"  # parameter (DINO) | network (DINOv2: backbone and heads, each its own norm)
    dino_weight: float = 1.0
    koleo_weight: float = 0.0  # DINOv2: 0.1
    ibot_weight: float = 0.0  # DINOv2: 1.0
    ibot_separate_head: bool = False
    ibot_out_dim: int = 65536  # the separate patch head's prototypes
    ibot_hidden_dim: int | None = None  # the separate patch head's width; null: hidden_dim (dinov2's ibot.head_*)
    ibot_bottleneck_dim: int | None = None  # its bottleneck; null: bottleneck_dim (dinov2's vitl14.yaml: 256 vs 384)
    mask_probability: float = 0.5  # of the global crops, the share masked for iBOT
    mask_ratio: tuple[float, float] = (0.1, 0.5)  # of a masked crop's patches
    crops: Any = field(default_factory=dict)  # data/multicrop.py MultiCropConfig
    gram: Any = field(default_factory=dict)  # training/objectives/gram.py GramConfig (DINOv3's Gram anchoring)

    def __post_init__(self):
        for name in ("out_dim", "hidden_dim", "bottleneck_dim", "head_layers", "ibot_out_dim"):
            check_at_least(f"objective.{name}", getattr(self, name), 1)
        for name in ("ibot_hidden_dim", "ibot_bottleneck_dim"):
            check_at_least(f"objective.{name}", getattr(self, name), 1, optional=True)
        check_at_least("objective.freeze_last_layer", self.freeze_last_layer, 0)
        check_at_least("objective.warmup_teacher_temp_epochs", self.warmup_teacher_temp_epochs, 0)
        for name in ("momentum_teacher", "momentum_teacher_end", "center_momentum", "mask_probability"):
            check_range(f"objective.{name}", getattr(self, name), 0, 1)
        for name in ("student_temp", "teacher_temp", "warmup_teacher_temp"):
            check_range(f"objective.{name}", getattr(self, name), 0, float("inf"), low_open=True, high_open=True)
        for name in ("clip_grad", "dino_weight", "koleo_weight", "ibot_weight"):
            check_at_least(f"objective.{name}", getattr(self, name), 0)
        for name, allowed in (("centering", CENTERINGS), ("clip_mode", CLIP_MODES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"objective.{name} {getattr(self, name)!r} is not one of {list(allowed)}")
        if self.teacher_temp_warmup not in TEMP_WARMUPS:
            raise UserError(f"objective.teacher_temp_warmup {self.teacher_temp_warmup!r} is not one of {TEMP_WARMUPS}")
        if self.weight_decay_end is not None:
            check_at_least("objective.weight_decay_end", self.weight_decay_end, 0)
        low, high = self.mask_ratio
        if not 0 <= low <= high <= 1:
            raise UserError(f"objective.mask_ratio {list(self.mask_ratio)} must be [low, high] in [0, 1]")
        object.__setattr__(self, "mask_ratio", (float(low), float(high)))
        object.__setattr__(self, "crops", MultiCropConfig.from_dict(self.crops))
        object.__setattr__(self, "gram", GramConfig.from_dict(self.gram))


def data_views(objective: Mapping[str, Any] | None, model: ViTConfig) -> dict[str, Any] | None:
    """What the data module makes of each training batch under `objective` (its `data.multicrop`): DINO's views at
    the model's size, with iBOT's masks on the model's patch grid; None for every other objective."""
    if (objective or {}).get("name") != "dino":
        return None
    cfg = from_mapping(DINOConfig, {k: v for k, v in objective.items() if k != "name"}, "objective=dino")
    crops = dict(objective.get("crops") or {})
    crops["global_size"] = crops.get("global_size") or model.img_hw[0]
    masks = {"probability": cfg.mask_probability if cfg.ibot_weight else 0.0, "ratio": list(cfg.mask_ratio)}
    return {"crops": crops, "masks": masks | {"patch": list(model.patch_hw)}}


class DINO(Objective):
    """`objective=dino`: Caron et al.'s self-distillation, a student and DINO's head against their EMA teacher on
    each image's views, with DINOv2's options (Sinkhorn-Knopp centring, KoLeo, iBOT's masked-patch loss)."""

    name = "dino"
    uses_labels = False
    views = "multicrop"
    best = ("loss", "min")  # the same loss on the validation images, their views drawn alike every time

    @classmethod
    def data_views(cls, options: dict[str, Any], model: ViTConfig) -> dict[str, Any]:
        return {"multicrop": data_views(options, model)}  # each image's global and local crops (and iBOT's masks)

    def __init__(self, options: Mapping[str, Any], model: ViTConfig):
        self.cfg = c = from_mapping(DINOConfig, options, "objective=dino")
        head = dict(hidden_dim=c.hidden_dim, bottleneck_dim=c.bottleneck_dim, nlayers=c.head_layers)
        student = nn.Module()
        student.backbone = new_vit(model)
        student.dino_head = DINOHead(model.embed_dim, c.out_dim, norm_last_layer=c.norm_last_layer, **head)
        if c.ibot_weight and c.ibot_separate_head:
            ibot = head | {"hidden_dim": c.ibot_hidden_dim or c.hidden_dim}
            ibot |= {"bottleneck_dim": c.ibot_bottleneck_dim or c.bottleneck_dim}
            student.ibot_head = DINOHead(model.embed_dim, c.ibot_out_dim, norm_last_layer=c.norm_last_layer, **ibot)
        if c.ibot_weight:
            student.mask_token = nn.Parameter(torch.zeros(1, model.embed_dim))  # dinov2's, zeros
        self.student = student
        self.teacher = nn.Module()  # the heads; the teacher's backbone is the module's `model`
        for name in ("dino_head", "ibot_head"):
            if hasattr(student, name):
                self.teacher.add_module(name, copy.deepcopy(getattr(student, name)).requires_grad_(False))
        self.dino_loss = L.DINOLoss(c.out_dim, c.student_temp, c.center_momentum)
        patch_dim = c.ibot_out_dim if c.ibot_separate_head else c.out_dim
        self.ibot_loss = L.DINOLoss(patch_dim, c.student_temp, c.center_momentum, patch=True) if c.ibot_weight else None
        # DINOv3's Gram teacher: the EMA teacher's backbone as it was (gram.py), no gradient; a copy, so that the
        # random draws (the student's initialisation, the views) are those of the same run without it
        self.gram_teacher = copy.deepcopy(student.backbone).requires_grad_(False) if c.gram.on else None
        self.terms: dict[str, torch.Tensor] = {}  # the last training step's (term_names)
        self.nets: Nets | None = None
        self.total_steps, self.steps_per_epoch, self.step = 1, 1, 0
        self.decayed_groups: list[int] = []
        self.weight_decay = 0.0
        self.val_views: Views | None = None
        self.norm: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- set-up ----------------------------------------------------------------------------------------------
    def check(self, model: ViTConfig, optim: Any) -> None:
        if model.num_classes:
            raise UserError(
                f"objective=dino trains an encoder without a head: model.num_classes is {model.num_classes}; set "
                "model.num_classes=0"
            )
        c = self.cfg.crops
        sizes = {int(c.global_size or model.img_hw[0]), c.local_size if c.local_crops else model.img_hw[0]}
        if sizes != {model.img_hw[0]} and not model.dynamic_img_size:
            raise UserError(
                f"objective=dino's crops of {sorted(sizes)} px need position embeddings at each size: set "
                "model.dynamic_img_size=true"
            )
        if model.img_hw[0] != model.img_hw[1]:
            raise UserError(f"objective=dino makes square crops: model.img_size {list(model.img_hw)} must be square")

    def extra_modules(self) -> dict[str, nn.Module]:
        losses = {"dino_loss": self.dino_loss} | ({"ibot_loss": self.ibot_loss} if self.ibot_loss else {})
        gram = {"gram_teacher": self.gram_teacher} if self.gram_teacher is not None else {}
        return {"student": self.student, "teacher": self.teacher} | losses | gram

    def per_process(self, processes: int) -> str | None:
        if self.cfg.koleo_weight:  # (dinov2's koleo_loss on each GPU's batch)
            return "KoLeo's nearest neighbours are searched within each process's share of the batch"
        return None

    def term_names(self) -> tuple[str, ...]:
        c = self.cfg
        return ("dino", *(name for name in ("koleo", "ibot") if getattr(c, f"{name}_weight")), *("gram",) * c.gram.on)

    def prepare(self, model: ViT) -> None:
        """The teacher starts as the student (main_dino.py: teacher.load_state_dict(student.state_dict())): the
        student's backbone takes the module's `model` (random, or the pretrained weights just loaded) and the teacher's
        heads the student's (and the Gram teacher its backbone); the teacher gets no gradient."""
        copy_weights(self.student.backbone, model)
        for name, head in self.teacher.named_children():
            copy_weights(head, getattr(self.student, name))
        if self.gram_teacher is not None:
            copy_weights(self.gram_teacher, model)
        model.requires_grad_(False)
        self.teacher.requires_grad_(False)

    def network(self, model: ViT) -> nn.Module:
        return self._nets(model)

    def optimized(self, model: ViT) -> nn.Module:
        """The student: its backbone's parameters under the ViT's names (layer decay reads them), its heads beside."""
        return Student(self.student)

    def _nets(self, model: ViT) -> Nets:
        if self.nets is None or self.nets.teacher is not model:
            self.nets = Nets(model, self)
        return self.nets

    def metrics(self, stage: str, num_classes: int) -> dict:
        return {}

    def compile(self, model: ViT, mode: str, regional: bool = False) -> None:
        """The step runs the backbones' blocks alone (their forward_features, not the ViT's forward): always
        regional."""
        super().compile(model, mode, regional=True)

    def blocks_run(self, model: ViT) -> list[nn.Module]:
        gram = [*self.gram_teacher.blocks] if self.gram_teacher is not None else []
        return [*model.blocks, *self.student.backbone.blocks, *gram]

    def fit_start(self, datamodule: Any, device: torch.device) -> None:
        """The validation images' views: the training views' settings, the data's normalisation undone first."""
        settings = getattr(datamodule, "multicrop_settings", None)
        if settings is None:
            raise UserError(f"objective=dino needs multi-crop views, and data {type(datamodule).__name__} makes none")
        self.val_views = Views(settings, datamodule.mean, datamodule.std)
        self.norm = tuple(torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (datamodule.mean, datamodule.std))

    def schedule(self, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int) -> None:
        self.total_steps, self.steps_per_epoch = max(1, total_steps), max(1, steps_per_epoch)
        self.decayed_groups = [i for i, g in enumerate(optimizer.param_groups) if g["weight_decay"] > 0]
        self.weight_decay = max((g["weight_decay"] for g in optimizer.param_groups), default=0.0)

    # ---- steps -----------------------------------------------------------------------------------------------
    def temperature(self, step: int, epoch: int) -> float:
        c = self.cfg
        if c.teacher_temp_warmup == "step":  # dinov2's CosineScheduler(teacher_temp, teacher_temp, warmup, start)
            warm = c.warmup_teacher_temp_epochs * self.steps_per_epoch
            return L.cosine_schedule(
                step, c.teacher_temp, c.teacher_temp, self.total_steps, warm, c.warmup_teacher_temp
            )
        return L.teacher_temperature(epoch, c.warmup_teacher_temp, c.teacher_temp, c.warmup_teacher_temp_epochs)

    def training_loss(self, model: ViT, x, y, epoch: int) -> tuple[torch.Tensor, None]:
        views, masks = x
        return self._nets(model)(views, masks, self.temperature(self.step, epoch), True), None

    def evaluation_loss(self, model: ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The loss of views of the validation images drawn from a fixed seed (the same views every validation);
        the centre is read, not updated."""
        if self.val_views is None or self.norm is None:
            raise RuntimeError("objective=dino evaluates its loss once fitting has begun (fit_start)")
        images = (x * self.norm[1] + self.norm[0]).clamp(0, 1)
        views, masks = self.val_views(images, torch.Generator().manual_seed(0))
        return self._nets(model)(views, masks, self.cfg.teacher_temp, False), None

    def step_start(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """main_dino.py, before iteration `step`: the regularised groups' weight decay from wd_schedule."""
        self.step = step
        if self.cfg.weight_decay_end is None:
            return
        wd = L.cosine_schedule(step, self.weight_decay, self.cfg.weight_decay_end, self.total_steps)
        for i in self.decayed_groups:
            optimizer.param_groups[i]["weight_decay"] = wd

    def clip_gradients(self, epoch: int) -> bool:
        """DINO's, after the backward: clip (each parameter's norm, or each network's as DINOv2), then no gradient to
        the last layer while it is frozen. True: the trainer's own clipping is not used."""
        c, student = self.cfg, self.student
        if c.clip_grad and c.clip_mode == "parameter":
            L.clip_per_parameter(student.parameters(), c.clip_grad)
        elif c.clip_grad:  # dinov2: each of the student's networks (the mask token is its backbone's)
            token = [student.mask_token] if hasattr(student, "mask_token") else []
            parts = [[*student.backbone.parameters(), *token]] + [
                list(part.parameters()) for name, part in student.named_children() if name != "backbone"
            ]
            for part in parts:
                torch.nn.utils.clip_grad_norm_([p for p in part if p.grad is not None], c.clip_grad)
        if epoch < c.freeze_last_layer:
            for name, p in student.named_parameters():
                if "last_layer" in name:
                    p.grad = None
        return bool(c.clip_grad)

    def step_end(self, model: ViT, step: int) -> None:
        """The teacher's EMA step after optimizer step `step` (momentum_schedule[step]); then, when due, the Gram
        teacher becomes the EMA teacher (dinov3 train.py: update_ema, then update_gram)."""
        m = L.cosine_schedule(step, self.cfg.momentum_teacher, self.cfg.momentum_teacher_end, self.total_steps)
        both = pairs(model, self.student.backbone) + [
            pair for name, head in self.teacher.named_children() for pair in pairs(head, getattr(self.student, name))
        ]
        L.ema_update([t for t, _ in both], [s for _, s in both], m)
        if self.gram_teacher is not None and self.cfg.gram.taken_after(step):
            copy_weights(self.gram_teacher, model)

    def activation_shapes(self, model: ViTConfig) -> list[tuple[int, int, int, float]]:
        """The student's blocks over every view (the teacher's forward keeps nothing), each view's head outputs
        (logits, their softmax and gradient), and the image."""
        c, full, prefix = self.cfg.crops, activation_values(model), model.num_prefix_tokens
        size = int(c.global_size or model.img_hw[0])
        glob = prefix + (size // model.patch_hw[0]) * (size // model.patch_hw[1])
        local = prefix + (c.local_size // model.patch_hw[0]) * (c.local_size // model.patch_hw[1])
        views = [(2 * glob, model.embed_dim, model.depth, full)]
        views += [(c.local_crops * local, model.embed_dim, model.depth, full)] if c.local_crops else []
        image = (model.img_hw[0] * model.img_hw[1], model.in_chans, 1, 1)
        return [*views, (2 + c.local_crops, self.cfg.out_dim, 1, 4), image]

    def train_flops_per_image(self, model: ViTConfig) -> float:
        """The student forward + backward of every view (3x), the teacher forward of the global ones."""
        c = self.cfg.crops
        local = model.replace(img_size=c.local_size, dynamic_img_size=True).flops_per_image() if c.local_crops else 0
        teachers = 2 if self.cfg.gram.on else 1  # the Gram teacher's forward of the global crops
        return 3 * (2 * model.flops_per_image() + c.local_crops * local) + teachers * 2 * model.flops_per_image()
