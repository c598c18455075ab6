import math

import pytest
import torch

from tests.conftest import tiny
from vitlab.lit_module import ViTModule, layer_id, param_groups, warmup_cosine
from vitlab.model import ViT


def test_no_weight_decay_on_norms_biases_layerscale_pos_embed_and_tokens():
    model = ViT(tiny(reg_tokens=2, init_values=1e-5))
    groups = param_groups(model, lr=1e-3, weight_decay=0.05)
    decayed = {n for g in groups if g["weight_decay"] for n in g["names"]}
    plain = {n for g in groups if not g["weight_decay"] for n in g["names"]}
    assert {
        "pos_embed",
        "cls_token",
        "reg_token",
        "blocks.0.norm1.weight",
        "blocks.0.attn.qkv.bias",
        "blocks.1.ls2.gamma",
        "norm.bias",
        "head.bias",
    } <= plain
    assert decayed == {n for n, p in model.named_parameters() if p.ndim >= 2 and n not in model.no_weight_decay()}
    assert "patch_embed.proj.weight" in decayed and "head.weight" in decayed


def test_fixed_sincos_pos_embed_is_not_optimised():
    model = ViT(tiny(pos_embed="sincos2d"))
    names = {n for g in param_groups(model, 1e-3, 0.05) for n in g["names"]}
    assert "pos_embed" not in names and "cls_token" in names


def test_layer_wise_lr_decay():
    model = ViT(tiny(depth=3))
    lrs = {n: g["lr"] for g in param_groups(model, 1.0, 0.05, layer_decay=0.5) for n in g["names"]}
    # depth 3: embeddings are layer 0 -> 0.5^4, block i -> 0.5^(3 - i), head/norm -> 1
    assert lrs["patch_embed.proj.weight"] == lrs["cls_token"] == 0.5**4
    assert [lrs[f"blocks.{i}.mlp.fc1.weight"] for i in range(3)] == [0.5**3, 0.5**2, 0.5]
    assert lrs["head.weight"] == lrs["norm.weight"] == 1.0
    assert [layer_id(n, 3) for n in ("pos_embed", "blocks.2.attn.qkv.weight", "fc_norm.bias")] == [0, 3, 4]


def test_warmup_then_cosine():
    f = [warmup_cosine(s, warmup=10, total=110, min_ratio=0.01) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[110] == pytest.approx(0.01)
    assert f[60] == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


def test_module_rejects_unknown_optim_keys_and_keeps_plain_hparams():
    with pytest.raises(ValueError, match=r"unknown optim key\(s\) \['momentum'\]"):
        ViTModule(model=tiny().to_dict(), optim={"momentum": 0.9})
    m = ViTModule(model=tiny().to_dict(), optim={"lr": 3e-4}, mixup={"mixup_alpha": 0.2})
    assert m.hparams["optim"] == {"lr": 3e-4} and m.optim["weight_decay"] == 0.05


def test_mixup_gives_soft_targets_and_training_step_runs():
    torch.manual_seed(0)
    m = ViTModule(model=tiny().to_dict(), mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0})
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    mixed_x, soft = m.mixup(x, y)
    assert soft.shape == (4, 7) and torch.allclose(soft.sum(1), torch.ones(4))
    assert not torch.equal(mixed_x, x)


def test_linear_probe_trains_only_the_head():
    m = ViTModule(model=tiny(global_pool="avg").to_dict(), freeze_backbone=True)
    names = {n for g in param_groups(m.model, 1e-3, 0.05) for n in g["names"]}
    assert names == {"head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"}


def test_checkpoint_without_metric_states_loads_but_weights_stay_strict(tmp_path):
    import lightning

    from vitlab.lit_module import load_checkpoint

    m = ViTModule(model=tiny().to_dict())
    weights = {k: v for k, v in m.state_dict().items() if k.startswith("model.")}
    ckpt = {
        "state_dict": weights,
        "hyper_parameters": dict(m.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    torch.save(ckpt, tmp_path / "old.ckpt")
    loaded = load_checkpoint(str(tmp_path / "old.ckpt"))
    assert torch.equal(loaded.model.head.weight, m.model.head.weight)
    del weights["model.head.bias"]
    torch.save(ckpt, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match="model.head.bias"):
        load_checkpoint(str(tmp_path / "broken.ckpt"))
