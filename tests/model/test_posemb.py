"""model/posemb.py: position-embedding and patch-filter resampling, against timm's; MAE's fixed table against MAE's
code."""

import pytest
import torch
from timm.layers import resample_abs_pos_embed
from timm.layers import resample_patch_embed as timm_resample_patch_embed

from tests.helpers.references import mae_get_2d_sincos_pos_embed
from vitlab.model.posemb import (
    grid_like,
    posemb_sincos_2d,
    posemb_sincos_2d_mae,
    resample_patch_embed,
    resample_pos_embed,
)


def test_resample_pos_embed_matches_timm_non_square_and_prefix():
    torch.manual_seed(0)
    pe = torch.randn(1, 3 + 6 * 4, 16)
    ours = resample_pos_embed(pe, (9, 5), (6, 4), num_prefix_tokens=3)
    theirs = resample_abs_pos_embed(pe, [9, 5], [6, 4], num_prefix_tokens=3)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    with pytest.raises(ValueError, match="7 patch rows, no grid near the aspect ratio of"):
        resample_pos_embed(torch.randn(1, 1 + 7, 16), (4, 4), None, 1)


def test_grid_like_reads_a_saved_grid_with_the_models_aspect_ratio():
    assert grid_like(196, (24, 24)) == (14, 14) and grid_like(192, (24, 32)) == (12, 16)
    assert grid_like(192, (32, 24)) == (16, 12) and grid_like(256, (24, 32)) == (16, 16)


def test_resample_patch_embed_is_flexivits():
    torch.manual_seed(0)
    w = torch.randn(8, 3, 16, 16)
    for size in [(14, 14), (8, 8), (24, 24)]:
        torch.testing.assert_close(
            resample_patch_embed(w, size), timm_resample_patch_embed(w, list(size)), atol=1e-4, rtol=1e-4
        )
    # the pseudo-inverse keeps each token: <x, w> == <resize(x), w'> for patches upsampled from 8 to 16 px
    x = torch.randn(5, 3, 8, 8)
    up = torch.nn.functional.interpolate(x, size=(16, 16), mode="bicubic", antialias=True)
    w8 = torch.randn(4, 3, 8, 8)
    w16 = resample_patch_embed(w8, (16, 16))
    torch.testing.assert_close(
        torch.einsum("bchw,dchw->bd", up, w16), torch.einsum("bchw,dchw->bd", x, w8), atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize("dim, grid", [(768, 14), (512, 14), (1024, 16), (1280, 16), (32, 4)])
def test_sincos2d_mae_is_maes_table_at_every_position(dim, grid):
    """MAE's encoder and decoder tables (ViT-B 768 and its decoder 512 at 14x14, L, H), as models_mae.py copies them:
    torch.from_numpy(...).float(). Every value equal; big_vision's frequencies (over D/4 - 1) differ."""
    mae = torch.from_numpy(mae_get_2d_sincos_pos_embed(dim, grid)).float()[None]
    ours = posemb_sincos_2d_mae((grid, grid), dim, prefix=1)
    assert ours.dtype == torch.float32 and torch.equal(ours, mae)
    big_vision = (posemb_sincos_2d((grid, grid), dim) - mae[:, 1:]).abs().max().item()
    assert big_vision > 0.01  # 0.025 at D=768, 0.11 at D=32 (4x4)
