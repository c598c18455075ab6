"""trainer.precision / trainer.strategy `auto` (vitlab.training.devices.hardware), with the CUDA query replaced (no GPU
here): the mission's command as typed trains in bf16 with DDP on bf16 GPUs, in fp32 elsewhere, an explicit value
kept."""

import logging

import pytest
from omegaconf import OmegaConf

from vitlab.training.devices import hardware

H100, V100 = ("NVIDIA H100 80GB HBM3", True), ("Tesla V100-SXM2-16GB", False)


def resolved(compose_cfg, monkeypatch, gpus, overrides=()):
    monkeypatch.setattr(hardware, "cuda_devices", lambda: list(gpus))
    cfg = compose_cfg("train", ["model=vit_b16", *overrides])
    return hardware.resolve_trainer(cfg.trainer)


def test_four_bf16_gpus_train_in_bf16_with_ddp_in_four_processes(compose_cfg, monkeypatch):
    t, line = resolved(compose_cfg, monkeypatch, [H100] * 4, ["trainer.devices=4"])
    assert (t["precision"], t["strategy"]) == ("bf16-mixed", "ddp")
    assert line == (
        "trainer: 4 CUDA GPU(s) (NVIDIA H100 80GB HBM3), 4 processes (ddp), precision bf16-mixed "
        "(auto: every GPU in use has bf16)"
    )
    t, line = resolved(compose_cfg, monkeypatch, [H100] * 8, ["trainer.devices=4", "trainer.num_nodes=2"])
    assert (t["precision"], t["strategy"]) == ("bf16-mixed", "ddp") and "8 processes" in line
    t, line = resolved(compose_cfg, monkeypatch, [H100] * 8, ["trainer.devices=1"])
    assert (t["precision"], t["strategy"]) == ("bf16-mixed", "auto")  # one GPU: no DDP


def test_a_gpu_without_bf16_trains_in_fp32_and_says_why(compose_cfg, monkeypatch):
    t, line = resolved(compose_cfg, monkeypatch, [V100] * 2, ["trainer.devices=2"])
    assert (t["precision"], t["strategy"]) == ("32-true", "ddp")
    assert line.endswith("precision 32-true (auto: Tesla V100-SXM2-16GB has no bf16 (compute capability < 8.0))")
    t, _ = resolved(compose_cfg, monkeypatch, [H100, V100], ["trainer.devices=[0]"])
    assert t["precision"] == "bf16-mixed"  # the GPU in use has it


def test_cpu_and_explicit_values(compose_cfg, monkeypatch):
    t, line = resolved(compose_cfg, monkeypatch, [])
    assert (t["precision"], t["strategy"]) == (
        "32-true",
        "auto",
    ) and line == "trainer: CPU, precision 32-true (auto: no GPU in use)"
    t, _ = resolved(compose_cfg, monkeypatch, [H100] * 4, ["trainer.devices=4", "trainer.precision=32-true"])
    assert (t["precision"], t["strategy"]) == ("32-true", "ddp")  # an explicit precision wins
    t, _ = resolved(compose_cfg, monkeypatch, [H100] * 4, ["trainer=cpu"])
    assert t["precision"] == "32-true"  # accelerator=cpu: the GPUs are not in use


@pytest.mark.parametrize("trainer, precision, strategy", [("gpu", "bf16-mixed", "auto"), ("ddp", "bf16-mixed", "ddp"),
                                                           ("ddp_cpu", "32-true", "ddp")])  # fmt: skip
def test_the_named_trainers_compose_as_before(compose_cfg, monkeypatch, trainer, precision, strategy):
    t, _ = resolved(compose_cfg, monkeypatch, [H100] * 4, [f"trainer={trainer}"])
    assert (t["precision"], t["strategy"]) == (precision, strategy)


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer=ddp_cpu", "trainer.devices=2"], ["trainer=fsdp_cpu", "trainer.devices=2"], ["trainer=fsdp_cpu"],
     ["trainer.precision=bf16"], ["trainer.accelerator=cpu", "trainer.devices=3", "trainer.num_nodes=2"]],
)  # fmt: skip
def test_the_devices_a_plan_reads_are_the_trainers(compose_cfg, overrides):
    """What data.batch_size=auto reads as the run is planned (hardware.Devices, from the settled settings) is what the
    Trainer built from them runs on: its processes, its precision, whether FSDP splits the weights."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from vitlab.training.run import build

    cfg = compose_cfg("train", list(overrides))
    settled = build.settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True))
    devices = hardware.devices_of(settled)
    trainer = build.build_trainer(settled, build.trainer_arguments(settled), logger=False)
    assert devices.processes == trainer.num_devices * trainer.num_nodes and devices.local == trainer.num_devices
    assert devices.precision == str(trainer.precision) and devices.device == trainer.strategy.root_device.type
    sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)) and trainer.strategy.shards
    assert devices.sharded == sharded


def test_the_command_as_typed_on_this_cpu_records_its_choice(compose_cfg, tmp_path, caplog):
    """No GPU here: the default trainer resolves to fp32 on the CPU; the line is logged and config.yaml has it."""
    import yaml

    from vitlab.train import train

    with caplog.at_level(logging.INFO, logger="vitlab.training.run.build"):
        train(compose_cfg("train", ["debug=limit", "progress_bar=none"]))
    assert "trainer: CPU, precision 32-true (auto: no GPU in use)" in caplog.messages
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]
    assert saved["precision"] == "32-true" and saved["strategy"] == "auto"


def test_several_cpu_processes_are_named_with_their_strategy(compose_cfg, monkeypatch):
    """trainer=cpu trainer.devices=2 starts two DDP processes: the start line says so (issue 34), and the config records
    Lightning's choice of strategy."""
    t, line = resolved(compose_cfg, monkeypatch, [], ["trainer=cpu", "trainer.devices=2"])
    assert t["strategy"] == "ddp" and line == "trainer: CPU, 2 processes (ddp), precision 32-true (auto: no GPU in use)"
    t, line = resolved(compose_cfg, monkeypatch, [], ["trainer=cpu", "trainer.precision=bf16-mixed"])
    assert line == "trainer: CPU, precision bf16-mixed"  # nothing left to choose: still said


def test_sdpa_backend_leaves_one_fused_kernel_and_the_math_fallback():
    import torch

    from vitlab.utils.errors import UserError

    b = torch.backends.cuda
    flags = (b.flash_sdp_enabled, b.mem_efficient_sdp_enabled, b.cudnn_sdp_enabled, b.math_sdp_enabled)
    before = [f() for f in flags]
    q = torch.randn(2, 4, 5, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    try:
        hardware.use_sdpa_backend("auto")
        assert [f() for f in flags] == before  # torch's own choice
        hardware.use_sdpa_backend("cudnn")
        assert [f() for f in flags] == [False, False, True, True]
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), expected)  # (math here)
        hardware.use_sdpa_backend("flash")
        assert [f() for f in flags] == [True, False, False, True]
        with pytest.raises(UserError, match=r"^sdpa_backend 'fast' is not one of \['auto', 'flash', 'efficient'"):
            hardware.use_sdpa_backend("fast")
    finally:
        for enable, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_cudnn_sdp, b.enable_math_sdp),
                              before, strict=True):  # fmt: skip
            enable(on)
