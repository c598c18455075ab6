"""vitlab.eval task=segmentation: DINOv2's linear segmentation probe on frozen patch tokens, scored by mIoU and pixel
accuracy as mmseg computes them.

The head is DINOv2's `BNHead` (dinov2/eval/segmentation/models/decode_heads/linear_head.py, its "linear" configs
dinov2_vit*14_ade20k_linear_config.py): the patch tokens of the last block, or of the last n blocks concatenated
(in_index / resize_concat), each after the backbone's final norm, as (B, n * D, h, w) maps; BatchNorm (SyncBN: the
statistics of the whole global batch) and a 1x1 convolution to the classes (mmseg's conv_seg, weight N(0, 0.01),
bias 0; no dropout); the logits upsampled bilinearly (align_corners false) to the label's size. The loss is mmseg's
CrossEntropyLoss with ignore_index 255, averaged over every pixel (avg_non_ignore false: ignored pixels count in
the denominator as zeros). The schedule is the config's: AdamW lr 1e-3, weight decay 1e-4, betas (0.9, 0.999);
mmcv's poly policy (power 1, to 0) after a linear warm-up of 1,500 iterations from 1e-6 of it; 40,000 iterations of
16 images (8 GPUs x 2): 31.7 epochs of ADE20k's 20,210 training images, which other data keeps (the schedule's
length and warm-up: evaluation/seg_schedule.py).

Not DINOv2's: the head trains on the cached features of the unaugmented training images at img_size (DINOv2 trains on
random resizes (0.5-2x), 512-pixel crops, flips and photometric distortion), and the masks are scored at img_size as
evaluation prepares them (data/masks.py), not at each image's own size with a sliding window.

The metric is torchmetrics' (MulticlassJaccardIndex, macro, and MulticlassAccuracy, micro, both with ignore_index
255): over all the split's pixels, classes absent from both predictions and labels left out of the mean, which is
mmseg's intersect_and_union / total_area_to_metrics with its nanmean (tests/evaluation/test_segmentation.py holds
the two equal). Plain torch, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.data.masks import IGNORE
from vitlab.data.naflex import check_square_reader
from vitlab.evaluation.linear import sharded_stream
from vitlab.evaluation.seg_schedule import SegSchedule
from vitlab.utils.errors import UserError


@dataclass(frozen=True)
class PatchTokens:
    """The patch tokens of `blocks` (absolute indices, ascending) after the final norm, concatenated on the channels:
    (B, len(blocks) * D, h, w), DINOv2's get_intermediate_layers(n, reshape=True) fed through resize_concat."""

    blocks: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"patches{self.blocks[0]}-{self.blocks[-1]}" if len(self.blocks) > 1 else f"patches{self.blocks[0]}"

    def dim(self, model) -> tuple[int, int, int]:
        (ph, pw), (h, w) = model.cfg.patch_hw, model.cfg.img_hw
        return (model.num_features * len(self.blocks), -(-h // ph), -(-w // pw))

    def extract(self, model, x: torch.Tensor) -> torch.Tensor:
        out = model.forward_intermediates(x, list(self.blocks), norm=True, stop_early=True, output_fmt="NCHW",
                                          intermediates_only=True)  # fmt: skip
        return torch.cat(out, dim=1)


def check_channels(in_chans: int, channels: int) -> None:
    if in_chans != channels:
        raise UserError(
            f"checkpoint expects {in_chans} channels, but the data has {channels}: set data.channels={in_chans}"
        )


def patch_tokens(model, n_last_blocks) -> PatchTokens:
    depth = len(model.blocks)
    if isinstance(n_last_blocks, bool) or not isinstance(n_last_blocks, int) or not 1 <= n_last_blocks <= depth:
        raise UserError(f"segmentation.n_last_blocks {n_last_blocks!r} must be a block count from 1 to {depth}")
    check_square_reader(model.cfg, "task=segmentation reads square patch grids; a NaFlex model has none")
    return PatchTokens(tuple(range(depth - n_last_blocks, depth)))


class BNHead(nn.Module):
    """DINOv2's BNHead: BatchNorm2d over the (B, C, h, w) features, then mmseg's conv_seg (a 1x1 convolution to
    the classes) -> (B, classes, h, w) logits."""

    def __init__(self, channels: int, num_classes: int, generator: torch.Generator | None = None):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv_seg = nn.Conv2d(channels, num_classes, kernel_size=1)
        with torch.no_grad():  # mmseg's BaseDecodeHead init_cfg: Normal(std=0.01) on conv_seg, bias 0
            self.conv_seg.weight.normal_(0.0, 0.01, generator=generator)
            self.conv_seg.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_seg(self.bn(x))


def upsampled(logits: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """mmseg's resize of the logits to the labels' size: bilinear, align_corners false."""
    return logits if tuple(logits.shape[-2:]) == tuple(hw) else F.interpolate(logits, size=hw, mode="bilinear",
                                                                              align_corners=False)  # fmt: skip


def seg_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """mmseg's CrossEntropyLoss (ignore_index 255, avg_non_ignore false): the mean over every pixel, ignored ones
    counting as zeros."""
    return F.cross_entropy(
        upsampled(logits, masks.shape[-2:]), masks.long(), ignore_index=IGNORE, reduction="none"
    ).mean()


def train_head(head: BNHead, feats: torch.Tensor, masks: torch.Tensor, s: SegSchedule, device,
               on_step: Callable | None = None) -> BNHead:  # fmt: skip
    """`s.iterations` AdamW steps of `head` on batches of `s.batch_size` cached (N, C, h, w) features and their
    (N, H, W) masks, drawn from a shuffled stream that runs over them again and again (linear.sharded_stream)."""
    head.train().to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=s.lr, betas=(0.9, 0.999), weight_decay=s.weight_decay)
    stream = sharded_stream(len(feats), s.seed, 0, 1, s.batch_size)
    for step in range(s.iterations):
        for group in opt.param_groups:
            group["lr"] = s.lr_at(step)
        idx = torch.from_numpy(np.sort(next(stream)))  # (sorted: rows read in order from a memory-mapped cache)
        loss = seg_loss(head(feats[idx].to(device)), masks[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step)
    return head


def check_labels(masks: torch.Tensor, num_classes: int, split: str) -> None:
    """Every label of the (N, H, W) masks below `num_classes` or ignored (255): what data.check_images checks before
    the run, checked here too for data read without it (one line, not the loss's error)."""
    for start in range(0, len(masks), 256):
        m = masks[start : start + 256]
        above = m[(m >= num_classes) & (m != IGNORE)]
        if len(above):
            raise UserError(
                f"the {split} split's masks hold label {int(above.max())}, above data.num_classes {num_classes} "
                f"(labels 0..{num_classes - 1}, {IGNORE} ignored): set data.num_classes to the data's class count"
            )


class SegScores:
    """mIoU and aAcc over every pixel of the batches given to `update` (torchmetrics' MulticlassJaccardIndex, macro,
    and MulticlassAccuracy, micro, ignore_index 255): mmseg's total_area_to_metrics, mIoU its nanmean over the
    classes present in the predictions or the labels."""

    def __init__(self, num_classes: int, device="cpu"):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

        # Rank 0 scores every pixel itself (the others' features were gathered to it): no syncing across processes.
        kw = {"ignore_index": IGNORE, "sync_on_compute": False}
        self.iou = MulticlassJaccardIndex(num_classes, average="macro", **kw).to(device)
        self.acc = MulticlassAccuracy(num_classes, average="micro", **kw).to(device)

    def update(self, pred: torch.Tensor, labels: torch.Tensor) -> None:
        """(B, H, W) predicted classes against (B, H, W) labels (255 ignored)."""
        self.iou.update(pred, labels.long())
        self.acc.update(pred, labels.long())

    def compute(self) -> dict[str, float]:
        miou = self.iou.compute().item()
        return {"mIoU": miou if not math.isnan(miou) else 0.0, "aAcc": self.acc.compute().item()}


@torch.no_grad()
def score(head: BNHead, feats: torch.Tensor, masks: torch.Tensor, num_classes: int, device, batch: int = 16) -> dict:
    """mIoU and aAcc of the head's predictions on (N, C, h, w) features against (N, H, W) masks."""
    scores = SegScores(num_classes, device)
    head.eval().to(device)
    for start in range(0, len(feats), batch):
        y = masks[start : start + batch].to(device)
        scores.update(upsampled(head(feats[start : start + batch].to(device)), y.shape[-2:]).argmax(1), y)
    return scores.compute()
