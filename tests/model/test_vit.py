import collections

import pytest
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.configs import tiny
from vitlab.convert.timm_args import timm_kwargs
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT, ViTConfig, posemb_sincos_2d
from vitlab.utils.errors import UserError

OPTIONS = {
    "default": {},
    "avg_pool": dict(global_pool="avg"),
    "no_pool": dict(global_pool=""),
    "avg_no_class_token": dict(global_pool="avg", class_token=False),
    "registers": dict(reg_tokens=4),
    "registers_no_embed_class": dict(reg_tokens=2, no_embed_class=True),
    "qk_norm": dict(qk_norm=True),
    "layerscale": dict(init_values=1e-5),
    "no_embed_class": dict(no_embed_class=True),
    "pre_norm": dict(pre_norm=True),
    "fc_norm_token": dict(fc_norm=True),
    "no_fc_norm_avg": dict(global_pool="avg", fc_norm=False),
    "no_qkv_bias": dict(qkv_bias=False),
    "mlp_ratio_3": dict(mlp_ratio=3.0),
    "non_square": dict(img_size=[32, 16]),
    "no_pos_embed": dict(pos_embed="none"),
    "sincos2d": dict(pos_embed="sincos2d"),
    "eps_1e-5": dict(norm_eps=1e-5),
    "no_head": dict(num_classes=0),
    "jax_init": dict(weight_init="jax"),
    "dynamic": dict(dynamic_img_size=True),
    "max_pool": dict(global_pool="max"),
    "avgmax_pool": dict(global_pool="avgmax", class_token=False),
    "no_final_norm": dict(final_norm=False),
    "no_final_norm_avg": dict(final_norm=False, global_pool="avg"),
    "gelu_tanh": dict(act_layer="gelu_tanh"),
    "quick_gelu_clip": dict(act_layer="quick_gelu", pre_norm=True),
    "silu": dict(act_layer="silu"),
    "rmsnorm": dict(norm_layer="rmsnorm", qk_norm=True, pre_norm=True),
    "swiglu": dict(mlp_layer="swiglu", act_layer="silu"),
    "swiglu_packed_dinov2": dict(mlp_layer="swiglu_packed", act_layer="silu", reg_tokens=4, init_values=1e-5),
    "no_proj_bias": dict(proj_bias=False, qkv_bias=False),
    "map_siglip": dict(global_pool="map", class_token=False, act_layer="gelu_tanh"),
    "map_with_class_token": dict(global_pool="map", reg_tokens=1),
    "aimv2_embed_norm": dict(
        embed_norm=True,
        norm_layer="rmsnorm",
        mlp_layer="swiglu",
        act_layer="silu",
        class_token=False,
        global_pool="avg",
        fc_norm=False,
        proj_bias=False,
        qkv_bias=False,
    ),
    "beit3_scale_norms": dict(scale_attn_norm=True, scale_mlp_norm=True, global_pool="avg"),
    "scale_mlp_norm_packed": dict(scale_mlp_norm=True, mlp_layer="swiglu_packed", act_layer="silu"),
    "pool_include_prefix": dict(global_pool="avg", reg_tokens=2, pool_include_prefix=True),
    "map_include_prefix": dict(global_pool="map", pool_include_prefix=True),
    "parallel_xp": dict(
        block_fn="parallel_scaling",
        pre_norm=True,
        no_embed_class=True,
        norm_layer="rmsnorm",
        qkv_bias=False,
        qk_norm=True,
    ),
    "res_post_rpn": dict(block_fn="res_post", class_token=False, global_pool="avg", init_values=1e-5),
    "res_post_fix_init": dict(block_fn="res_post", fix_init=True, qk_norm=True),
    "parallel_things_18x2": dict(block_fn="parallel_things", init_values=1e-5),
    "parallel_things_swiglu_reg": dict(block_fn="parallel_things", mlp_layer="swiglu", act_layer="silu", reg_tokens=2),
    "non_square_patches": dict(patch_size=[8, 4], img_size=[32, 16], pos_embed="sincos2d", dynamic_img_size=True),
    "diff_attention_dwee": dict(
        attn_layer="diff", init_values=1e-5, class_token=False, reg_tokens=1, global_pool="avg"
    ),
    "diff_attention_qk_norm_token": dict(attn_layer="diff", qk_norm=True, depth=3),
    "diff_attention_parallel_things": dict(attn_layer="diff", block_fn="parallel_things"),
    "diff_parallel_scaling_dpwee": dict(
        block_fn="diff_parallel_scaling", init_values=1e-5, class_token=False, reg_tokens=1, global_pool="avg"
    ),
    "diff_parallel_scaling_no_qkv_bias_qk_norm": dict(block_fn="diff_parallel_scaling", qkv_bias=False, qk_norm=True),
    "sincos1d": dict(pos_embed="sincos1d", reg_tokens=1),
    "sincos1d_no_embed_class": dict(pos_embed="sincos1d", no_embed_class=True),
    "patch_drop": dict(patch_drop_rate=0.5, reg_tokens=1),
    "moco_init_fix_init": dict(weight_init="moco", fix_init=True),
    "jax_nlhb_init": dict(weight_init="jax_nlhb"),
    "parallel_qkv_bias_layerscale": dict(block_fn="parallel_scaling", init_values=1e-5, global_pool="avg"),
}


def _pair(cfg: ViTConfig):
    ours = ViT(cfg).eval()
    theirs = VisionTransformer(**timm_kwargs(cfg)).eval()
    theirs.load_state_dict(check_state_dict(ours.state_dict(), cfg))
    return ours, theirs


@pytest.mark.parametrize("name", list(OPTIONS))
def test_logits_and_keys_match_timm(name):
    torch.manual_seed(0)
    cfg = tiny(**OPTIONS[name])
    ours, theirs = _pair(cfg)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert sum(v.numel() for v in ours.state_dict().values()) == sum(v.numel() for v in theirs.state_dict().values())
    x = torch.randn(3, cfg.in_chans, *cfg.img_hw)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_parameter_gets_a_gradient(name):  # as timm's test_model_backward
    cfg = tiny(**OPTIONS[name])
    model = ViT(cfg).train()
    model(torch.randn(2, cfg.in_chans, *cfg.img_hw)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing and all(p.requires_grad for p in model.parameters())


def test_dynamic_img_size_resamples_per_batch_like_timm():
    torch.manual_seed(0)
    ours, theirs = _pair(tiny(dynamic_img_size=True))
    x = torch.randn(2, 3, 48, 24)  # a 6x3 grid instead of 4x4
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


def test_dynamic_img_pad_pads_like_timm_and_without_it_nothing_is_cropped_silently():
    torch.manual_seed(0)
    ours, theirs = _pair(tiny(dynamic_img_size=True, dynamic_img_pad=True))
    x = torch.randn(2, 3, 30, 27)  # patch 8: padded to 32x32, a 4x4 grid
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)
        assert ours.forward_features(x).shape == (2, 1 + 16, 32)
    with pytest.raises(ValueError, match="input size 30x27 is not a multiple of patch_size 8; crop or resize"):
        ViT(tiny(dynamic_img_size=True))(x)


def test_fixed_input_size_is_checked():
    with pytest.raises(ValueError, match=r"input size 48x48 does not match img_size \(32, 32\)"):
        ViT(tiny())(torch.randn(1, 3, 48, 48))


def test_output_shapes():
    x = torch.randn(2, 3, 32, 16)
    assert ViT(tiny(img_size=[32, 16]))(x).shape == (2, 7)
    assert ViT(tiny(img_size=[32, 16], num_classes=0))(x).shape == (2, 32)
    assert ViT(tiny(img_size=[32, 16], global_pool=""))(x).shape == (2, 1 + 8, 7)
    assert ViT(tiny(img_size=[32, 16], reg_tokens=3)).forward_features(x).shape == (2, 1 + 3 + 8, 32)
    assert ViT(tiny()).forward_head(torch.randn(2, 17, 32), pre_logits=True).shape == (2, 32)


def test_sincos2d_is_fixed_and_matches_big_vision_formula():
    cfg = tiny(pos_embed="sincos2d")
    model = ViT(cfg)
    assert "pos_embed" in dict(model.named_buffers()) and "pos_embed" not in dict(model.named_parameters())
    assert "pos_embed" in model.state_dict()  # checkpoints carry it under timm's key
    pe = posemb_sincos_2d((4, 4), 32)[0]
    assert pe.shape == (16, 32)
    # row for patch (y=1, x=2): [sin(2w), cos(2w), sin(1w), cos(1w)], w_k = 10000^(-k/7)
    w = 1.0 / 10000 ** (torch.arange(8) / 7)
    torch.testing.assert_close(pe[1 * 4 + 2], torch.cat([(2 * w).sin(), (2 * w).cos(), w.sin(), w.cos()]))
    torch.testing.assert_close(model.pos_embed[0], pe)


def test_drop_path_schedule_is_linear_and_only_active_in_training():
    torch.manual_seed(0)
    model = ViT(tiny(depth=4, drop_path_rate=0.3))
    rates = [getattr(b.drop_path1, "p", 0.0) for b in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
    x = torch.randn(8, 3, 32, 32)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_attention_maps_are_distributions_that_reproduce_sdpa():
    torch.manual_seed(0)
    model = ViT(tiny(reg_tokens=1)).eval()
    x = torch.randn(2, 3, 32, 32)
    maps = model.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 18, 18)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    # The map times v, projected, is exactly the SDPA path's attention output.
    blk = model.blocks[0]
    h = blk.norm1(model.embed(x))
    _, _, v = blk.attn._qkv(h)
    manual = blk.attn.proj((maps[0] @ v).transpose(1, 2).reshape(2, 18, 32))
    torch.testing.assert_close(manual, blk.attn(h), atol=1e-5, rtol=1e-5)


def test_parallel_blocks_attention_maps_reproduce_their_sdpa():
    torch.manual_seed(0)
    model = ViT(tiny(block_fn="parallel_scaling", qkv_bias=False, qk_norm=True)).eval()
    x = torch.randn(2, 3, 32, 32)
    maps = model.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 17, 17)
    blk, h = model.blocks[0], model.embed(x)
    _, q, k, v = blk._project(h)
    torch.testing.assert_close(
        maps[0] @ v, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=0
    )


def test_intermediates_by_name():
    torch.manual_seed(0)
    model = ViT(tiny(depth=3)).eval()
    x = torch.randn(2, 3, 32, 32)
    out = model.intermediates_by_name(x, [0, -1, "patch_embed", "norm"])
    assert list(out) == ["blocks.0", "blocks.2", "patch_embed", "norm"]
    assert out["patch_embed"].shape == (2, 16, 32)
    torch.testing.assert_close(out["norm"], model.forward_features(x))
    torch.testing.assert_close(out["blocks.2"], model.blocks(model.embed(x)))
    with pytest.raises(ValueError, match="block index 3 out of range for depth 3"):
        model.intermediates_by_name(x, [3])
    with pytest.raises(ValueError, match="unknown layer 'head'"):
        model.intermediates_by_name(x, ["head"])


@pytest.mark.parametrize("mode", [True, 2, 3, "selective"])
def test_gradient_checkpointing_gives_the_same_gradients(mode):
    """Every mode, stochastic depth and dropout on (the recomputation draws the same masks), ≤ 1e-6."""
    torch.manual_seed(0)
    model = ViT(tiny(drop_path_rate=0.2, proj_drop_rate=0.1, depth=4))
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(mode)
    torch.manual_seed(1)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5)


class Ops(TorchDispatchMode):
    """The aten ops run under it, counted by name."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, recomputed", [(False, []), (True, [0, 1, 2, 3]), (2, [1, 3]), (3, [2])])
def test_every_nth_block_is_recomputed(mode, recomputed):
    """grad_checkpointing=N recomputes blocks N-1, 2N-1, ... in the backward pass; the others keep their
    activations (each block's forward calls counted by a hook)."""
    torch.manual_seed(0)
    model = ViT(tiny(depth=4, grad_checkpointing=mode, global_pool="avg", fc_norm=True))
    calls = collections.Counter()
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.update([i]))
    loss = model(torch.randn(2, 3, 32, 32)).sum()
    calls.clear()
    loss.backward()
    assert sorted(calls) == recomputed and all(n == 1 for n in calls.values())


def test_selective_checkpointing_keeps_the_matmuls_and_attention_and_recomputes_the_rest():
    """model.grad_checkpointing=selective (torch's selective checkpoint policy): the backward pass runs again the
    norms and GELUs of every block, and no forward matmul nor attention."""
    counts = {}
    for mode in (False, True, "selective"):
        torch.manual_seed(0)
        model = ViT(tiny(depth=2, grad_checkpointing=mode, global_pool="avg", fc_norm=True))
        loss = model(torch.randn(2, 3, 32, 32)).sum()
        with Ops() as ops:
            loss.backward()
        counts[mode] = ops.count
    sdpa = [k for k in counts[True] if k.startswith("_scaled_dot_product") and not k.endswith("backward")]
    assert counts[True]["addmm"] > 0 and sdpa and counts[True]["gelu"] == 2  # whole blocks again
    assert counts["selective"]["addmm"] == 0 and not any(counts["selective"][k] for k in sdpa)
    assert counts["selective"]["mm"] == counts[False]["mm"]  # the backward's own matmuls only
    assert counts["selective"]["gelu"] == 2 and counts["selective"]["native_layer_norm"] == 4


@pytest.mark.parametrize("mode", [True, "selective"])
def test_compiled_regions_trace_the_checkpoint_and_its_policy_away(monkeypatch, mode):
    """compile=regional compiles each block and its Recompute (the checkpoint around it): the same gradients as no
    checkpointing, and the selective policy, consulted for every op of every step eagerly, is not consulted at all
    once the step is compiled (AOT's trace applied it). The state dict is timm's, Recompute regions or not."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from vitlab.model import vit

    consulted = collections.Counter()

    def policy(ctx, op, *args, **kwargs):
        consulted[op] += 1
        return CheckpointPolicy.MUST_SAVE if op in vit.SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE

    monkeypatch.setattr(vit, "_selective_contexts", lambda: create_selective_checkpoint_contexts(policy))
    torch.manual_seed(0)
    model = ViT(tiny(depth=3, drop_path_rate=0.2, proj_drop_rate=0.1))
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.set_grad_checkpointing(mode)
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager")
        vit.recompute_region(block).compile(backend="aot_eager")
    for _ in range(2):  # the first step traces, the second runs what was compiled
        model.zero_grad()
        consulted.clear()
        torch.manual_seed(1)
        model(x).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5)
    assert not consulted  # the second step: no op went through the policy
    assert list(model.state_dict()) == keys
    if mode == "selective":  # eager, every op of every block, forward and recomputation
        model = ViT(tiny(depth=3, grad_checkpointing="selective"))
        model(x).sum().backward()
        assert sum(consulted.values()) > 50


@pytest.mark.parametrize("bad", [0, -1, "some", 1.5])
def test_a_bad_checkpointing_mode_is_one_line(bad):
    with pytest.raises(UserError, match=r"grad_checkpointing .* must be true, false, N >= 1 \(every N-th block\) or"):
        tiny(grad_checkpointing=bad)


def test_gradient_checkpointing_from_the_config(compose_cfg):
    """model.grad_checkpointing=true: the model recomputes its blocks in the backward pass (the blocks run again,
    counted by a hook), with the same gradients; the state dict is unchanged."""
    from vitlab.model import vit_config

    cfg = vit_config(compose_cfg("train", ["model.grad_checkpointing=true"]).model)
    assert cfg.grad_checkpointing
    torch.manual_seed(0)
    on = ViT(cfg.replace(depth=2))
    off = ViT(cfg.replace(depth=2, grad_checkpointing=False))
    off.load_state_dict(on.state_dict())
    calls = {"on": 0, "off": 0}
    on.blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__("on", calls["on"] + 1))
    off.blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__("off", calls["off"] + 1))
    x = torch.randn(2, cfg.in_chans, *cfg.img_hw)
    for model in (on, off):
        model(x).sum().backward()
    assert (calls["on"], calls["off"]) == (2, 1)  # forward, then again in the backward pass
    for (n, a), b in zip(on.named_parameters(), off.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_class_token_head_computes_only_row_0_of_the_last_block():
    """forward() skips the last block's other rows: same logits and gradients as the full path,
    stochastic depth included (its per-sample draws are the same either way)."""
    torch.manual_seed(0)
    model = ViT(tiny(drop_path_rate=0.2, reg_tokens=2)).train()
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(1)
    fast = model(x)
    fast.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(1)
    full = model.forward_head(model.forward_features(x))
    full.square().sum().backward()
    torch.testing.assert_close(fast, full, atol=1e-6, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)
    assert model.forward_features(x, last_rows=1).shape == (4, 1, 32)
    assert model.forward_features(x).shape == (4, 1 + 2 + 16, 32)


def test_weight_init_schemes():
    torch.manual_seed(0)
    timm_init = ViT(tiny(embed_dim=64, num_heads=4))
    w = timm_init.blocks[0].mlp.fc1.weight
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert timm_init.cls_token.abs().max() < 1e-4
    jax = ViT(tiny(embed_dim=64, num_heads=4, weight_init="jax"))
    assert torch.count_nonzero(jax.head.weight) == 0 and torch.count_nonzero(jax.head.bias) == 0
    fc1 = jax.blocks[0].mlp.fc1.weight  # Xavier-uniform bound sqrt(6 / (64 + 256))
    assert fc1.abs().max() <= (6 / (64 + 256)) ** 0.5 and fc1.abs().max() > 0.9 * (6 / 320) ** 0.5
    conv = jax.patch_embed.proj.weight  # LeCun normal: std 1/sqrt(fan_in)
    assert abs(conv.std().item() - (1 / (3 * 8 * 8)) ** 0.5) < 0.01


def test_pos_embed_resampled_on_load_like_timm():
    """A 224-px checkpoint loaded into a 384-px model: the same pos_embed timm's own loader makes."""
    torch.manual_seed(0)
    small = dict(embed_dim=32, depth=1, num_heads=2, patch_size=16, num_classes=5)
    at224 = ViT(ViTConfig(img_size=224, **small))
    at384 = ViT(ViTConfig(img_size=384, **small))
    at384.load_state_dict(at224.state_dict())
    timm384 = VisionTransformer(**timm_kwargs(at384.cfg))
    expected = checkpoint_filter_fn(dict(at224.state_dict()), timm384)["pos_embed"]
    assert at384.pos_embed.shape == (1, 1 + 24 * 24, 32)
    torch.testing.assert_close(at384.pos_embed.detach(), expected, atol=1e-6, rtol=0)


def test_compiles_without_graph_breaks():
    torch.manual_seed(0)
    model = ViT(tiny()).eval()
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_timms_model_api_and_layer_decay_groups():  # timm's test_models: classifier, features, optimizer groups
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    cfg = tiny(depth=3)
    ours, theirs = _pair(cfg)
    assert (ours.num_classes, ours.num_features, ours.head_hidden_size) == (7, 32, 32)
    assert ours.feature_info == theirs.feature_info
    assert ours.get_classifier() is ours.head

    def scales(model):  # each parameter's layer-decay scale, by name
        names = {id(p): n for n, p in model.named_parameters()}
        opt = create_optimizer_v2(model, "adamw", lr=1e-3, layer_decay=0.75)
        return {names[id(p)]: g["lr_scale"] for g in opt.param_groups for p in g["params"]}

    assert scales(ours) == scales(theirs) and len(set(scales(ours).values())) == cfg.depth + 2
    x = torch.randn(2, 3, 32, 32)
    ours.reset_classifier(3)
    assert ours(x).shape == (2, 3) and ours.cfg.num_classes == 3
    ours.reset_classifier(0, global_pool="avg")
    assert ours(x).shape == (2, 32) and ours.get_classifier().__class__ is torch.nn.Identity
    assert list(ViT(ours.cfg).state_dict()) == list(ours.state_dict())  # the config still builds this model
    with pytest.raises(ValueError, match="cannot add an attention pool"):
        ours.reset_classifier(3, global_pool="map")


def test_sincos1d_is_vaswanis_table_over_every_token_recomputed_at_any_size():
    import numpy as np

    def t2t(n, d):  # T2T-ViT's get_sinusoid_encoding, in float64
        table = np.array([[p / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for p in range(n)])
        table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
        return torch.tensor(table, dtype=torch.float32)[None]

    cfg = tiny(pos_embed="sincos1d", reg_tokens=2, dynamic_img_size=True)
    model = ViT(cfg)
    assert "pos_embed" in dict(model.named_buffers()) and "pos_embed" not in dict(model.named_parameters())
    torch.testing.assert_close(model.pos_embed, t2t(3 + 16, 32), atol=1e-5, rtol=0)
    # at 48 x 32 px the table has 3 + 6 * 4 rows, recomputed (not resampled as a 2-D grid)
    x = torch.randn(1, 3, 48, 32)
    tokens = model.patch_embed(x).flatten(1, 2)
    prefix = torch.cat([model.cls_token, model.reg_token], dim=1)
    expected = torch.cat([prefix, tokens], dim=1) + t2t(3 + 24, 32)
    torch.testing.assert_close(model.embed(x), expected, atol=1e-5, rtol=0)
    bigger = ViT(cfg.replace(img_size=64))  # a checkpoint of another size loads with this size's own table
    bigger.load_state_dict(model.state_dict())
    torch.testing.assert_close(bigger.pos_embed, t2t(3 + 64, 32), atol=1e-5, rtol=0)


def test_weight_init_modes_as_timm():
    torch.manual_seed(0)
    base = ViT(tiny(embed_dim=64, num_heads=4))
    torch.manual_seed(0)
    fixed = ViT(tiny(embed_dim=64, num_heads=4, fix_init=True))
    # the same draws, scaled by 1/sqrt(2 (i + 1))
    for i, (a, b) in enumerate(zip(base.blocks, fixed.blocks, strict=True)):
        torch.testing.assert_close(b.attn.proj.weight, a.attn.proj.weight / (2.0 * (i + 1)) ** 0.5)
        torch.testing.assert_close(b.mlp.fc2.weight, a.mlp.fc2.weight / (2.0 * (i + 1)) ** 0.5)
        torch.testing.assert_close(b.attn.qkv.weight, a.attn.qkv.weight)
    nlhb = ViT(tiny(weight_init="jax_nlhb"))
    torch.testing.assert_close(nlhb.head.bias, torch.full((7,), -torch.log(torch.tensor(7.0)).item()))
    assert torch.count_nonzero(nlhb.head.weight) == 0
    moco = ViT(tiny(embed_dim=64, num_heads=4, weight_init="moco"))
    qkv_bound = (6 / (64 + 64)) ** 0.5  # q, k and v counted separately: fan 64 + 64, not 192 + 64
    assert qkv_bound * 0.9 < moco.blocks[0].attn.qkv.weight.abs().max() <= qkv_bound
    assert moco.blocks[0].mlp.fc1.weight.abs().max() <= (6 / (64 + 256)) ** 0.5
    skip = ViT(tiny(embed_dim=64, num_heads=4, weight_init="skip"))  # PyTorch's own: kaiming-uniform Linears
    assert torch.count_nonzero(skip.cls_token) == 0 and torch.count_nonzero(skip.pos_embed) == 0
    w = skip.blocks[0].mlp.fc1.weight
    assert w.abs().max() <= 64**-0.5 and w.abs().max() > 0.9 * 64**-0.5


def test_patch_dropout_keeps_a_random_subset_of_patches_in_training_only():
    torch.manual_seed(0)
    model = ViT(tiny(patch_drop_rate=0.5, reg_tokens=2))
    x = torch.randn(3, 3, 32, 32)
    tokens = model.train().embed(x)
    assert tokens.shape == (3, 3 + 8, 32)  # prefix + int(16 * 0.5)
    eval_tokens = model.eval().embed(x)
    assert eval_tokens.shape == (3, 3 + 16, 32)
    torch.testing.assert_close(tokens[:, :3], eval_tokens[:, :3])  # prefix kept, in place
    kept = (tokens[:, 3:, None] == eval_tokens[:, None, 3:]).all(-1)  # each kept token is one of the originals
    assert (kept.sum(-1) == 1).all() and (kept.sum(1) <= 1).all()
    assert model.train()(x).shape == (3, 7)


def test_non_square_checkpoint_loads_at_another_size_like_timm():
    """Weights of a 32 x 24 px model (a 4 x 3 grid) load at 64 x 48: the grid is read with the model's
    aspect ratio and resampled as timm's resample_abs_pos_embed with the old size given."""
    torch.manual_seed(0)
    small = ViT(tiny(img_size=[32, 24]))
    big = ViT(tiny(img_size=[64, 48]))
    big.load_state_dict(small.state_dict())
    expected = resample_abs_pos_embed(small.pos_embed.detach(), [8, 6], [4, 3], num_prefix_tokens=1)
    torch.testing.assert_close(big.pos_embed.detach(), expected, atol=0, rtol=0)
