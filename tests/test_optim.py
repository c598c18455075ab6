"""vitlab.optim: parameter groups, layer decay, the warmup-cosine schedule, and one recipe for Python
callers and the command line."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import tiny
from vitlab.configs import config_dir
from vitlab.lit_module import MixupConfig, ViTModule
from vitlab.model import ViT
from vitlab.optim import OptimConfig, layer_id, make_optimizer, make_scheduler, param_groups, warmup_cosine
from vitlab.settings import to_dict


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


def test_optim_yaml_and_dataclass_are_one_source_of_defaults():
    assert OmegaConf.to_container(OmegaConf.load(config_dir() / "optim" / "adamw.yaml")) == to_dict(OptimConfig())
    assert OmegaConf.to_container(OmegaConf.load(config_dir() / "train.yaml"))["mixup"] == to_dict(MixupConfig())


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_a_module_built_in_python_trains_the_cli_default_recipe(compose_cfg):
    from vitlab.run import build_datamodule, build_module

    cfg = compose_cfg("train", [])
    cli = build_module(cfg, build_datamodule(cfg.data))
    plain = ViTModule(model=cli.hparams["model"])  # no optimizer arguments at all
    plain.model.load_state_dict(cli.model.state_dict())
    assert plain.optim == cli.optim and plain.mixup_cfg == cli.mixup_cfg
    total, epochs = 300 * 19, 300  # the default: 300 epochs of 19 steps
    opts = [make_optimizer(m.model, m.optim) for m in (cli, plain)]
    scheds = [make_scheduler(o, m.optim, total, epochs) for o, m in zip(opts, (cli, plain), strict=True)]
    for a, b in zip(*(o.param_groups for o in opts), strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert [p.shape for p in a["params"]] == [p.shape for p in b["params"]]
    lrs = {0: None, 50: None, 95: None, 2000: None, total - 1: None}
    for step in range(total):
        if step in lrs:
            lrs[step] = [s.get_last_lr() for s in scheds]
            assert lrs[step][0] == lrs[step][1]
        for s in scheds:
            s.step()
    assert lrs[95][0][0] == pytest.approx(1e-3)  # warmup (5 epochs = 95 steps) reaches the peak LR
    assert lrs[total - 1][0][0] == pytest.approx(1e-5, rel=1e-2)  # cosine down to lr * min_lr_ratio


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lr": "fast"}, "optim.lr 'fast' must be a number >= 0"),
        ({"betas": [0.9, 1.5]}, "optim.betas [0.9, 1.5] must be two numbers in [0, 1)"),
        ({"layer_decay": 0}, "optim.layer_decay 0 must be in (0, 1]"),
        ({"warmup_steps": -1}, "optim.warmup_steps -1 must be a number >= 0 or null"),
        ({"momentum": 0.9}, "unknown optim key(s) ['momentum']; allowed:"),
    ],
)
def test_bad_optim_settings_name_the_field(values, message):
    with pytest.raises(ValueError) as e:
        OptimConfig.from_dict(values)
    assert str(e.value).startswith(message)


def test_schedule_steps_the_optimizer_lr():
    model = ViT(tiny())
    opt = make_optimizer(model, OptimConfig(warmup_steps=2, min_lr_ratio=0.0, fused=False))
    sched = make_scheduler(opt, OptimConfig(warmup_steps=2, min_lr_ratio=0.0), total_steps=4, epochs=1)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert torch.is_tensor(model.head.weight)
