"""NaFlex (issue 65, point 1): every architecture of timm's naflexvit module through vitlab.create_model, held to
timm's NaFlexVit on an image tensor and on NaFlex's dict with one image of the batch padded; the position-table
modes (grid_sample, factorized, aspect-preserving) and masking checked on their own."""

import pytest
import timm
import torch
from timm.data.naflex_transforms import patchify_image

import vitlab
from vitlab.convert.timm_args import config_from_timm
from vitlab.model import ViT, ViTConfig
from vitlab.model.naflex_config import pos_grid
from vitlab.utils.errors import UserError

SMALL = dict(depth=2, embed_dim=32, num_heads=2, num_classes=5)
P = 16


def naflex_batch(images, n: int) -> dict:
    """timm's patchify_image per image, padded to n patches (the loader's layout)."""
    patches, coord = torch.zeros(len(images), n, P * P * 3), torch.zeros(len(images), n, 2, dtype=torch.long)
    valid = torch.zeros(len(images), n, dtype=torch.bool)
    for i, img in enumerate(images):
        p, c, _ = patchify_image(img, (P, P))
        patches[i, : len(p)], coord[i, : len(p)], valid[i, : len(p)] = p, c, True
    return dict(patches=patches, patch_coord=coord, patch_valid=valid)


def pair(name: str, **overrides):
    torch.manual_seed(0)
    theirs = timm.create_model(name, **SMALL, **overrides).eval()
    state = theirs.state_dict()
    for key, value in state.items():  # non-trivial tokens and tables: the position rules must matter
        value.normal_(0, 0.5 if "pos_embed" in key else 0.05)
    theirs.load_state_dict(state)
    ours = vitlab.create_model(name, **SMALL, **overrides).eval()
    ours.load_state_dict(state, strict=True)  # timm's keys as they are
    return ours, theirs


# one image of 3x5 patches and one of 2x3, padded to 15 (its last nine patches invalid)
IMAGES = [torch.randn(3, 48, 80, generator=torch.Generator().manual_seed(1)),
          torch.randn(3, 32, 48, generator=torch.Generator().manual_seed(2))]  # fmt: skip


@pytest.mark.parametrize("name", timm.list_models(module="naflexvit"))
def test_every_naflexvit_matches_timm_on_images_and_on_padded_naflex_batches(name):
    ours, theirs = pair(name)
    assert isinstance(ours, ViT) and ours.cfg.naflex
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        batch = naflex_batch(IMAGES, 15)
        torch.testing.assert_close(ours(batch), theirs(batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(pos_embed_use_grid_sample=True),
        dict(pos_embed="factorized", pos_embed_use_grid_sample=True),
        dict(pos_embed="factorized", pos_embed_ar_preserving=False),
        dict(pos_embed_use_grid_sample=True, pos_embed_align_corners=True, pos_embed_ar_preserving=True),
        dict(pos_embed="none", patch_drop_rate=0.0, global_pool="max"),
        dict(global_pool="avgmax", pool_include_prefix=True),
    ],
    ids=["grid_sample", "factorized_grid_sample", "factorized", "grid_sample_corners_ar", "no_pos_max", "avgmax"],
)
def test_position_modes_and_pools_match_timm(overrides):
    ours, theirs = pair("naflexvit_base_patch16_par_gap", **overrides)
    with torch.no_grad():
        batch = naflex_batch(IMAGES, 15)
        torch.testing.assert_close(ours(batch), theirs(batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_map",
                                  "naflexvit_base_patch16_radio_v3"])  # fmt: skip
def test_padding_changes_nothing_of_an_image(name):
    """The padded image's logits are its logits alone: attention and pooling see its valid patches only."""
    ours, _ = pair(name)
    with torch.no_grad():
        padded = ours(naflex_batch(IMAGES, 15))[1]
        alone = ours(naflex_batch(IMAGES[1:], 6))[0]
        as_image = ours(IMAGES[1][None])[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone, as_image, atol=1e-5, rtol=0)


def test_forward_features_and_head_take_the_dict_as_timm():
    ours, theirs = pair("naflexvit_base_patch16_gap")
    batch = naflex_batch(IMAGES, 15)
    with torch.no_grad():
        feats = ours.forward_features(batch)
        assert set(feats) == {"patches", "patch_valid"}
        torch.testing.assert_close(feats["patches"], theirs.forward_features(**_kw(batch))["patches"])
        pooled = theirs.forward_head(**theirs.forward_features(**_kw(batch)), pre_logits=True)
        torch.testing.assert_close(ours.forward_head(feats, pre_logits=True), pooled)


def _kw(batch):
    return dict(patches=batch["patches"], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])


def test_config_reads_timm_naflex_arguments_and_refuses_what_it_cannot_express():
    cfg = config_from_timm("naflexvit_base_patch16_parfac_gap")
    assert (cfg.naflex, cfg.pos_embed, cfg.pos_embed_ar_preserving, cfg.reg_tokens) == (True, "factorized", True, 4)
    assert pos_grid(cfg) == (16, 16) and cfg.img_hw == (256, 256)
    assert config_from_timm("naflexvit_base_patch16_gap", rope_type="axial").rope == "axial"  # (issue 74 point 2)
    with pytest.raises(UserError, match="rope_type='mrope'"):
        config_from_timm("naflexvit_base_patch16_gap", rope_type="mrope", rope_mrope_section=(2, 3, 3))
    with pytest.raises(UserError, match="pos_embed 'factorized' is NaFlex's"):
        ViTConfig(pos_embed="factorized")
    with pytest.raises(ValueError, match="naflex=true"):
        ViT(ViTConfig(img_size=32, patch_size=16, depth=1, embed_dim=32, num_heads=2))(naflex_batch(IMAGES, 15))


def test_patch_dropout_keeps_validity_aligned():
    ours, _ = pair("naflexvit_base_patch16_gap", patch_drop_rate=0.5)
    ours.train()
    feats = ours.forward_features(naflex_batch(IMAGES, 15))
    assert feats["patches"].shape[1] == 4 + 7 and feats["patch_valid"].shape == (2, 7)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="axial"),
        dict(rope_type="axial", pos_embed="none", rope_grid_indexing="xy", rope_ref_feat_shape=(4, 4)),
        dict(rope_type="mixed", pos_embed="none"),
        dict(rope_type="mixed", rope_temperature=10.0),
        dict(rope_type="dinov3", rope_rotate_half=True, pos_embed="none"),
        dict(rope_type="dinov3", rope_grid_offset=0.5),
    ],
    ids=["axial", "axial_xy_ref_no_table", "mixed_no_table", "mixed", "dinov3_half_no_table", "dinov3"],
)
def test_naflex_with_rope_is_timms_on_images_and_naflex_batches(rope):
    """timm's NaFlexVit with rope_type (issue 74 point 2), with and without the learned table: the same RoPE at each
    image's grid, held to timm's logits on an image tensor and on a padded NaFlex batch of two grids."""
    ours, theirs = pair("naflexvit_base_patch16_gap", **rope)
    assert ours.rope is not None and ours.cfg.block_fn == "eva"
    state = theirs.state_dict()
    for value in state.values():  # attention far from uniform (at pair()'s 0.05 the RoPE hardly moves the logits)
        value.normal_(0, 0.3)
    theirs.load_state_dict(state), ours.load_state_dict(state)
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        batch = naflex_batch(IMAGES, 16)
        torch.testing.assert_close(ours(batch), theirs(batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope", ["axial", "mixed", "dinov3"])
def test_rope_on_a_naflex_config_turns_the_logits(rope):
    """model=naflexvit_b16 model.rope=...: the RoPE is applied, on images and on NaFlex batches (it was built and
    ignored: the logits equalled rope none's), and patch dropout keeps each kept patch's rows in training."""
    cfg = ViTConfig(naflex=True, img_size=32, patch_size=P, class_token=False, reg_tokens=2, global_pool="avg",
                    init_values=1.0, patch_drop_rate=0.25, **SMALL)  # fmt: skip
    plain, rotated = ViT(cfg).eval(), ViT(cfg.replace(rope=rope)).eval()
    state = plain.state_dict()
    for value in state.values():  # attention far from uniform, so that positions matter
        value.normal_(0, 0.3)
    rotated.load_state_dict(state, strict=False)  # the same weights; mixed's rope.freqs its own
    plain.load_state_dict(state)
    batch, x = naflex_batch(IMAGES, 16), torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        assert (rotated(x) - plain(x)).abs().max() > 1e-3
        assert (rotated(batch) - plain(batch)).abs().max() > 1e-3
    rotated.train()
    rotated(batch).sum().backward()  # patch dropout with the table's rows kept alongside
