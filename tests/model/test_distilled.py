"""DeiT's distilled ViT (`distilled=true`): the distillation token and second head, held to timm's
VisionTransformerDistilled: the same keys in the same order, the same logits, both heads apart in distilled
training, the head pair reset together."""

import pytest
import timm
import torch

from vitlab.convert.timm_args import config_from_timm, create_timm_model
from vitlab.model import ViT, ViTConfig
from vitlab.utils.errors import UserError


def test_distilled_vit_equals_timms_deit_tiny_distilled():
    """deit_tiny_distilled_patch16_224 at full size, timm's own registered model (random weights), our weights in it."""
    cfg = config_from_timm("deit_tiny_distilled_patch16_224")
    assert cfg.distilled and cfg.num_prefix_tokens == 2
    torch.manual_seed(0)
    ours = ViT(cfg).eval()
    theirs = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False).eval()
    assert list(ours.state_dict()) == list(theirs.state_dict())  # cls_token, pos_embed, dist_token, ..., head_dist
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)  # the two heads' average
        torch.testing.assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                                   theirs.forward_head(theirs.forward_features(x), pre_logits=True),
                                   atol=1e-6, rtol=0)  # fmt: skip
    ours.train().set_distilled_training(True)
    theirs.train().set_distilled_training(True)
    a, b = ours(x), theirs(x)
    assert isinstance(a, tuple) and len(a) == 2
    for mine, timms in zip(a, b, strict=True):
        torch.testing.assert_close(mine, timms, atol=1e-6, rtol=0)


def test_distilled_config_round_trips_through_timm_and_resets_both_heads():
    cfg = ViTConfig(img_size=32, patch_size=8, num_classes=7, embed_dim=32, depth=2, num_heads=4, distilled=True)
    torch.manual_seed(0)
    ours = ViT(cfg)
    theirs = create_timm_model(cfg)
    assert type(theirs).__name__ == "VisionTransformerDistilled"
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ours.eval()(x), theirs.eval()(x), atol=1e-6, rtol=0)
    assert {"dist_token", "pos_embed", "cls_token"} <= ours.no_weight_decay()
    head, head_dist = ours.get_classifier()
    assert head is ours.head and head_dist is ours.head_dist
    ours.reset_classifier(5)
    assert ours.head.out_features == 5 and ours.head_dist.out_features == 5 and ours.cfg.num_classes == 5
    assert ours(x).shape == (3, 5)


@pytest.mark.parametrize("bad", [dict(global_pool="avg"), dict(reg_tokens=4)])
def test_distilled_needs_the_class_token_head(bad):
    with pytest.raises(UserError, match=r"distilled=true reads the class and distillation tokens"):
        ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, distilled=True, **bad)
