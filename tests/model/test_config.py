import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from vitlab.model import VARIANTS, ViT, ViTConfig, as_hw, parse_variant
from vitlab.utils.errors import UserError

aten = torch.ops.aten


def test_variant_table_is_the_papers():
    # ViT paper Table 1 (Ti from DeiT); g and G from "Scaling Vision Transformers" Table 2: width, depth, heads, MLP
    widths = {
        k: (v["embed_dim"], v["depth"], v["num_heads"], round(v["embed_dim"] * v.get("mlp_ratio", 4)))
        for k, v in VARIANTS.items()
    }
    assert widths == {
        "Ti": (192, 12, 3, 768),
        "S": (384, 12, 6, 1536),
        "B": (768, 12, 12, 3072),
        "L": (1024, 24, 16, 4096),
        "H": (1280, 32, 16, 5120),
        "g": (1408, 40, 16, 6144),
        "G": (1664, 48, 16, 8192),
    }
    assert parse_variant("L/14") == dict(embed_dim=1024, depth=24, num_heads=16, patch_size=14)


@pytest.mark.parametrize(
    "model, timm_name, params",
    [
        ("vit_g14", "vit_giant_patch14_224", 1_012_611_432),
        ("vit_gigantic14", "vit_gigantic_patch14_224", 1_844_440_680),
    ],
)
def test_the_giant_models_are_timms_parameter_for_parameter(compose_cfg, model, timm_name, params):
    """Built on the meta device (no memory): the same state-dict keys and shapes as timm's, and its parameter count."""
    import timm

    from vitlab.model import ViT
    from vitlab.model.config import vit_config

    cfg = compose_cfg("train", [f"model={model}", "trainer=fsdp", "model.num_classes=1000", "model.in_chans=3"])
    with torch.device("meta"):
        ours, theirs = ViT(vit_config(cfg.model)), timm.create_model(timm_name, pretrained=False)
    assert cfg.model.timm_name == timm_name
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in theirs.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == params


def test_from_variant_explicit_overrides_win_and_none_defers():
    cfg = ViTConfig.from_variant("B/16", depth=6, embed_dim=None, img_size=384)
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.patch_size) == (768, 6, 12, 16)
    assert cfg.grid_size == (24, 24) and cfg.num_patches == 576


def test_non_square_and_derived_values():
    cfg = ViTConfig.from_variant("S/16", img_size=[224, 160], reg_tokens=4)
    assert cfg.img_size == (224, 160) and cfg.grid_size == (14, 10)
    assert cfg.num_prefix_tokens == 5 and cfg.num_tokens() == 145


def test_round_trip_as_plain_data():
    cfg = ViTConfig.from_variant("Ti/16", img_size=[224, 160], qk_norm=True, init_values=1e-5)
    d = cfg.to_dict()
    assert d["img_size"] == [224, 160] and "grid_size" not in d
    assert ViTConfig.from_dict(d) == cfg


def test_flops_match_the_hand_count_for_b16():
    # N=197, D=768: 12 * (24 N D^2 + 4 N^2 D) + 2*196*768*768 (patches) + 2*768*1000 (head) is timm's count (17.58
    # GMACs); our forward computes the last block's keys and values for every token and the rest for the class row only.
    n, d = 197, 768
    whole = 12 * (24 * n * d * d + 4 * n * n * d) + 2 * 196 * 16 * 16 * 3 * d + 2 * d * 1000
    assert abs(whole / 2e9 - 17.58) < 0.05  # timm's 17.58 GMACs
    last_rows_saved = 2 * (n - 1) * (d * d + 8 * d * d) + 4 * (n - 1) * n * d
    assert ViTConfig.from_variant("B/16").flops_per_image() == whole - last_rows_saved


def _sdpa_on_cpu(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # torch counts SDPA's GPU kernels; its CPU kernel by the same formula


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"global_pool": "avg"},
        {"global_pool": "avgmax", "pool_include_prefix": True},
        {"global_pool": "map"},
        {"global_pool": ""},
        {"class_token": False, "global_pool": "avg"},
        {"distilled": True},
        {"reg_tokens": 4},
        {"block_fn": "parallel_scaling"},
        {"block_fn": "diff_parallel_scaling"},
        {"block_fn": "parallel_things", "mlp_layer": "swiglu"},
        {"attn_layer": "diff", "mlp_layer": "swiglu_packed"},
        {"img_size": [32, 48]},
        # RoPE (elementwise: no matmul FLOPs of its own) with EVA's attention, LayerScale, SwiGLU, separate q/k/v
        {
            "rope": "dinov3",
            "rope_rotate_half": True,
            "attn_layer": "eva",
            "block_fn": "eva",
            "init_values": 1e-5,
            "reg_tokens": 4,
            "pos_embed": "none",
            "global_pool": "avg",
            "fc_norm": False,
        },
        {
            "rope": "axial",
            "mlp_layer": "swiglu_packed",
            "act_layer": "silu",
            "mlp_hidden_dim": 170,
            "global_pool": "avg",
            "attn_layer": "eva",
            "qkv_fused": False,
        },
        {
            "rope": "mixed",
            "pos_embed": "none",
            "block_fn": "eva",
            "init_values": 1e-5,
            "mlp_layer": "swiglu",
            "scale_mlp_norm": True,
            "mlp_hidden_dim": 96,
        },
    ],  # fmt: skip
)
def test_flops_per_image_is_what_torchs_flop_counter_counts_in_our_forward(kwargs):
    """MFU divides by flops_per_image: it must count the work `ViT.forward` does (the class rows only in the last
    block under a token head), for every pooling and block. Measured: equal to the flop, in every case."""
    cfg = ViTConfig(
        **{"img_size": 32, "patch_size": 8, "num_classes": 7, "embed_dim": 32, "depth": 2, "num_heads": 4} | kwargs
    )
    model = ViT(cfg).eval()
    with FlopCounterMode(
        display=False, custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_on_cpu}
    ) as fc:
        model(torch.randn(3, 3, *cfg.img_hw))
    assert cfg.flops_per_image() == pytest.approx(fc.get_total_flops() / 3, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(img_size=30), "img_size 30 is not divisible by patch_size 16"),
        (dict(img_size=[224, 100]), "is not divisible by patch_size 16"),
        (dict(img_size=[1, 2, 3]), "img_size [1, 2, 3] must be an int or [height, width]"),
        (dict(embed_dim=100, num_heads=3), "embed_dim 100 is not divisible by num_heads 3"),
        (dict(global_pool="gem"), "global_pool 'gem' is not one of"),
        (dict(global_pool="token", class_token=False), "global_pool 'token' needs class_token"),
        (dict(pos_embed="rope"), "pos_embed 'rope' is not one of"),
        (dict(pos_embed="sincos2d", embed_dim=66, num_heads=6), "divisible by 4"),
        (dict(drop_path_rate=1.5), "drop_path_rate 1.5 must be in [0, 1)"),
        (dict(attn_drop_rate=-0.1), "attn_drop_rate -0.1 must be in [0, 1)"),
        (dict(depth=0), "depth 0 must be >= 1"),
        (dict(depth=2.5), "depth 2.5 must be an integer"),
        (dict(qk_norm="yes"), "qk_norm 'yes' must be true or false"),
        (dict(reg_tokens=-1), "reg_tokens -1 must be >= 0"),
        (dict(init_values=0.0), "init_values 0.0 must be > 0"),
        (dict(weight_init="xavier"), "weight_init 'xavier' is not one of"),
        (dict(attn_layer="diff", embed_dim=36, num_heads=4), "differential attention halves each head"),
        (dict(attn_layer="diff", block_fn="parallel_scaling"), "takes attn_layer 'attn'"),
        (dict(patch_size=[8, 0]), "patch_size (8, 0) must be >= 1"),
        (dict(patch_size=[8, 4.5]), "patch_size (8, 4.5) must be an int or [height, width]"),
        (dict(patch_size=[8, 4, 2]), "patch_size [8, 4, 2] must be an int or [height, width]"),
        (dict(patch_size=[8, 6], img_size=32), "img_size 32 is not divisible by patch_size (8, 6)"),
        (dict(fix_init=True, block_fn="parallel_scaling"), "fix_init scales"),
        (dict(pos_embed="sincos1d", embed_dim=33, num_heads=3), "even embed_dim"),
    ],
)
def test_bad_config_fails_at_construction_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        ViTConfig(**kwargs)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"unknown model key\(s\) \['depht'\]"):
        ViTConfig.from_dict({"depht": 3})
    with pytest.raises(ValueError, match="variant 'X/16'"):
        ViTConfig.from_variant("X/16")


def test_as_hw_gives_every_size_one_type():
    assert as_hw(16) == (16, 16) and as_hw([224, 160]) == (224, 160) and as_hw((8, 4)) == (8, 4)
    for bad in ([1, 2, 3], [8, 4.5], "16", True, None, 16.0):
        with pytest.raises(UserError, match=rf"size {re.escape(repr(bad))} must be an int or \[height, width\]"):
            as_hw(bad)
    with pytest.raises(UserError, match=r"patch_size \[8\] must be"):
        as_hw([8], "patch_size")
    cfg = ViTConfig(img_size=[32, 32], patch_size=[8, 8])  # the fields keep their types, the *_hw are pairs
    assert (cfg.img_size, cfg.patch_size, cfg.img_hw, cfg.patch_hw) == ((32, 32), 8, (32, 32), (8, 8))
