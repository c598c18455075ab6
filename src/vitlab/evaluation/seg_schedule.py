"""vitlab.eval task=segmentation's schedule (evaluation/seg_probe.py trains the head by it): DINOv2's linear
segmentation configs' AdamW with mmcv's poly policy after a linear warm-up, 40,000 iterations of 16 images with a
warm-up of 1,500. Those 40,000 x 16 are 31.7 epochs of ADE20k's 20,210 training images: on other data the schedule
keeps the epochs (`schedule_for`: 96 iterations on 48 images, not 13,000 epochs of them) and the warm-up DINOv2's
share of it, unless `iterations` or `warmup_iters` are given. No torch: eval's config checks read `check_warmup`
before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass

from vitlab.utils.errors import UserError

# DINOv2's schedule and the data it was set for: 40,000 x 16 images are 31.7 epochs of ADE20k's training split.
DINOV2_ITERATIONS, DINOV2_WARMUP, DINOV2_BATCH, ADE20K_TRAIN = 40_000, 1_500, 16, 20_210


def schedule_for(sp: dict, n_train: int) -> tuple[SegSchedule, str]:
    """eval's segmentation group (`sp`) on a training split of `n_train` images -> (the schedule, how its length was
    reached). `iterations` null: DINOv2's epochs (31.7) of these images at `batch_size`; `warmup_iters` null: DINOv2's
    share of the iterations (1,500 of 40,000); a warm-up as long as the schedule is refused (its rate would never
    reach the poly decay)."""
    batch = sp["batch_size"]
    iterations, why = sp["iterations"], "segmentation.iterations"
    if iterations is None:  # ceil(40,000 x 16 x n / (20,210 x batch)), in integers: 40,000 exactly on ADE20k
        iterations = max(1, -(-DINOV2_ITERATIONS * DINOV2_BATCH * n_train // (ADE20K_TRAIN * batch)))
        epochs = DINOV2_ITERATIONS * DINOV2_BATCH / ADE20K_TRAIN
        why = (f"{epochs:.1f} epochs of the {n_train:,} training images, as DINOv2's {DINOV2_ITERATIONS:,} x "
               f"{DINOV2_BATCH} are of ADE20k's {ADE20K_TRAIN:,}; segmentation.iterations=<n> sets it")  # fmt: skip
    warmup = sp["warmup_iters"]
    if warmup is None:
        warmup = round(iterations * DINOV2_WARMUP / DINOV2_ITERATIONS)
    s = SegSchedule(iterations, batch, sp["lr"], sp["weight_decay"], warmup, seed=sp["seed"])
    return s, f"{iterations:,} iterations of {batch} ({why}); warm-up {warmup:,}"


@dataclass(frozen=True)
class SegSchedule:
    """DINOv2's linear segmentation configs (mmseg 0.27 / mmcv 1.5): AdamW, poly with a linear warm-up."""

    iterations: int = 40_000
    batch_size: int = 16  # global: 8 GPUs x 2 images
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_iters: int = 1500
    warmup_ratio: float = 1e-6
    seed: int = 0

    def __post_init__(self):
        for name in ("iterations", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"segmentation.{name} {value!r} must be an integer >= 1")
        if isinstance(self.warmup_iters, bool) or not isinstance(self.warmup_iters, int) or self.warmup_iters < 0:
            raise UserError(f"segmentation.warmup_iters {self.warmup_iters!r} must be an integer >= 0")
        check_warmup(self.iterations, self.warmup_iters)
        for name in ("lr", "weight_decay"):
            if not getattr(self, name) >= 0 or (name == "lr" and not self.lr > 0):
                raise UserError(f"segmentation.{name} {getattr(self, name)!r} must be a number > 0 (weight decay >= 0)")

    def lr_at(self, step: int) -> float:
        """mmcv's PolyLrUpdaterHook (power 1, min_lr 0) at iteration `step` (0-based), with its linear warm-up:
        regular * (1 - (1 - step / warmup_iters) * (1 - warmup_ratio)) for step < warmup_iters."""
        regular = self.lr * (1 - step / self.iterations)
        if step < self.warmup_iters:
            return regular * (1 - (1 - step / self.warmup_iters) * (1 - self.warmup_ratio))
        return regular

    def describe(self, blocks: int) -> str:
        return (
            f"dinov2 linear segmentation (BNHead): patch tokens of the last {blocks} block(s), BatchNorm + 1x1 conv, "
            f"bilinear to the labels; AdamW lr {self.lr:g} wd {self.weight_decay:g}, poly after {self.warmup_iters} "
            f"warm-up iterations, {self.iterations} iterations of {self.batch_size} cached unaugmented images"
        )


def check_warmup(iterations: int, warmup_iters: int) -> None:
    """A warm-up as long as the schedule never ends: one line naming both (and what null gives)."""
    if warmup_iters > 0 and warmup_iters >= iterations:
        raise UserError(
            f"segmentation.warmup_iters {warmup_iters} is not shorter than segmentation.iterations {iterations}: the "
            f"warm-up would never end; give fewer (null: DINOv2's share, {DINOV2_WARMUP:,} of {DINOV2_ITERATIONS:,}: "
            f"{round(iterations * DINOV2_WARMUP / DINOV2_ITERATIONS)})"
        )
