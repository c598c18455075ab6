"""Every architecture of timm's `eva` module (EVA, EVA02, rope-vit, Perception Encoder, DINOv3, LingBot, Sapiens2)
through `vitlab.create_model`, held to timm's Eva built by `timm.create_model` with the same arguments (issue 63).

Each name is built at depth 2 and small images (4 patches a side) so that the 60 names stay cheap; names wider than
256 are shrunk to two heads of their own head width (`embed_dim=2 * head_dim, num_heads=2`, and two heads in PE's
attention pool), which keeps each head's RoPE geometry (head width, temperature, grid, reference grid, offset,
indexing). The checks of test_timm_models.py (timm's tests/test_models.py, ported) run on one name of each family.
"""

import copy
import functools

import pytest
import timm
import torch

import vitlab
from tests.model.test_timm_models import (
    CONTRACT,
    FX_NOTE,
    _assert_init_after_to_empty_is_the_hosts,
    _assert_prunes_as_timm,
)
from vitlab.convert.programs import dynamic_shapes
from vitlab.convert.timm_args import timm_model_args
from vitlab.model import ViT
from vitlab.utils.errors import UserError

EVA_NAMES = timm.list_models(module="eva")
# One name of each family and variant of the Eva arguments, for the ported checks
FAMILIES = [
    "eva02_tiny_patch14_224",  # fused qkv with q_bias / v_bias, packed SwiGLU, axial RoPE on a reference grid
    "eva02_base_patch14_224",  # q_proj / k_proj / v_proj, SwiGLU with its sub-LN
    "eva02_base_patch16_clip_224",  # the norm of the attention output, class-token pooling
    "eva02_enormous_patch14_clip_224",  # post-norm blocks
    "eva_giant_patch14_224",  # EVA: no RoPE
    "vit_small_patch16_rope_224",  # rope-vit: axial (xy), AttentionRope's keys
    "vit_small_patch16_rope_mixed_ape_224",  # learned per-head frequencies beside a position table
    "vit_medium_patch16_rope_reg1_gap_256",  # a register, average pooling
    "vit_pe_core_tiny_patch16_384",  # pre-norm, attention pool, grid offset
    "vit_pe_lang_large_patch14_448",  # no final norm, LayerScale
    "vit_small_patch16_dinov3",  # DINOv3's RoPE, storage tokens, any image size
    "vit_small_plus_patch16_dinov3_qkvb",  # SwiGLU of an aligned width, q/v biases
    "vit_base_patch16_sapiens2",  # Sapiens2: RMSNorm, qk_norm, LayerScale on attention only
    "vit_large_patch16_sapiens2",  # grouped-query attention in some blocks
]


@functools.cache
def shrink(name: str) -> dict:
    """Depth 2, 4 patches a side, and at most 256 wide: two heads of the name's own head width (Sapiens2's
    grouped-query attention: one key/value head for the two query heads of the second block)."""
    args = timm_model_args(name)
    patch = args["patch_size"] if isinstance(args["patch_size"], int) else args["patch_size"][0]
    kwargs = dict(depth=2, img_size=4 * patch)
    dim, heads = args.get("embed_dim", 768), args.get("num_heads", 12)
    if dim > 256:
        kwargs.update(embed_dim=2 * (dim // heads), num_heads=2)
        kwargs.update({"attn_pool_num_heads": 2} if args.get("attn_pool_num_heads") else {})
        if kv := args.get("num_kv_heads"):
            kwargs["num_kv_heads"] = (2, 1) if min(kv) < heads else 2
    return kwargs


@functools.cache
def _theirs(name: str, **kwargs) -> torch.nn.Module:  # timm's build, once per name and arguments
    torch.manual_seed(0)
    return timm.create_model(name, **shrink(name), **kwargs).eval()


def both(name: str, **kwargs):
    """(ours, timm's) from the two factories with the same arguments, timm's holding our weights, in eval mode."""
    torch.manual_seed(0)
    ours = vitlab.create_model(name, **shrink(name), **kwargs).eval()
    theirs = copy.deepcopy(_theirs(name, **kwargs))  # (a test may resize or prune it)
    theirs.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    return ours, theirs


def images(model, batch: int = 2, hw=None) -> torch.Tensor:
    return torch.randn(batch, 3, *(hw or model.cfg.img_hw))


def non_square(model) -> tuple[int, int]:
    ph, pw = model.cfg.patch_hw
    return (3 * ph, 5 * pw)


def test_timms_eva_module_has_the_65_names_built_here_and_what_no_name_uses_is_one_line():
    assert len(EVA_NAMES) == 65
    with pytest.raises(UserError, match=r"^timm's vit_small_patch16_dinov3 is not expressible by vitlab's ViT: "
                       r"rope_type='mrope': rope_type 'mrope' \(Qwen2-VL's multimodal RoPE\) and 'base'$"):  # fmt: skip
        vitlab.create_model("vit_small_patch16_dinov3", depth=2, rope_type="mrope")


@pytest.mark.parametrize("name", EVA_NAMES)
def test_logits_are_timms_at_the_native_size(name):
    ours, theirs = both(name)
    x = images(ours)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", EVA_NAMES)
def test_logits_are_timms_at_a_non_square_size_with_dynamic_img_size(name):
    ours, theirs = both(name, dynamic_img_size=True)
    x = images(ours, hw=non_square(ours))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def test_an_argument_eva_does_not_take_is_a_type_error_naming_it():
    for create in (vitlab.create_model, timm.create_model):
        with pytest.raises(TypeError):
            create("vit_small_patch16_dinov3", depth=2, reg_tokens=2)
    with pytest.raises(TypeError, match=r"^timm's vit_small_patch16_dinov3 .* takes no argument reg_tokens=2$"):
        vitlab.create_model("vit_small_patch16_dinov3", depth=2, reg_tokens=2)


# ---- timm's tests/test_models.py checks (test_timm_models.py), on one name of each family -------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_backward_and_checkpointing(name):  # test_model_forward, test_model_backward
    model, _ = both(name, dynamic_img_size=True)
    x = images(model, 1, non_square(model))
    out = model(x)
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)  # training with stochastic depth and patch dropout (the RoPE table follows the kept patches)
    model = vitlab.create_model(name, **shrink(name), num_classes=3, drop_path_rate=0.1, patch_drop_rate=0.25).train()
    model.set_grad_checkpointing()
    model(images(model)).mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", FAMILIES)
def test_default_cfg_head_and_classifier(name):  # test_model_default_cfgs_non_std, reset_classifier
    model, theirs = both(name, num_classes=5)
    assert model.pretrained_cfg == theirs.pretrained_cfg and model.num_features == theirs.num_features
    x = images(model, 1)
    pre = model.forward_head(model.forward_features(x), pre_logits=True)
    assert pre.shape[-1] == model.head_hidden_size
    model.reset_classifier(0)
    torch.testing.assert_close(model(x), pre)
    model.to(torch.float64).reset_classifier(4)
    assert model.head.weight.dtype == torch.float64 and model(x.double()).shape == (1, 4)
    assert model.no_weight_decay() >= {"pos_embed", "cls_token", "reg_token"}


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_intermediates_prune_and_attn_mask_are_timms(name):
    ours, theirs = both(name, dynamic_img_size=True)
    x = images(ours, 2, non_square(ours))
    with torch.no_grad():
        for kwargs in (k for k in CONTRACT if "output_dict" not in k):  # (Eva has no output_dict)
            torch.testing.assert_close(
                ours.forward_intermediates(x, **kwargs), theirs.forward_intermediates(x, **kwargs)
            )
        keep = torch.ones(2, 1, 1, ours.embed(x).shape[1], dtype=torch.bool)
        keep[1, ..., -3:] = False
        torch.testing.assert_close(ours(x, attn_mask=keep), theirs(x, attn_mask=keep), atol=1e-6, rtol=0)
    _assert_prunes_as_timm(ours, theirs, dict(indices=[0]))


@pytest.mark.parametrize("name", FAMILIES)
def test_set_input_size_is_timms(name):
    ours, theirs = both(name)
    ph, pw = ours.cfg.patch_hw
    for model in (ours, theirs):
        model.set_input_size(img_size=(5 * ph, 3 * pw))
    x = images(ours, 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        rebuilt = ViT(ours.cfg).eval()  # the config describes the resized model
        rebuilt.load_state_dict(ours.state_dict())
        torch.testing.assert_close(rebuilt(x), ours(x), atol=0, rtol=0)


@pytest.mark.filterwarnings(FX_NOTE)
@pytest.mark.parametrize("name", FAMILIES)
def test_fx_feature_extraction(name):  # test_model_forward_fx
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    model, _ = both(name, dynamic_img_size=True)
    train_nodes, eval_nodes = get_graph_node_names(model)
    x = images(model, 1, non_square(model))
    with torch.inference_mode():
        fx = create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]])
        assert torch.equal(torch.cat(tuple(fx(x).values())), model(x))


@pytest.mark.parametrize(
    "name", ["eva02_tiny_patch14_224", "vit_small_patch16_rope_mixed_ape_224", "vit_small_patch16_dinov3"]
)  # fmt: skip  (each kind of RoPE)
def test_torch_export_with_a_dynamic_batch_and_size(name):
    model, _ = both(name, dynamic_img_size=True)
    program = torch.export.export(model, (images(model),), dynamic_shapes=dynamic_shapes(model)).module()
    x = images(model, 3, non_square(model))
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_features_only_meta_init_and_weights_files(name, tmp_path):
    """features_only wraps ours as timm wraps its Eva; device='meta' + init_weights is the host's build; weights from
    a file through timm's checkpoint filter (pretrained_cfg_overlay) and checkpoint_path."""
    ours, theirs = both(name, features_only=True, out_indices=(0, -1))
    x = images(ours.model, 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    torch.manual_seed(0)
    host = vitlab.create_model(name, **shrink(name))
    torch.manual_seed(0)
    _assert_init_after_to_empty_is_the_hosts(vitlab.create_model(name, device="meta", **shrink(name)), host)
    torch.save(host.state_dict(), tmp_path / "w.pth")
    overlay = dict(file=str(tmp_path / "w.pth"))
    loaded = vitlab.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **shrink(name))
    torch.testing.assert_close(loaded.state_dict(), host.state_dict(), atol=0, rtol=0)
    after = vitlab.create_model(name, checkpoint_path=str(tmp_path / "w.pth"), **shrink(name))
    torch.testing.assert_close(after.state_dict(), host.state_dict(), atol=0, rtol=0)
