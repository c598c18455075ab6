"""Every recipe's learning-rate curve at full length, vitlab's against its source's, step by step.

python experiments/recipes/curves.py          # ~1 min on 2 CPU cores; prints the README's curve table

Each `experiment=` config is composed as vitlab.train composes it (its LR scaled by its global batch), its optimizer
built over a small ViT (so layer decay makes several groups) and its schedule stepped as ViTModule steps it, for the
recipe's epochs of ImageNet-1k (1,281,167 images, full batches only). The source's formulas are those of
tests/training/test_recipe_schedules.py (MAE's util/lr_sched.py, timm 0.3.2's cosine as DeiT's main.py steps it,
big_vision's create_learning_rate_schedule), which also runs each recipe's schedule for a short run in Lightning.
"""

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from timm.scheduler.scheduler import Scheduler as TimmScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.training.test_recipe_schedules import (  # noqa: E402
    big_vision_cosine,
    mae_adjust_learning_rate,
    timm_032_cosine,
)
from vitlab.cli.config_tree import config_dir, register_resolvers  # noqa: E402
from vitlab.model import ViT, ViTConfig  # noqa: E402
from vitlab.training.optim import OptimConfig, SchedulerConfig, make_optimizer, make_scheduler  # noqa: E402
from vitlab.training.batch_lr import scaled_optim  # noqa: E402

IMAGENET = 1_281_167


def ours(cfg, epochs: int, steps: int) -> tuple[list[list[float]], list[float]]:
    """The LR of every group at every step, stepped as ViTModule does (LambdaLR: step(); timm's: step_update after
    every step, step(epoch + epoch_offset) after every epoch)."""
    model = ViT(ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=10))
    o = OptimConfig.from_dict({**dict(cfg.optim), "fused": False, "betas": list(cfg.optim.betas or []) or None})
    s = SchedulerConfig.from_dict(dict(cfg.scheduler))
    optimizer = make_optimizer(model, o)
    scheduler = make_scheduler(optimizer, s, epochs * steps, epochs)
    initial = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    lrs = []
    for epoch in range(epochs):
        for i in range(steps):
            lrs.append([g["lr"] for g in optimizer.param_groups])
            if isinstance(scheduler, TimmScheduler):
                scheduler.step_update(num_updates=epoch * steps + i + 1)
            else:
                scheduler.step()
        if isinstance(scheduler, TimmScheduler):
            scheduler.step(epoch + s.epoch_offset)
    return lrs, initial


def source(name: str, cfg, epochs: int, steps: int, initial: list[float]) -> list[list[float]]:
    s, lr = cfg.scheduler, cfg.optim.lr
    if name.startswith("mae_"):
        scales = [g / lr for g in initial]
        return [
            [mae_adjust_learning_rate(i / steps + e, lr, s.min_lr, s.warmup_epochs, epochs) * k for k in scales]
            for e in range(epochs)
            for i in range(steps)
        ]
    if name.startswith("deit"):
        per_epoch = [[s.warmup_lr] * len(initial)] + [
            timm_032_cosine(e - 1, initial, epochs, s.min_lr, s.warmup_epochs, s.warmup_lr) for e in range(1, epochs)
        ]
        return [lrs for lrs in per_epoch for _ in range(steps)]
    return [[big_vision_cosine(k, lr, epochs * steps, s.warmup_steps)] * len(initial) for k in range(epochs * steps)]


def main() -> None:
    register_resolvers()
    rows = ["| recipe | steps (epochs x steps) | source | max relative difference | LR at half the run, vitlab / "
            "source | last step's LR, vitlab / source |", "|---|---|---|---|---|---|"]  # fmt: skip
    names = ["mae_pretrain_b16_in1k", "mae_finetune_b16_in1k", "deit_b16_in1k", "deit_s16_in1k", "deit3_b16_in1k"]
    for name in [*names, "bv_s16_i1k_90ep"]:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={name}"])
        with open_dict(cfg):  # lr_base x global batch / lr_base_size, as the run's plan does
            cfg.optim = scaled_optim(
                *(OmegaConf.to_container(cfg[k], resolve=True) for k in ("optim", "data", "trainer"))
            )
        epochs, steps = cfg.trainer.max_epochs, IMAGENET // (cfg.optim.global_batch or cfg.data.batch_size)
        mine, initial = ours(cfg, epochs, steps)
        theirs = source(name, cfg, epochs, steps, initial)
        pairs = [(a, b) for x, y in zip(mine, theirs, strict=True) for a, b in zip(x, y, strict=True)]
        worst = max(abs(a - b) / abs(b) if b else abs(a) for a, b in pairs)
        half, where = len(mine) // 2, {"mae": "lr_sched.py", "dei": "timm 0.3.2 cosine", "bv_": "big_vision"}
        rows.append(
            f"| {name} | {len(mine):,} ({epochs} x {steps}) | {where[name[:3]]} | {worst:.1e} | "
            f"{mine[half][-1]:.6g} / {theirs[half][-1]:.6g} | {mine[-1][-1]:.4g} / {theirs[-1][-1]:.4g} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")  # no training here
    torch.set_num_threads(1)
    main()
