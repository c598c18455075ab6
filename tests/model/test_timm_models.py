"""timm's own model checks (pytorch-image-models tests/test_models.py), ported to our ViT.

Each test names the timm test it ports. timm runs them over its registered names; here they run over a
set of configurations that between them use every component table of model/, and where timm's
model can run the same call, ours is held to its output (same weights, both in eval mode).
"""

import math

import pytest
import torch
from timm.models import FeatureInfo
from timm.models.vision_transformer import VisionTransformer
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from tests.helpers.configs import tiny
from vitlab.convert.programs import dynamic_shapes
from vitlab.convert.timm_args import timm_kwargs
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT
from vitlab.utils.errors import UserError

CONFIGS = {
    "class_token": {},
    "registers_avg": dict(reg_tokens=2, global_pool="avg"),
    "map_no_class_token": dict(global_pool="map", class_token=False, act_layer="gelu_tanh"),
    "parallel_scaling": dict(block_fn="parallel_scaling", qk_norm=True, init_values=1e-5),
    "res_post_avg": dict(block_fn="res_post", class_token=False, global_pool="avg", init_values=1e-5),
    "parallel_things": dict(block_fn="parallel_things", init_values=1e-5, reg_tokens=1),
    "diff_attention": dict(attn_layer="diff", init_values=1e-5, reg_tokens=1, qk_norm=True),
    "diff_parallel_scaling": dict(block_fn="diff_parallel_scaling", qkv_bias=False, init_values=1e-5),
    "swiglu_rmsnorm": dict(mlp_layer="swiglu", act_layer="silu", norm_layer="rmsnorm", no_embed_class=True),
    "sincos2d_dynamic": dict(pos_embed="sincos2d", dynamic_img_size=True, reg_tokens=1),
    "sincos1d_dynamic_pad": dict(pos_embed="sincos1d", dynamic_img_size=True, dynamic_img_pad=True),
    "sincos2d_mae_init": dict(pos_embed="sincos2d_mae", weight_init="mae", reg_tokens=1),
    "learn_dynamic_non_square": dict(img_size=[32, 24], dynamic_img_size=True, global_pool="avg"),
    "non_square_patches_pad": dict(patch_size=[8, 4], dynamic_img_size=True, dynamic_img_pad=True),
}
PARAMS = list(CONFIGS)


def pair(name: str, **overrides):
    torch.manual_seed(0)
    cfg = tiny(**{**CONFIGS[name], **overrides})
    ours = ViT(cfg).eval()
    theirs = VisionTransformer(**timm_kwargs(cfg)).eval()
    theirs.load_state_dict(check_state_dict(ours.state_dict(), cfg))
    return ours, theirs


def images(model: ViT, batch: int = 2, hw=None) -> torch.Tensor:
    return torch.randn(batch, model.cfg.in_chans, *(hw or model.cfg.img_hw))


def other_size(model: ViT) -> tuple[int, int]:
    return (40, 24) if model.cfg.dynamic_img_size else model.cfg.img_hw


@pytest.mark.parametrize("name", PARAMS)
def test_model_forward(name):  # test_model_forward: default and other sizes; grad checkpointing changes nothing
    model, _ = pair(name)
    for hw in {model.cfg.img_hw, other_size(model)}:
        x = images(model, 1, hw)
        out = model(x)
        assert out.shape == (1, model.num_classes) and not out.isnan().any()
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
        model.set_grad_checkpointing(False)


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("num_classes", [42, 0])
def test_model_backward(name, num_classes):  # test_model_backward: every parameter gets a gradient
    torch.manual_seed(0)
    model = ViT(tiny(**CONFIGS[name], num_classes=num_classes, drop_path_rate=0.1, patch_drop_rate=0.25)).train()
    out = model(images(model, 2, other_size(model)))
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    num_params = sum(p.numel() for p in model.parameters())
    assert sum(p.grad.numel() for p in model.parameters()) == num_params
    assert out.shape[-1] == (num_classes or model.num_features) and not out.isnan().any()


@pytest.mark.parametrize("name", PARAMS)
def test_model_default_cfgs_non_std(name):  # test_model_default_cfgs_non_std
    model, _ = pair(name)
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    cfg = model.pretrained_cfg
    assert model.default_cfg is cfg and cfg["input_size"] == (3, *model.cfg.img_hw)
    assert cfg["fixed_input_size"] is not model.cfg.dynamic_img_size
    x = torch.randn(1, *cfg["input_size"])
    feats = model.forward_features(x)
    pre = model.forward_head(feats, pre_logits=True)
    assert feats.shape[-1] == model.num_features and pre.shape[1] == model.head_hidden_size
    model.reset_classifier(0)
    assert model.num_classes == 0
    out = model(x)
    assert out.shape == pre.shape and out.shape[-1] == model.head_hidden_size
    torch.testing.assert_close(out, pre)
    headless = ViT(tiny(**CONFIGS[name], num_classes=0)).eval()
    assert headless(x).shape[-1] == headless.num_features
    state = ViT(model.cfg.replace(num_classes=5)).state_dict()
    assert cfg["classifier"] + ".weight" in state and cfg["first_conv"] + ".weight" in state


@pytest.mark.parametrize("name", PARAMS)
def test_model_forward_intermediates(name):  # test_model_forward_intermediates
    model, _ = pair(name)
    info = FeatureInfo(model.feature_info, len(model.feature_info))
    channels, reductions = info.channels(), info.reduction()
    assert len(channels) == model.cfg.depth >= 2  # timm asks >= 3 levels of its full-depth models
    hw = other_size(model)
    x = images(model, 1, hw)
    output, intermediates = model.forward_intermediates(x, output_fmt="NCHW")
    assert len(intermediates) == len(channels)
    (ph, pw) = model.cfg.patch_hw  # timm's reduction is the larger side of a patch: bound each axis by its own
    for c, r, o in zip(channels, reductions, intermediates, strict=True):
        assert o.shape[0] == 1 and o.shape[1] == c and not o.isnan().any() and r == max(ph, pw)
        assert o.shape[2] <= math.ceil(hw[0] / ph) + 1 and o.shape[3] <= math.ceil(hw[1] / pw) + 1
    torch.testing.assert_close(output, model.forward_features(x), atol=0, rtol=0)
    model.set_grad_checkpointing()
    output3, _ = model.forward_intermediates(x, output_fmt="NCHW")
    torch.testing.assert_close(output, output3, rtol=1e-4, atol=1e-5)


CONTRACT = [
    dict(),
    dict(indices=1),
    dict(indices=[0, -1], norm=True),
    dict(indices=[-2], output_fmt="NLC", return_prefix_tokens=True),
    dict(indices=1, intermediates_only=True, stop_early=True),
    dict(indices=[0], stop_early=True),
    dict(output_dict=True, return_prefix_tokens=True),
    dict(output_dict=True, intermediates_only=True, norm=True),
]


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("kwargs", CONTRACT, ids=lambda k: ",".join(k) or "defaults")
def test_forward_intermediates_is_timms(name, kwargs):  # timm's contract, call by call
    ours, theirs = pair(name, depth=3)
    # timm has no fixed tables: it would resample the sin-cos values we recompute at another size
    x = images(ours, 2, ours.cfg.img_hw if ours.cfg.pos_embed.startswith("sincos") else other_size(ours))
    with torch.no_grad():
        mine, reference = ours.forward_intermediates(x, **kwargs), theirs.forward_intermediates(x, **kwargs)
    torch.testing.assert_close(mine, reference, atol=1e-6, rtol=0)


def test_forward_intermediates_checkpointing_lowers_saved_activations():
    """With gradient checkpointing, forward_intermediates keeps each block's input, not its activations."""

    def saved_bytes(model: ViT, x: torch.Tensor) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            final, feats = model.forward_intermediates(x, indices=[1, 3])
        (final.sum() + sum(f.sum() for f in feats)).backward()
        return total

    torch.manual_seed(0)
    model = ViT(tiny(depth=4, embed_dim=64, img_size=64)).train()
    x = torch.randn(4, 3, 64, 64)
    plain = saved_bytes(model, x)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_grad_checkpointing()
    checkpointed = saved_bytes(model, x)
    assert checkpointed < plain / 4, (checkpointed, plain)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, g in grads.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=1e-6, rtol=1e-5)


FX_NOTE = "ignore:NOTE. The nodes obtained by tracing the model in eval mode:UserWarning"  # dropout, drop path


@pytest.mark.filterwarnings(FX_NOTE)
@pytest.mark.parametrize("name", PARAMS)
def test_model_forward_fx(name):  # test_model_forward_fx: torchvision's FX feature extractor
    model, _ = pair(name)
    train_nodes, eval_nodes = get_graph_node_names(model)
    x = images(model, 1, other_size(model))
    with torch.inference_mode():
        outputs = model(x)
        fx_model = create_feature_extractor(
            model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]]
        )
        fx_outputs = torch.cat(tuple(fx_model(x).values()))
    assert torch.equal(fx_outputs, outputs)
    blocks = create_feature_extractor(model, return_nodes={"blocks.1": "last_block"})
    assert blocks(x)["last_block"].shape[-1] == model.num_features


@pytest.mark.filterwarnings(FX_NOTE)
@pytest.mark.parametrize("name", PARAMS)
def test_model_backward_fx(name):  # test_model_backward_fx
    torch.manual_seed(0)
    model = ViT(tiny(**CONFIGS[name], num_classes=42, drop_path_rate=0.1, patch_drop_rate=0.25)).train()
    train_nodes, eval_nodes = get_graph_node_names(model)
    fx_model = create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]])
    outputs = torch.cat(tuple(fx_model(images(model, 2)).values()))
    outputs.mean().backward()
    assert [n for n, p in fx_model.named_parameters() if p.grad is None] == []
    assert outputs.shape[-1] == 42 and not outputs.isnan().any()


@pytest.mark.parametrize("name", PARAMS)
def test_torch_export_dynamic_batch_and_size(name):
    """torch.export with a dynamic batch, and dynamic height and width (multiples of the patch; any size
    with dynamic_img_pad) when the model takes any size: one program for every shape."""
    model, _ = pair(name)
    program = torch.export.export(model, (images(model),), dynamic_shapes=dynamic_shapes(model)).module()
    sizes = [model.cfg.img_hw] + ([(48, 16), (16, 64)] if model.cfg.dynamic_img_size else [])
    sizes += [(37, 21)] if model.cfg.dynamic_img_pad else []
    for batch, hw in zip([3, 1, 5, 2][: len(sizes)], sizes, strict=True):
        x = images(model, batch, hw)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", PARAMS)
def test_set_input_size_is_timms(name):
    ours, theirs = pair(name)
    for img_size, patch_size in [((48, 40), None), (None, 4), (24, 6)]:
        ours.set_input_size(img_size=img_size, patch_size=patch_size)
        theirs.set_input_size(img_size=img_size, patch_size=patch_size)
        mine, reference = ours.state_dict(), theirs.state_dict()
        if ours.cfg.pos_embed.startswith("sincos"):  # timm's is a learned table: it resamples the old values
            del mine["pos_embed"], reference["pos_embed"]
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)
        assert ours.pretrained_cfg["input_size"] == (3, *ours.cfg.img_hw)
        assert ours.cfg.img_hw == theirs.patch_embed.img_size and ours.cfg.patch_hw == theirs.patch_embed.patch_size
        rebuilt = ViT(ours.cfg).eval()  # the config describes the resized model
        rebuilt.load_state_dict(ours.state_dict())
        x = images(ours)
        with torch.no_grad():
            torch.testing.assert_close(rebuilt(x), ours(x), atol=0, rtol=0)
            if not ours.cfg.pos_embed.startswith("sincos"):
                torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def _assert_prunes_as_timm(ours, theirs, kwargs):
    assert ours.prune_intermediate_layers(**kwargs) == theirs.prune_intermediate_layers(**kwargs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = images(ours)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.forward_intermediates(x), theirs.forward_intermediates(x), atol=1e-6, rtol=0)
    assert list(ViT(ours.cfg).state_dict()) == list(ours.state_dict())  # the config follows


def _assert_init_after_to_empty_is_the_hosts(model, host):
    """A model laid out on meta, materialised with garbage (NaN; -1 in integer buffers), then init_weights(): the host
    build's values."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else -1)
    model.init_weights()
    torch.testing.assert_close(model.state_dict(), host.state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("name", PARAMS)
def test_prune_intermediate_layers_is_timms(name):
    for kwargs in [dict(indices=[1]), dict(indices=2, prune_norm=True)]:
        ours, theirs = pair(name, depth=4)
        _assert_prunes_as_timm(ours, theirs, kwargs)


@pytest.mark.parametrize("name", PARAMS)
def test_attn_mask_is_timms(name):
    """forward(x, attn_mask): SDPA's mask in every block, as timm's (a key-padding mask here)."""
    ours, theirs = pair(name)
    x = images(ours)
    n = ours.embed(x).shape[1]
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[1, ..., -3:] = False  # the second image ignores its last three tokens
    with torch.no_grad():
        torch.testing.assert_close(ours(x, attn_mask=keep), theirs(x, attn_mask=keep), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours(x, attn_mask=keep)[0], ours(x)[0], atol=1e-6, rtol=0)
        assert not torch.equal(ours(x, attn_mask=keep)[1], ours(x)[1])


# ---- timm's factory and model contracts (issue 40): vitlab.create_model beside timm.create_model ------------------
# Registered names of the kinds our ViT expresses, shrunk (depth 2, small images) so both factories build them fast:
# a tag without weights, registers with LayerScale, registers with avg pooling, parallel blocks, distilled, CLIP's
# pre-norm and QuickGELU, an attention pool, and a non-square image.
TIMM_NAMES = {
    "test_vit4.r160_in1k": dict(img_size=64),
    "vit_small_patch14_reg4_dinov2": dict(img_size=56),
    "vit_wee_patch16_reg1_gap_256": dict(img_size=64),
    "vit_pwee_patch16_reg1_gap_256": dict(img_size=64),
    "deit_tiny_distilled_patch16_224": dict(img_size=64),
    "vit_xsmall_patch16_clip_224": dict(img_size=64),
    "vit_base_patch16_siglip_224": dict(img_size=64, embed_dim=64, num_heads=4),
    "test_vit": dict(img_size=(64, 48)),
}


def both(name: str, **kwargs):
    """(ours, timm's) from the two factories with the same arguments, timm's holding our weights, in eval mode."""
    import timm

    import vitlab

    kwargs = dict(TIMM_NAMES[name], depth=2, **kwargs)
    torch.manual_seed(0)
    ours = vitlab.create_model(name, **kwargs).eval()
    theirs = timm.create_model(name, **kwargs).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_create_model_is_timms(name):
    """The same call gives our ViT with timm's keys, logits, pretrained_cfg, in_chans (None-valued keywords dropped)."""
    ours, theirs = both(name, num_classes=5, drop_rate=None, in_chans=1)
    assert isinstance(ours, ViT) and list(ours.state_dict()) == list(theirs.state_dict())
    assert ours.pretrained_cfg == theirs.pretrained_cfg and ours.default_cfg is ours.pretrained_cfg
    assert ours.in_chans == theirs.in_chans == 1  # the pretrained_cfg describes the weights' input (3 channels)
    assert ours.num_classes == theirs.num_classes == 5 and ours.num_features == theirs.num_features
    x = torch.randn(2, ours.in_chans, *ours.cfg.img_hw)  # the pretrained_cfg's size is the registered weights'

    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_create_model_features_only_is_timms(name):
    """features_only / out_indices / feature_cls wrap our ViT as timm wraps its own (distilled DeiT included)."""
    for kwargs in (dict(out_indices=(0, -1)), dict(out_indices=1, feature_cls="getter")):
        ours, theirs = both(name, features_only=True, **kwargs)
        assert isinstance(ours.model, ViT) and ours.feature_info.channels() == theirs.feature_info.channels()
        x = torch.randn(1, 3, *ours.model.cfg.img_hw)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_create_model_on_meta_then_init_weights(name):
    """create_model(device='meta') allocates nothing; to_empty + init_weights() sets every tensor, to the values a
    host build draws from the same seed (timm's test fills NaN, so does this one)."""
    import vitlab

    kwargs = dict(TIMM_NAMES[name], depth=2)
    torch.manual_seed(0)
    host = vitlab.create_model(name, **kwargs)
    torch.manual_seed(0)
    model = vitlab.create_model(name, device="meta", **kwargs)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    _assert_init_after_to_empty_is_the_hosts(model, host)


@pytest.mark.parametrize("name", ["vit_wee_patch16_reg1_gap_256", "deit_tiny_distilled_patch16_224"])
def test_create_model_dtype_and_weights_from_files(name, tmp_path):
    """dtype; pretrained weights from a file (pretrained_cfg_overlay) through timm's checkpoint filter, a new head for
    another class count; checkpoint_path loaded after; a keyword no ViT takes is a TypeError, as timm's."""
    import timm
    from safetensors.torch import save_file

    import vitlab

    kwargs = dict(TIMM_NAMES[name], depth=2)
    model = vitlab.create_model(name, dtype=torch.float64, **kwargs)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    source = vitlab.create_model(name, **kwargs).state_dict()
    save_file(source, str(tmp_path / "w.safetensors"))
    loaded = vitlab.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "w.safetensors")), **kwargs
    )
    torch.testing.assert_close(loaded.state_dict(), source, atol=0, rtol=0)
    fresh = vitlab.create_model(
        name,
        pretrained=True,
        num_classes=3,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "w.safetensors")),
        **kwargs,
    )
    assert fresh.num_classes == 3 and torch.equal(fresh.blocks[1].mlp.fc2.weight, source["blocks.1.mlp.fc2.weight"])
    torch.save(source, tmp_path / "w.pth")
    after = vitlab.create_model(name, checkpoint_path=str(tmp_path / "w.pth"), **kwargs)
    torch.testing.assert_close(after.state_dict(), source, atol=0, rtol=0)
    for create in (vitlab.create_model, timm.create_model):
        with pytest.raises(TypeError):
            create(name, bogus_argument=1, **kwargs)


@pytest.mark.parametrize("name", PARAMS)
def test_init_weights_after_to_empty_is_construction(name):
    """Every parameter and buffer (fixed sin-cos tables, LayerScale, lambdas, biases of our own) is set by
    init_weights after to_empty, to the constructor's values for the same seed."""
    cfg = tiny(**CONFIGS[name])
    torch.manual_seed(0)
    host = ViT(cfg)
    torch.manual_seed(0)
    model = ViT(cfg, device="meta")
    _assert_init_after_to_empty_is_the_hosts(model, host)


@pytest.mark.parametrize("name", PARAMS)
def test_reset_classifier_keeps_device_and_dtype(name):  # timm's _assert_reset_classifier_preserves_parent_...
    model, _ = pair(name)
    model.to(torch.float64)
    model.reset_classifier(5)
    assert model.head.weight.dtype == torch.float64 and model(images(model).double()).dtype == torch.float64


@pytest.mark.parametrize("distilled", [False, True])
def test_reset_classifier_keeps_the_models_mode(distilled):  # timm's _assert_reset_classifier_preserves_parent_...
    """The new heads (a distilled DeiT's two) are in the model's mode: eval stays eval (issue 53)."""
    for training in (False, True):
        model = ViT(tiny(distilled=distilled, depth=2)).train(training)
        model.reset_classifier(2)
        heads = [model.head, *([model.head_dist] if distilled else [])]
        assert [h.training for h in heads] == [training] * len(heads)


def test_catavgmax_is_refused_with_timms_assertion():  # timm's test_catavgmax_unsupported
    """timm's VisionTransformer asserts its pooling: an unknown one is an AssertionError at construction and in
    reset_classifier, here as there (and a one-line UserError)."""
    import vitlab

    with pytest.raises(AssertionError) as raised:
        vitlab.create_model("vit_tiny_patch16_224", global_pool="catavgmax")
    assert isinstance(raised.value, UserError)
    model = vitlab.create_model("vit_tiny_patch16_224")
    with pytest.raises(AssertionError):
        model.reset_classifier(7, "catavgmax")


def distilled_pair(**overrides):
    from timm.models.deit import VisionTransformerDistilled

    torch.manual_seed(0)
    cfg = tiny(distilled=True, depth=4, **overrides)
    ours = ViT(cfg).eval()
    theirs = VisionTransformerDistilled(**timm_kwargs(cfg)).eval()
    theirs.load_state_dict(check_state_dict(ours.state_dict(), cfg))
    return ours, theirs


def test_distilled_deit_prunes_and_resets_as_timms():
    """prune_intermediate_layers (features_only's) calls reset_classifier(0, ''): a distilled model takes it."""
    for kwargs in [dict(indices=[1]), dict(indices=2, prune_norm=True)]:
        ours, theirs = distilled_pair()
        _assert_prunes_as_timm(ours, theirs, kwargs)


@pytest.mark.parametrize(
    "overrides, pool",
    [
        ({}, "catavgmax"),
        ({}, "map"),
        (dict(class_token=False, global_pool="avg"), "token"),
        (dict(distilled=True), "avg"),
    ],
)
def test_refusals_are_timms_exception_classes(overrides, pool):
    """What timm refuses with an assertion (its test_head_hidden_size catches AssertionError and moves on) is an
    AssertionError here too, and a one-line UserError."""
    from timm.models.deit import VisionTransformerDistilled

    cfg = tiny(**overrides)
    theirs = (VisionTransformerDistilled if cfg.distilled else VisionTransformer)(**timm_kwargs(cfg))
    with pytest.raises(AssertionError):
        theirs.reset_classifier(0, pool)
    with pytest.raises(AssertionError) as raised:
        ViT(cfg).reset_classifier(0, pool)
    assert isinstance(raised.value, UserError) and "\n" not in str(raised.value)


def test_an_attention_pool_once_removed_is_not_added_back_as_timm():
    model, theirs = pair("map_no_class_token")
    for m in (model, theirs):
        m.reset_classifier(0, "avg")
        with pytest.raises(AssertionError):
            m.reset_classifier(0, "map")


def test_torchscript_fails_in_one_line_naming_torch_export():
    model, _ = pair("class_token")
    with pytest.raises(UserError, match=r"not TorchScript-scriptable .* torch\.export .* ONNX"):
        torch.jit.script(model)
