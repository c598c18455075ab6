"""Every recipe's learning-rate curve is its source's, step by step: each `experiment=` config (and the default)
trains a short run of the same schedule in Lightning with the real ViTModule, and the learning rate of every
optimizer group at every step equals the formula written here from the source's own code (rel 1e-9):

- MAE pretraining and fine-tuning: util/lr_sched.py `adjust_learning_rate`, called by engine_pretrain.py /
  engine_finetune.py at `data_iter_step / len(data_loader) + epoch`, each group's LR times its `lr_scale`;
- DeiT and DeiT III: timm 0.3.2's CosineLRScheduler (`create_scheduler(args, optimizer)`, t_in_epochs) stepped as
  deit main.py does, `lr_scheduler.step(epoch)` after epoch `epoch`;
- big_vision's ViT-S/16: utils.py `create_learning_rate_schedule(decay_type='cosine')` at optax's update count;
- the default (digits): vitlab's warmup_cosine.

The short run keeps the recipe's scheduler settings, its LR (lr_base scaled by its global batch) and its optimizer,
with fewer epochs and steps (the warmup shortened in proportion where it is longer than the run)."""

import math

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.configs import tiny
from vitlab.training.module import ViTModule

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")

# ---- the sources' formulas ------------------------------------------------------------------------------------


def mae_adjust_learning_rate(epoch: float, lr: float, min_lr: float, warmup_epochs: float, epochs: int) -> float:
    """facebookresearch/mae util/lr_sched.py, as written there."""
    if epoch < warmup_epochs:
        lr = lr * epoch / warmup_epochs
    else:
        lr = min_lr + (lr - min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - warmup_epochs) / (epochs - warmup_epochs))
        )
    return lr


def timm_032_cosine(t: int, base_values, t_initial, lr_min, warmup_t, warmup_lr_init) -> list[float]:
    """timm 0.3.2 (6504a42) scheduler/cosine_lr.py CosineLRScheduler._get_lr, t_mul 1, cycle_limit 1, no prefix."""
    if t < warmup_t:
        warmup_steps = [(v - warmup_lr_init) / warmup_t for v in base_values]
        return [warmup_lr_init + t * s for s in warmup_steps]
    i = t // t_initial
    t_i, t_curr = t_initial, t - t_initial * i
    if i < 1:
        return [lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * t_curr / t_i)) for lr_max in base_values]
    return [lr_min for _ in base_values]


def big_vision_cosine(step: int, base: float, total_steps: int, warmup_steps: int) -> float:
    """google-research/big_vision utils.py create_learning_rate_schedule(decay_type='cosine'), in float64 (big_vision
    returns it as float32)."""
    lr = base
    progress = min(max((step - warmup_steps) / float(total_steps - warmup_steps), 0.0), 1.0)
    lr = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if warmup_steps:
        lr = lr * min(1.0, step / warmup_steps)
    return lr


def vitlab_warmup_cosine(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """vitlab's default (conf/scheduler/warmup_cosine.yaml): (step + 1) / warmup, then cosine to lr * min_lr_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- the short runs -------------------------------------------------------------------------------------------


class _RecordLR(L.Callback):
    def __init__(self):
        self.lrs: list[list[float]] = []  # per step, per group
        self.initial: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        groups = trainer.optimizers[0].param_groups
        self.initial = [g.get("initial_lr", g["lr"]) for g in groups]
        self.lrs.append([g["lr"] for g in groups])


def run_schedule(cfg, epochs: int, steps: int, mae: bool = False) -> tuple[list[list[float]], list[float]]:
    """The recipe's optimizer and schedule on a tiny ViT (its MAE decoder too) for `epochs` x `steps` steps."""
    torch.manual_seed(0)
    model = tiny(num_classes=0 if mae else 7, depth=2).to_dict()
    objective = {"name": "mae", "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2} if mae else None
    optim = OmegaConf.to_container(cfg.optim, resolve=True) | {"fused": False}
    module = ViTModule(model=model, objective=objective, optim=optim, scheduler=OmegaConf.to_container(cfg.scheduler))
    data = TensorDataset(torch.randn(2 * steps, 3, 32, 32), torch.arange(2 * steps) % 7)
    record = _RecordLR()
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[record], logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=2))
    assert len(record.lrs) == epochs * steps
    return record.lrs, record.initial


def recipe(compose_cfg, name: str | None, *overrides: str):
    from omegaconf import open_dict

    from vitlab.training.batch_lr import scaled_optim

    cfg = compose_cfg("train", ([f"experiment={name}"] if name else []) + list(overrides))
    with open_dict(cfg):  # lr_base x global batch / lr_base_size, as the run's plan does
        cfg.optim = scaled_optim(*(OmegaConf.to_container(cfg[k], resolve=True) for k in ("optim", "data", "trainer")))
    return cfg


def assert_curve(ours: list[list[float]], expected: list[list[float]]) -> None:
    """Every step, every group: equal within rel 1e-9 (a zero LR exactly zero)."""
    assert len(ours) == len(expected)
    for step, (a, b) in enumerate(zip(ours, expected, strict=True)):
        close = [x == y if y == 0 else abs(x - y) <= 1e-9 * abs(y) for x, y in zip(a, b, strict=True)]
        assert all(close), (step, a, b)


# ---- per recipe ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, epochs, warmup, mae",
    [("mae_pretrain_b16_in1k", 20, 1, True), ("mae_finetune_b16_in1k", 20, 1, False)],  # 800/40, 100/5 shortened
)
def test_mae_recipes_are_lr_sched_py_per_step(compose_cfg, name, epochs, warmup, mae):
    steps = 3
    cfg = recipe(compose_cfg, name, f"trainer.max_epochs={epochs}", f"scheduler.warmup_epochs={warmup}")
    blr, batch = cfg.optim.lr_base, cfg.data.batch_size * cfg.trainer.accumulate_grad_batches
    lr, min_lr = blr * batch / 256, cfg.scheduler.min_lr  # main_pretrain.py / main_finetune.py: blr x eff_batch / 256
    assert cfg.optim.lr == pytest.approx(lr, rel=1e-12) and cfg.optim.global_batch == batch
    ours, initial = run_schedule(cfg, epochs, steps, mae=mae)
    scales = [g / lr for g in initial]  # MAE's lr_scale: layer decay 0.65^(depth + 1 - layer) when fine-tuning
    assert len(set(scales)) == (4 if name == "mae_finetune_b16_in1k" else 1)
    expected = []
    for epoch in range(epochs):
        for data_iter_step in range(steps):
            value = mae_adjust_learning_rate(data_iter_step / steps + epoch, lr, min_lr, warmup, epochs)
            expected.append([value * s for s in scales])
    assert_curve(ours, expected)
    assert ours[0] == [0.0] * len(scales) and ours[-1][-1] < 0.01 * lr


@pytest.mark.parametrize("name", ["deit_b16_in1k", "deit_s16_in1k", "deit3_b16_in1k"])
def test_deit_recipes_are_timm_032_cosine_stepped_as_deits_main(compose_cfg, name):
    epochs, steps = 12, 2  # 300 (800) epochs shortened; the 5 warmup epochs kept
    cfg = recipe(compose_cfg, name, f"trainer.max_epochs={epochs}")
    s = cfg.scheduler
    ours, initial = run_schedule(cfg, epochs, steps)
    expected = []
    for epoch in range(epochs):  # main.py: epoch 0 at warmup_lr (the scheduler's __init__), then step(epoch) after each
        lrs = (
            [s.warmup_lr] * len(initial)
            if epoch == 0
            else timm_032_cosine(epoch - 1, initial, epochs, s.min_lr, s.warmup_epochs, s.warmup_lr)
        )
        expected += [lrs] * steps
    assert_curve(ours, expected)
    assert ours[steps][0] == s.warmup_lr  # epoch 1 runs at warmup_lr too: DeiT's one-epoch lag


def test_big_vision_recipe_is_its_warmup_cosine(compose_cfg):
    epochs, steps, warmup = 6, 4, 5  # 90 epochs and 10,000 warmup steps shortened
    cfg = recipe(compose_cfg, "bv_s16_i1k_90ep", f"trainer.max_epochs={epochs}", f"scheduler.warmup_steps={warmup}")
    ours, initial = run_schedule(cfg, epochs, steps)
    assert initial == [cfg.optim.lr] * len(initial) == [1e-3] * len(initial)  # config.lr, no batch scaling
    expected = [[big_vision_cosine(k, 1e-3, epochs * steps, warmup)] * len(initial) for k in range(epochs * steps)]
    assert_curve(ours, expected)


def test_the_default_is_vitlabs_warmup_cosine(compose_cfg):
    epochs, steps = 10, 3
    cfg = recipe(compose_cfg, None, f"trainer.max_epochs={epochs}", "scheduler.warmup_epochs=2")
    ours, initial = run_schedule(cfg, epochs, steps)
    s, total = cfg.scheduler, epochs * steps
    expected = [[vitlab_warmup_cosine(k, g, 2 * steps, total, s.min_lr_ratio) for g in initial] for k in range(total)]
    assert_curve(ours, expected)
