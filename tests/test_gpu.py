"""On a CUDA GPU (skipped elsewhere): a bf16-mixed training step, vitlab.train's steps without a host
sync, exact resume and the non-finite-loss stop, as trainer=gpu runs them."""

import json

import pytest
import torch

from tests.helpers import ForbidSync, run_cli, tiny
from tests.test_reliability import RUN
from vitlab.lit_module import ViTModule
from vitlab.optim import OptimConfig, make_optimizer

pytestmark = pytest.mark.gpu

GPU_RUN = [o for o in RUN if not o.startswith("trainer.accelerator")] + ["trainer=gpu"]


def test_bf16_autocast_training_step_lowers_the_loss():
    torch.manual_seed(0)
    module = ViTModule(model=tiny().to_dict(), optim={"warmup_epochs": 0}).cuda()
    optimizer = make_optimizer(module.model, OptimConfig(lr=3e-3, warmup_epochs=0))
    x, y = torch.randn(16, 3, 32, 32, device="cuda"), torch.randint(0, 7, (16,), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, logits = module.loss(x, y)
        assert logits.dtype == torch.bfloat16
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "data",
    [
        [],  # digits: in GPU memory, augmented there
        [
            "data=fake",
            "data.num_train=512",
            "data.batch_size=32",
            "++data.train_transform.random_erasing=0.5",
            "mixup.mixup_alpha=0.2",
            "mixup.cutmix_alpha=1.0",
            "model.img_size=32",
            "model.patch_size=8",
        ],
    ],
    ids=["digits", "fake-uint8-workers"],
)
def test_training_steps_never_wait_for_the_gpu(compose_cfg, data):
    from vitlab.train import train

    ForbidSync.guarded = 0
    cfg = compose_cfg(
        "train",
        [
            "trainer=gpu",
            "trainer.max_epochs=2",
            "trainer.log_every_n_steps=8",
            "progress_bar=none",
            "logger=csv",
            *data,
            "+callbacks.zz_no_sync._target_=tests.helpers.ForbidSync",
        ],
    )  # last: see ForbidSync
    try:
        train(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ForbidSync.guarded >= 10  # the check ran on many steps


def test_resume_on_the_gpu_is_exact(tmp_path):
    full, killed, resumed = tmp_path / "full", tmp_path / "killed", tmp_path / "resumed"
    assert run_cli("train", *GPU_RUN, f"hydra.run.dir={full}").returncode == 0
    r = run_cli(
        "train",
        *GPU_RUN,
        "+callbacks.kill._target_=tests.helpers.SignalAtStep",
        "+callbacks.kill.step=13",
        f"hydra.run.dir={killed}",
    )
    assert r.returncode == 143, r.stderr[-3000:]
    r = run_cli(
        "train", *GPU_RUN, f"ckpt_path={killed / 'checkpoints' / 'interrupted.ckpt'}", f"hydra.run.dir={resumed}"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(full / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-6
    m_a, m_b = (json.loads((d / "metrics.json").read_text()) for d in (full, resumed))
    for key in ("val/acc", "val/loss", "test/acc", "test/loss"):
        assert m_b[key] == pytest.approx(m_a[key], abs=1e-6), key


def test_a_non_finite_loss_on_the_gpu_stops_at_the_next_log_step_and_is_never_saved(tmp_path):
    run = tmp_path / "r"
    r = run_cli(
        "train",
        *GPU_RUN,
        "+callbacks.nan._target_=tests.helpers.NanAtStep",
        "+callbacks.nan.step=12",
        f"hydra.run.dir={run}",
    )
    last = run / "checkpoints" / "last.ckpt"
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (  # log_every_n_steps=5: read at step 14
        f"error: training loss became nan at step 12 (epoch 1); the weights from then on (step 14) were not saved; "
        f"the last good checkpoint is {last}"
    )
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 9 and all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
