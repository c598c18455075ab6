"""training/callbacks/health.py: the logged norms are the gradients' before clipping, the weights' and the update's; AGC
is timm's unit-wise rule (gradients under the threshold untouched); the spike guard skips a planted spike (no update, no
optimizer-state change), counts it, stops in one line after too many in a row, and decides after a resume as the
uninterrupted run does. A small Lightning module on fixed data: every number is exact."""

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf, open_dict
from torch import nn

from vitlab.training.callbacks.health import AdaptiveGradientClipping, Health, LossSpikeError, squared_sums
from vitlab.training.run import build
from vitlab.utils.errors import UserError

STEPS, SPIKE = 30, 24


class Net(L.LightningModule):
    """Two blocks and a head (names as our ViT's: blocks.N.*), AdamW; batch `SPIKE` is scaled by `scale`."""

    def __init__(self, scale: float = 1000.0, spikes: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)
        self.scale, self.spikes = scale, spikes

    def training_step(self, batch, batch_idx):
        x, y = X[self.global_step % len(X)], Y[self.global_step % len(Y)]  # by step: the same after any resume
        if SPIKE <= self.global_step < SPIKE + self.spikes:
            x = x * self.scale
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return nn.functional.cross_entropy(self.head(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)


_g = torch.Generator().manual_seed(1)
X, Y = torch.randn(10, 4, 8, generator=_g), torch.randint(0, 3, (10, 4), generator=_g)  # 10 batches of 4


def loader():
    return torch.utils.data.DataLoader(range(10), batch_size=1)  # 10 steps an epoch; the data comes by step


class Memory(Logger):
    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None):
        self.rows.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, *args, **kwargs):
        pass


class Truth(L.Callback):
    """What the norms must be, computed here from the tensors themselves (it runs before Health and before clipping)."""

    def __init__(self):
        self.grad, self.param, self.ratio, self.blocks, self.weights, self.state_steps = {}, {}, {}, {}, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        s = trainer.global_step
        self.grad[s] = torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]).item()
        self.param[s] = torch.nn.utils.get_total_norm(list(pl_module.parameters())).item()
        self.blocks[s] = torch.nn.utils.get_total_norm([p.grad for p in pl_module.blocks[1].parameters()]).item()
        self.weights[s] = [p.detach().clone() for p in pl_module.parameters()]
        self.state_steps[s] = [float(st["step"]) for st in optimizer.state.values()] if optimizer.state else []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.global_step - 1
        before = self.weights[s]
        delta = [p.detach() - b for p, b in zip(pl_module.parameters(), before, strict=True)]
        self.ratio[s] = (torch.nn.utils.get_total_norm(delta) / torch.nn.utils.get_total_norm(before)).item()


def fit(health: Health, net: Net | None = None, steps: int = STEPS, ckpt_path=None, callbacks=(), **trainer):
    net, truth, logger = net or Net(), Truth(), Memory()
    defaults = {"enable_checkpointing": False, "log_every_n_steps": 1, "enable_progress_bar": False}
    trainer = L.Trainer(
        max_steps=steps, logger=logger, callbacks=[truth, health, *callbacks], enable_model_summary=False,
        accelerator="cpu", **(defaults | trainer),
    )  # fmt: skip
    trainer.fit(net, loader(), ckpt_path=ckpt_path)
    return net, truth, logger.rows


def test_logged_norms_are_the_unclipped_gradients_the_weights_and_the_update():
    _, truth, rows = fit(Health(per_block=True), gradient_clip_val=1e-3)  # every step clipped hard: after the norms
    assert len(truth.grad) == STEPS
    for s, row in rows.items():
        assert row["train/grad_norm"] == pytest.approx(truth.grad[s], rel=1e-6)
        assert truth.grad[s] > 1e-2  # far over the clipping: the norm is the unclipped one
        assert row["train/param_norm"] == pytest.approx(truth.param[s], rel=1e-6)
        assert row["train/update_ratio"] == pytest.approx(truth.ratio[s], rel=1e-5)
        assert row["train/grad_norm/blocks.1"] == pytest.approx(truth.blocks[s], rel=1e-6)
        assert {"train/param_norm/blocks.0", "train/grad_norm/blocks.0"} <= row.keys()


def test_norms_are_logged_only_on_logging_steps():
    _, _, rows = fit(Health(), log_every_n_steps=7)
    logged = sorted(s for s, row in rows.items() if "train/grad_norm" in row)
    assert logged == [6, 13, 20, 27] and "train/grad_norm/blocks.0" not in rows[6]


def test_squared_sums_count_each_tensor_once_and_average_the_extra():
    a, b = torch.randn(3, 4), torch.randn(5)
    sums = squared_sums([[a, b], [b]], torch.tensor(2.5))
    assert sums.tolist() == pytest.approx([(a.square().sum() + b.square().sum()).item(), b.square().sum().item(), 2.5])


# ---- AGC ----------------------------------------------------------------------------------------------------------


def test_agc_leaves_gradients_under_the_threshold_untouched_and_clips_the_rest_row_by_row():
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1e-5]]))
        layer.bias.copy_(torch.tensor([3.0, 4.0, 0.0]))  # a vector: one unit, its whole norm (5)
    grad_w = torch.tensor([[0.005, 0, 0, 0], [0, 0.5, 0, 0], [0, 0, 0.2, 0]])
    layer.weight.grad, layer.bias.grad = grad_w.clone(), torch.tensor([0.03, 0.0, 0.04])  # norm 0.05 = the limit
    AdaptiveGradientClipping(0.01).on_before_optimizer_step(None, layer, None)
    assert torch.equal(layer.weight.grad[0], grad_w[0])  # 0.005 < 0.01 x 1: untouched, bit for bit
    assert layer.weight.grad[1].norm().item() == pytest.approx(0.01 * 2)  # 0.5 > 0.02: scaled to the limit
    assert layer.weight.grad[2].norm().item() == pytest.approx(0.01 * 1e-3)  # a tiny row: eps 1e-3 floors its norm
    assert layer.bias.grad.norm().item() == pytest.approx(0.05)


def test_trainer_agc_is_built_as_a_callback_and_needs_a_clip_factor(compose_cfg):
    cfg = compose_cfg("train", ["trainer.gradient_clip_algorithm=agc", "trainer.gradient_clip_val=0.02"])
    trainer = build.build_trainer(
        s := build.settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True)),
        build.trainer_arguments(s),
        logger=False,
    )
    (agc,) = [c for c in trainer.callbacks if isinstance(c, AdaptiveGradientClipping)]
    assert agc.clip_factor == 0.02 and trainer.gradient_clip_val is None
    with open_dict(cfg):
        cfg.trainer.gradient_clip_val = None
    with pytest.raises(UserError, match="gradient_clip_algorithm=agc needs trainer.gradient_clip_val"):
        build.settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True))


# ---- the spike guard ----------------------------------------------------------------------------------------------


def test_a_spike_is_skipped_without_an_update_and_counted(caplog):
    health = Health(spike_factor=5, spike_min_history=10)
    net, truth, rows = fit(health)
    after_spike = truth.weights[SPIKE + 1]
    assert all(torch.equal(a, b) for a, b in zip(truth.weights[SPIKE], after_spike, strict=True))  # no update
    assert truth.state_steps[SPIKE + 1] == truth.state_steps[SPIKE]  # AdamW's moments and step count untouched
    assert truth.state_steps[SPIKE + 2] == [s + 1 for s in truth.state_steps[SPIKE]]  # the next step steps
    assert (
        health.skipped == 1 and rows[SPIKE]["train/skipped_steps"] == 1 and rows[SPIKE - 1]["train/skipped_steps"] == 0
    )
    assert rows[SPIKE]["train/update_ratio"] == 0
    assert f"step {SPIKE} skipped (1 so far)" in caplog.text
    unguarded, truth_unguarded, _ = fit(Health())
    assert not torch.equal(truth_unguarded.weights[SPIKE + 1][0], truth_unguarded.weights[SPIKE][0])


def test_too_many_spikes_in_a_row_stop_the_run_in_one_line():
    with pytest.raises(LossSpikeError) as e:
        fit(Health(spike_factor=5, spike_min_history=10, max_skips_in_a_row=2), Net(spikes=4))
    message = str(e.value)
    assert "\n" not in message and message.startswith("3 optimizer steps in a row skipped as spikes")
    assert f"step {SPIKE + 2}" in message and "no checkpoint was saved yet" in message


def test_the_guard_decides_after_a_resume_as_the_uninterrupted_run(tmp_path):
    whole, _, _ = fit(Health(spike_factor=5, spike_min_history=10))
    callback = L.pytorch.callbacks.ModelCheckpoint(tmp_path, every_n_epochs=1, save_top_k=-1)  # epochs of 10 steps
    fit(Health(spike_factor=5, spike_min_history=10), steps=20, callbacks=[callback], enable_checkpointing=True)
    (ckpt,) = tmp_path.glob("*step=20.ckpt")
    resumed = Health(spike_factor=5, spike_min_history=10)
    net, _, _ = fit(resumed, ckpt_path=ckpt)
    assert resumed.skipped == 1 and len(resumed.history["loss"]) == STEPS - 1
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), net.parameters(), strict=True))


@pytest.mark.parametrize("bad", [{"spike_factor": 1.0}, {"spike_window": 0}, {"max_skips_in_a_row": -1}])
def test_bad_settings_are_one_line(bad):
    with pytest.raises(UserError, match="callbacks.health."):
        Health(**bad)
