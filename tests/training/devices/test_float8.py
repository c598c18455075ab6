"""trainer.precision=float8 (vitlab.training.devices.float8): which Linears torchao's float8 training converts (the
blocks' large ones; never the head or the patch embedding), training steps under torchao's emulated float8 matmul on
the CPU tracking bf16's, the conversion through the Trainer (configure_model) with checkpoints of plain weights, and
the one-line refusals on hardware without float8."""

import copy

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from tests.helpers.configs import tiny  # noqa: E402
from vitlab.model import ViT, ViTConfig  # noqa: E402
from vitlab.training.devices import hardware  # noqa: E402
from vitlab.training.devices.float8 import Float8Precision, converts  # noqa: E402
from vitlab.training.module import ViTModule  # noqa: E402
from vitlab.utils.errors import UserError  # noqa: E402


def float8_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_the_blocks_large_linears_convert_and_the_rest_stays():
    assert converts(nn.Linear(1024, 3072), "blocks.0.attn.qkv")
    assert not converts(nn.Linear(1024, 1000), "head")  # the classifier stays bf16, whatever its size
    assert not converts(nn.Linear(1024, 1024), "attn_pool.kv")  # outside the blocks
    assert not converts(nn.Linear(1000, 4096), "blocks.0.mlp.fc1")  # 1000: not a multiple of 16
    assert not converts(nn.Linear(768, 2304), "blocks.0.attn.qkv")  # B/16's width: below 1024, slower in float8
    vit = ViT(ViTConfig.from_variant("L/16"), device="meta")  # (no memory: the conversion swaps modules only)
    keys = {k: (v.shape, v.dtype) for k, v in vit.state_dict().items()}
    names = Float8Precision().convert(vit)
    assert names == float8_layers(vit) and len(names) == 24 * 4  # qkv, proj, fc1, fc2 of every block
    assert {n.split(".", 2)[2] for n in names} == {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}
    assert not isinstance(vit.head, Float8Linear)
    assert {k: (v.shape, v.dtype) for k, v in vit.state_dict().items()} == keys  # same keys, plain weights
    assert Float8Precision().convert(vit) == names  # once
    with pytest.raises(UserError, match=r"^float8 converts .* at least 1024; this ViT \(width 768\) has none"):
        Float8Precision().convert(ViT(ViTConfig.from_variant("B/16"), device="meta"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_steps_track_bf16(recipe):
    torch.manual_seed(0)
    reference = ViT(tiny(embed_dim=64, num_heads=4))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 7, (16,))
    losses = {}
    for name in ("bf16", recipe):
        model = copy.deepcopy(reference)
        if name != "bf16":
            Float8Precision(recipe, device="cpu", min_features=64, emulate=True).convert(model)
            assert len(float8_layers(model)) == 8
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    bf16, float8 = torch.tensor(losses["bf16"]), torch.tensor(losses[recipe])
    assert float8[-1] < float8[0]  # it learns
    assert (float8 - bf16).abs().max() < 0.03, losses  # as bf16 does, within float8's rounding
    assert (float8 - bf16).abs().max() > 0, losses  # (and float8 did run: e4m3 rounds coarser than bf16)


def test_the_trainer_converts_before_the_steps_and_checkpoints_keep_plain_weights(tmp_path):
    torch.manual_seed(0)
    cfg = tiny(embed_dim=64, num_heads=4)
    module = ViTModule(cfg, optim={"name": "adamw", "lr": 1e-3})
    plugin = Float8Precision("tensorwise", device="cpu", min_features=64, emulate=True)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, plugins=[plugin], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    data = TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 7, (16,)))
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert len(float8_layers(module.model)) == 8 and trainer.global_step == 2
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    plain = ViT(cfg)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    assert torch.equal(plain.blocks[0].mlp.fc1.weight, module.model.blocks[0].mlp.fc1.weight)


H100, A100 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))


@pytest.mark.parametrize(
    "gpus, message",
    [
        ([], r"^trainer.precision=float8 needs CUDA GPUs of compute capability 8.9 or later .*; this run uses none"),
        ([A100], r"; NVIDIA A100-SXM4-80GB \(8.0\) has not: use trainer.precision=bf16-mixed$"),
    ],
)
def test_float8_is_refused_without_float8_gpus(compose_cfg, monkeypatch, gpus, message):
    monkeypatch.setattr(hardware, "cuda_devices", lambda: [(n, True) for n, _ in gpus])
    monkeypatch.setattr(hardware, "cuda_capabilities", lambda: list(gpus))
    cfg = compose_cfg("train", ["trainer=gpu", "trainer.precision=float8"])
    with pytest.raises(UserError, match=message):
        hardware.resolve_trainer(cfg.trainer)
    monkeypatch.setattr(hardware, "cuda_devices", lambda: [(H100[0], True)])
    monkeypatch.setattr(hardware, "cuda_capabilities", lambda: [H100])
    assert hardware.resolve_trainer(cfg.trainer)[1].endswith("precision float8")  # an H100 has float8


def test_the_trainer_gets_bf16_mixed_and_the_float8_plugin_beside_its_own(compose_cfg, monkeypatch):
    from vitlab.training.checkpoint_io import AtomicCheckpointIO
    from vitlab.training.run.build import build_trainer, settle_trainer, trainer_arguments

    monkeypatch.setattr(hardware, "check_float8", lambda precision, gpus: None)  # (as on an H100)
    cfg = compose_cfg("train", ["trainer=cpu", "trainer.precision=float8-rowwise"])
    trainer = build_trainer(
        s := settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True)), trainer_arguments(s), logger=False
    )
    plugin = trainer.precision_plugin
    assert isinstance(plugin, Float8Precision) and (plugin.recipe, plugin.precision) == ("rowwise", "bf16-mixed")
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)  # the config's plugins kept


def float8_steps(vit: nn.Module, x, y, plugin: Float8Precision) -> list[float]:
    optimizer, losses = torch.optim.AdamW(vit.parameters(), lr=1e-3), []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(vit(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        plugin.refresh_scales(vit)
        losses.append(loss.item())
    return losses


def test_float8_composes_with_fsdp2_gathering_in_float8():
    """trainer=fsdp's build (the ViT laid out on the meta device, converted, sharded, materialised per shard) with the
    weights gathered in float8 (torchao's wrapper inside FSDP2's DTensor) and their scales precomputed after each step,
    on a one-process gloo group in this process: it trains as the unsharded float8 ViT does, and its full state dict is
    plain weights a ViT loads. (On two gloo processes, run by hand on this CPU, it trains too: the meta build and the
    host build took the same steps.)"""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vitlab.model.blocks import Block
    from vitlab.training.devices.float8 import plain_state
    from vitlab.training.devices.sharding import materialize, networks_on_meta, new_vit

    cfg, x, y = tiny(embed_dim=64, num_heads=4), torch.randn(16, 3, 32, 32), torch.randint(0, 7, (16,))
    torch.manual_seed(0)
    unsharded, plugin = ViT(cfg), Float8Precision("tensorwise", device="cpu", min_features=64, emulate=True)
    plugin.convert(unsharded)
    expected = float8_steps(unsharded, x, y, plugin)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        with networks_on_meta():
            vit = new_vit(cfg)
        plugin = Float8Precision("tensorwise", device="cpu", min_features=64, emulate=True)
        plugin.convert(vit, sharded=True)
        mesh = init_device_mesh("cpu", (1,))
        for module in [m for m in vit.modules() if isinstance(m, Block)] + [vit]:
            fully_shard(module, mesh=mesh)
        materialize(vit, torch.device("cpu"))
        assert type(vit.blocks[0].mlp.fc1.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        losses = float8_steps(vit, x, y, plugin)
        assert vit.blocks[0].mlp.fc1.weight._local_tensor._precomputed_scale is not None  # refreshed after the step
        state = plain_state(get_model_state_dict(vit, options=StateDictOptions(full_state_dict=True)))
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=0)
    plain = ViT(cfg)
    plain.load_state_dict(state)  # strict: the same keys, plain tensors
    torch.testing.assert_close(plain.state_dict(), unsharded.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_on_a_float8_gpu_as_bf16_does(recipe):
    """On a GPU of capability 8.9+ (the lease's H100): real float8 matmuls, compiled, ViT-L's width at depth 2: ten
    AdamW steps on one batch learn as bf16's do (losses within 0.05 of each other), every block Linear converted."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or later")
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=64, patch_size=16, embed_dim=1024, depth=2, num_heads=16, num_classes=10)
    reference = ViT(cfg).cuda()
    x, y = torch.randn(64, 3, 64, 64, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    losses = {}
    for name in ("bf16", recipe):
        model = copy.deepcopy(reference)
        if name != "bf16":
            assert len(Float8Precision(recipe).convert(model)) == 8
        model.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[name] = []
        for _ in range(10):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.detach())
    bf16, float8 = torch.stack(losses["bf16"]).cpu(), torch.stack(losses[recipe]).cpu()
    assert float8[-1] < float8[0] and (float8 - bf16).abs().max() < 0.05, (bf16, float8)
