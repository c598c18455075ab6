"""pos_embed_resample=dino (issue 54, point 2): a learned position embedding at another grid as DINO's and DINOv2's
own `interpolate_pos_encoding` gives it (tests/reference/: their code, vendored verbatim), through our whole model,
at DINO's 96-px local crops and at 224 px from DINOv2's 518-px grid; timm's rule (the default) differs there, and
their register models (interpolate_offset=0, antialias) are timm's rule."""

from functools import partial

import pytest
import torch

from tests.helpers.references import reference
from vitlab.convert.dino_weights import from_dinov2
from vitlab.convert.timm_args import config_from_timm
from vitlab.model import ViT, ViTConfig

pytestmark = pytest.mark.filterwarnings("ignore:xFormers is not available")  # (DINOv2's layers, on a CPU)


@pytest.fixture(scope="module")
def references():
    """DINO's vision_transformer.py and DINOv2's models/vision_transformer.py, vendored verbatim (tests/reference/)."""
    return reference("dino", "vision_transformer"), reference("dinov2", "dinov2.models.vision_transformer")


def _ours(cfg: ViTConfig, state_dict: dict, rule: str) -> ViT:
    model = ViT(cfg.replace(pos_embed_resample=rule, dynamic_img_size=True)).eval()
    model.load_state_dict(state_dict)
    return model


def _class_token(model: ViT, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_features(x)[:, 0]


@pytest.mark.parametrize("size", [96, 160])
def test_dinos_vit_small_at_another_size_gives_dinos_features(references, size):
    dino_vits, _ = references
    torch.manual_seed(0)
    theirs = dino_vits.VisionTransformer(  # their vit_small, 2 blocks (224 px: a 14 x 14 grid)
        patch_size=16, embed_dim=384, depth=2, num_heads=6, mlp_ratio=4, qkv_bias=True,
        norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
    ).eval()  # fmt: skip
    cfg = ViTConfig.from_variant("S/16", depth=2, num_classes=0, img_size=224)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = theirs(x)  # the class token after the final norm
    dino = _class_token(_ours(cfg, theirs.state_dict(), "dino"), x)
    torch.testing.assert_close(dino, expected, atol=1e-5, rtol=1e-5)
    timm_rule = _class_token(_ours(cfg, theirs.state_dict(), "timm"), x)
    assert (timm_rule - expected).abs().max() > 1e-3  # the rule is what differs


@pytest.mark.parametrize("registers", [0, 4])
def test_dinov2_weights_at_224_give_dinov2s_features(references, registers):
    """DINOv2's hub models are built at 518 px (a 37 x 37 grid) and used at 224: its non-register models with
    interpolate_offset=0.1 and no antialias (pos_embed_resample=dino), its register models with offset 0 and
    antialias (timm's rule)."""
    _, dinov2_vits = references
    torch.manual_seed(0)
    dino_rule = registers == 0
    layers = reference("dinov2", "dinov2.layers")
    theirs = dinov2_vits.DinoVisionTransformer(  # their vit_small (the hub's arguments), 2 blocks
        patch_size=14, img_size=518, embed_dim=384, depth=2, num_heads=6, mlp_ratio=4, init_values=1.0,
        block_fn=partial(layers.NestedTensorBlock, attn_class=layers.MemEffAttention), block_chunks=0,
        num_register_tokens=registers, interpolate_offset=0.1 if dino_rule else 0.0,
        interpolate_antialias=not dino_rule,
    ).eval()  # fmt: skip
    with torch.no_grad():  # random LayerScale and pos_embed: their init leaves them 1 and ~0
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    name = "vit_small_patch14_reg4_dinov2" if registers else "vit_small_patch14_dinov2"
    cfg = config_from_timm(name, depth=2, num_classes=0, img_size=518)  # (timm's layout of their weights)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = theirs.forward_features(x)["x_norm_clstoken"]
    sd = from_dinov2(theirs.state_dict())
    ours = _class_token(_ours(cfg, sd, "dino" if dino_rule else "timm"), x)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    if dino_rule:
        timm_rule = _class_token(_ours(cfg, sd, "timm"), x)
        assert (timm_rule - expected).abs().max() > 1e-3
