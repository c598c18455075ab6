"""On a CUDA GPU (skipped elsewhere): a bf16-mixed training step, vitlab.train's steps without a host
sync (the default and ViT-B/16, data held on the GPU or read by the loader's workers, EMA; the same steps on the CPU:
tests/training/test_module.py's HostReads spy), and exact resume, as trainer=gpu runs them (the non-finite-loss
stop on a GPU: test_reliability)."""

import json

import pytest
import torch

from tests.end_to_end.test_reliability import GPU_RUN
from tests.helpers.callbacks import ForbidSync
from tests.helpers.commands import run_cli
from tests.helpers.configs import extra_callback, tiny
from vitlab.training.module import ViTModule
from vitlab.training.optim import OptimConfig, make_optimizer

pytestmark = pytest.mark.gpu


def test_bf16_autocast_training_step_lowers_the_loss():
    torch.manual_seed(0)
    module = ViTModule(model=tiny().to_dict(), scheduler={"warmup_epochs": 0}).cuda()
    optimizer = make_optimizer(module.model, OptimConfig(lr=3e-3))
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


NO_SYNC = {
    "digits": [],  # the default: held in GPU memory (data.on_device=auto), shifted there
    "digits-loader-ema": ["data.on_device=false", "callbacks=ema"],  # the loader (pinned, copied without blocking)
    "fake-on-device": [
        "data=fake", "data.num_train=512", "data.batch_size=32", "model.img_size=32", "model.patch_size=8",
        "++data.train_transform.shift=4", "++data.train_transform.hflip=0.5",
        "++data.train_transform.random_erasing=0.5", "objective.mixup.mixup_alpha=0.2",
        "objective.mixup.cutmix_alpha=1.0",
    ],
    "fake-uint8-workers": [
        "data=fake", "data.num_train=512", "data.batch_size=32", "data.on_device=false",
        "++data.train_transform.random_erasing=0.5", "objective.mixup.mixup_alpha=0.2",
        "objective.mixup.cutmix_alpha=1.0", "model.img_size=32", "model.patch_size=8",
    ],
    "b16": ["model=vit_b16", "data=fake", "data.num_train=512", "data.batch_size=32"],  # 224 px, on the device
    "b16-workers": ["model=vit_b16", "data=fake", "data.num_train=512", "data.batch_size=32", "data.on_device=false"],
}  # fmt: skip


@pytest.mark.parametrize("data", list(NO_SYNC.values()), ids=list(NO_SYNC))
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
            *extra_callback("zz_no_sync", "ForbidSync"),
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
        *extra_callback("kill", "SignalAtStep", step=13),
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


def test_the_mission_command_as_typed_trains_in_bf16_on_a_bf16_gpu(tmp_path):
    """`python -m vitlab.train model=vit_b16 trainer.devices=1 trainer.max_steps=50`, nothing else: precision auto
    resolves to bf16-mixed on a GPU with bf16 (the start-up line and config.yaml say so)."""
    import yaml

    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("this GPU has no bf16")
    run_dir = tmp_path / "run"
    r = run_cli("train", "model=vit_b16", "trainer.devices=1", "trainer.max_steps=50", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "precision bf16-mixed (auto: every GPU in use has bf16)" in r.stderr + r.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["precision"] == "bf16-mixed"
