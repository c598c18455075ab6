"""MAE's pieces (vitlab.model.mae): the masking keeps exactly int(N * (1 - ratio)) patches of each image (MAE's
random_masking) and can put them back, the loss is the direct formula on the masked patches only (with and without
per-patch pixel normalisation), patchify is MAE's pixel order, the decoder's names are MAE's; with
pos_embed=sincos2d_mae and weight_init=mae the encoder is built as MAE builds it (fixed tables, parameter count,
initialisation)."""

import pytest
import torch

from vitlab.model import ViT, ViTConfig
from vitlab.model.mae import (
    MAEConfig,
    MAEDecoder,
    encode_visible,
    mae_forward,
    patchify,
    random_masking,
    unpatchify,
)
from vitlab.utils.errors import UserError


def _vit(**kw) -> ViT:
    base = dict(img_size=8, patch_size=2, in_chans=3, num_classes=0, embed_dim=16, depth=2, num_heads=2)
    return ViT(ViTConfig(**(base | kw))).eval()


@pytest.mark.parametrize("ratio,n", [(0.75, 16), (0.75, 196), (0.9, 196), (0.5, 9), (0.9, 49), (0.6, 10)])
def test_masking_keeps_int_n_times_one_minus_ratio_patches_of_each_image(ratio, n):
    keep = MAEConfig(mask_ratio=ratio, decoder_embed_dim=8, decoder_num_heads=2).kept(n)
    assert keep == int(n * (1 - ratio))  # models_mae.py random_masking: len_keep = int(L * (1 - mask_ratio))
    assert (ratio, n, keep) != (0.9, 196, 20)  # round() would keep 20 of 196 at 0.9; MAE keeps 19
    torch.manual_seed(0)
    kept, restore = random_masking(5, n, keep)
    assert kept.shape == (5, keep) and all(len(set(row.tolist())) == keep for row in kept)
    assert len({tuple(row.tolist()) for row in kept}) == 5  # each image its own draw
    # as the decoder does: the kept tokens, then mask tokens (-1), put back in image order by `restore`
    placed = torch.cat([kept, torch.full((5, n - keep), -1)], dim=1).gather(1, restore)
    for b in range(5):
        assert torch.equal(placed[b, kept[b]], kept[b])  # every kept patch lands on its own place
    assert ((placed == -1).sum(1) == n - keep).all()


def test_the_encoder_sees_the_kept_patches_and_the_mask_marks_the_rest():
    vit = _vit()
    x = torch.randn(3, 3, 8, 8)
    torch.manual_seed(1)
    latent, mask, restore = encode_visible(vit, x, keep=4)
    assert latent.shape == (3, 1 + 4, 16) and mask.shape == (3, 16)
    assert mask.sum(1).tolist() == [12.0] * 3
    torch.manual_seed(1)
    kept, _ = random_masking(3, 16, 4)
    for b in range(3):
        assert mask[b, kept[b]].sum() == 0  # the kept patches are the unmasked ones


def _direct_loss(pred, images, mask, p, norm_pix):
    """The loss patch by patch, with the pixels cut out of the image by hand."""
    b, c, h, w = images.shape
    total, count = 0.0, 0
    for i in range(b):
        for r in range(h // p):
            for s in range(w // p):
                k = r * (w // p) + s
                if mask[i, k] == 0:
                    continue
                target = images[i, :, r * p : (r + 1) * p, s * p : (s + 1) * p].permute(1, 2, 0).reshape(-1)
                if norm_pix:
                    target = (target - target.mean()) / (target.var(unbiased=True) + 1e-6) ** 0.5
                total += ((pred[i, k] - target) ** 2).mean().item()
                count += 1
    return total / count


@pytest.mark.parametrize("norm_pix", [False, True])
def test_the_loss_is_the_direct_formula_on_the_masked_patches_only(norm_pix):
    vit = _vit()
    cfg = MAEConfig(mask_ratio=0.75, norm_pix_loss=norm_pix, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)
    decoder = MAEDecoder(vit.cfg, cfg).eval()
    images = torch.randn(2, 3, 8, 8)
    torch.manual_seed(3)
    loss, pred, mask = mae_forward(vit, decoder, images, cfg)
    assert loss.item() == pytest.approx(_direct_loss(pred, images, mask, 2, norm_pix), rel=1e-5)
    # the visible patches' predictions do not count
    from vitlab.model.mae import masked_mse, pixel_target

    changed = pred + 100.0 * (1 - mask).unsqueeze(-1)
    assert masked_mse(changed, pixel_target(images, (2, 2), norm_pix), mask).item() == pytest.approx(loss.item())


def test_patchify_is_maes_pixel_order_and_unpatchify_inverts_it():
    images = torch.randn(2, 3, 8, 12)
    p = patchify(images, (4, 4))
    assert p.shape == (2, 6, 48)
    # patch (row 1, column 2), pixel (y 3, x 0), channel 2: MAE's 'nhwpqc' order
    assert p[1, 1 * 3 + 2, (3 * 4 + 0) * 3 + 2] == images[1, 2, 4 + 3, 8 + 0]
    assert torch.equal(unpatchify(p, (4, 4), (2, 3), 3), images)


def test_the_decoder_has_maes_parameter_names():
    names = set(
        MAEDecoder(_vit().cfg, MAEConfig(decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)).state_dict()
    )
    assert {"mask_token", "decoder_embed.weight", "decoder_norm.weight", "decoder_pred.weight"} <= names
    assert "decoder_blocks.0.attn.qkv.weight" in names and "decoder_pos_embed" not in names  # fixed: not saved


@pytest.mark.parametrize(
    "values,message",
    [
        ({"mask_ratio": 1.0}, r"objective.mask_ratio 1.0 must be in \(0, 1\)"),
        ({"decoder_embed_dim": 10, "decoder_num_heads": 4}, "objective.decoder_embed_dim 10 is not divisible"),
        ({"decoder_depht": 2}, r"unknown objective=mae key\(s\) \['decoder_depht'\]; allowed: \['decoder_depth'"),
    ],
)
def test_bad_settings_are_one_line(values, message):
    with pytest.raises(UserError, match=message):
        MAEConfig.from_dict(values)


def test_maes_vit_b_encoder_and_decoder_have_its_parameter_count_and_fixed_tables():
    """mae_vit_base_patch16_dec512d8b: 111,655,680 trainable parameters (MAE's two position tables are parameters
    with requires_grad=False; here buffers), its tables MAE's sin-cos (zero class row) for encoder and decoder."""
    from vitlab.model.posemb import posemb_sincos_2d_mae

    cfg = ViTConfig.from_variant("B/16", num_classes=0, pos_embed="sincos2d_mae", weight_init="mae")
    with torch.device("meta"):
        vit, decoder = ViT(cfg), MAEDecoder(cfg, MAEConfig())
    assert sum(p.numel() for m in (vit, decoder) for p in m.parameters()) == 111_655_680
    assert sum(p.numel() for p in vit.parameters()) == 85_798_656 - 197 * 768  # timm's B/16 encoder less pos_embed
    small = _vit(pos_embed="sincos2d_mae")
    decoder = MAEDecoder(small.cfg, MAEConfig(decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2))
    assert "pos_embed" in dict(small.named_buffers()) and "pos_embed" in small.state_dict()
    assert torch.equal(small.pos_embed, posemb_sincos_2d_mae((4, 4), 16, prefix=1))  # (1, 1 + 16, 16), row 0 zero
    assert torch.equal(decoder.decoder_pos_embed, posemb_sincos_2d_mae((4, 4), 8, prefix=1))


def test_maes_initialisation():
    """models_mae.py initialize_weights: Xavier-uniform Linears (qkv as one (3D, D) matrix: std sqrt(2 / 4D)),
    the patch projection Xavier on its flattened (D, C*P*P) weight, zero biases, cls and mask tokens N(0, 0.02)."""
    torch.manual_seed(0)
    cfg = ViTConfig.from_variant("B/16", depth=1, num_classes=0, pos_embed="sincos2d_mae", weight_init="mae")
    vit, decoder = ViT(cfg), MAEDecoder(cfg, MAEConfig(decoder_depth=1))
    blk = vit.blocks[0]
    stds = {
        "qkv": (blk.attn.qkv.weight, (2 / (768 + 3 * 768)) ** 0.5),  # 0.02552
        "fc1": (blk.mlp.fc1.weight, (2 / (768 + 3072)) ** 0.5),
        "patch projection": (vit.patch_embed.proj.weight, (2 / (768 + 3 * 16 * 16)) ** 0.5),  # 0.03608
        "decoder qkv": (decoder.decoder_blocks[0].attn.qkv.weight, (2 / (512 + 3 * 512)) ** 0.5),
    }
    for name, (w, std) in stds.items():
        assert w.std().item() == pytest.approx(std, rel=0.01), name
        assert w.abs().max().item() <= std * 3**0.5 + 1e-7, name  # uniform: bound sqrt(3) std
    for name, tok in (("cls_token", vit.cls_token), ("mask_token", decoder.mask_token)):
        assert tok.std().item() == pytest.approx(0.02, rel=0.1), name  # 768 and 512 draws
    assert torch.count_nonzero(blk.attn.qkv.bias) == 0 and torch.equal(blk.norm1.weight, torch.ones(768))
    head = ViT(cfg.replace(num_classes=10)).head  # main_finetune.py: trunc_normal_(head.weight, std=2e-5)
    assert head.weight.std().item() == pytest.approx(2e-5, rel=0.1) and torch.count_nonzero(head.bias) == 0


class _KeepThese(torch.nn.Module):
    """timm's PatchDropoutWithIndices keeping the given patches (its prefix tokens kept, as timm keeps them)."""

    def __init__(self, kept: torch.Tensor, prefix: int):
        super().__init__()
        self.kept, self.prefix = kept, prefix

    def forward(self, x):
        patches = x[:, self.prefix :].gather(1, self.kept.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.cat([x[:, : self.prefix], patches], dim=1), self.kept


@pytest.mark.parametrize(
    "name", ["vit_small_patch16_dinov3", "eva02_tiny_patch14_224", "vit_base_patch16_rope_mixed_224"]
)
def test_the_encoder_rotates_the_kept_patches_by_their_own_grid_positions_as_timms_eva(name):
    """MAE's masking with RoPE: each kept patch rotated by the row and column it came from (the RoPE table's rows of
    the kept patches), as timm's Eva rotates the patches its patch dropout keeps (apply_keep_indices_nlc); also the
    decoder builds (plain blocks whatever the encoder's) and the whole forward runs at another grid
    (dynamic_img_size)."""
    from vitlab.convert.timm_args import config_from_timm, create_timm_model
    from vitlab.convert.weights import check_state_dict

    small = dict(depth=2, embed_dim=32, num_heads=2, img_size=32, patch_size=8, num_classes=0)
    cfg = config_from_timm(name, **small)
    vit = ViT(cfg).eval()
    with torch.no_grad():  # LayerScale's 1e-5 would hide the attention (and where its keys sit) under the tolerance
        [p.fill_(0.5) for n, p in vit.named_parameters() if "gamma" in n]
    theirs = create_timm_model(cfg).eval()
    theirs.load_state_dict(check_state_dict(vit.state_dict(), cfg))
    x, keep = torch.randn(3, 3, 32, 32), 5
    torch.manual_seed(1)
    kept, _ = random_masking(3, 16, keep)
    theirs.patch_drop = _KeepThese(kept, cfg.num_prefix_tokens)
    torch.manual_seed(1)
    with torch.no_grad():
        latent, mask, _ = encode_visible(vit, x, keep)
        expected = theirs.forward_features(x)
    torch.testing.assert_close(latent, expected, rtol=0, atol=1e-5)
    assert mask.sum(1).tolist() == [16 - keep] * 3 and not torch.equal(kept, torch.arange(keep).expand(3, -1))
    decoder = MAEDecoder(cfg, MAEConfig(decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2))
    grid = (48 // 8, 32 // 8)
    loss, pred, _ = mae_forward(
        ViT(cfg.replace(dynamic_img_size=True)), decoder, torch.randn(2, 3, 48, 32), MAEConfig()
    )
    assert pred.shape == (2, grid[0] * grid[1], 8 * 8 * 3) and loss.isfinite()


def test_maes_flops_are_what_torchs_flop_counter_counts_with_a_swiglu_rope_encoder():
    """MFU divides by model/mae.py's flops_per_image: the encoder's blocks as block_flops counts them (EVA02's packed
    SwiGLU here, not a GELU MLP of mlp_ratio), the decoder's plain ones (prefix rows of its prediction left out)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.model.test_config import _sdpa_on_cpu, aten
    from vitlab.model.mae import flops_per_image

    enc = ViTConfig(img_size=32, patch_size=4, num_classes=0, embed_dim=32, depth=2, num_heads=2, rope="axial",
                    mlp_layer="swiglu_packed", act_layer="silu", mlp_hidden_dim=170, attn_layer="eva", block_fn="eva",
                    init_values=1e-5, global_pool="avg")  # fmt: skip
    cfg = MAEConfig(decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2)
    vit, decoder = ViT(enc).eval(), MAEDecoder(enc, cfg)
    sdpa = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_on_cpu}
    with FlopCounterMode(display=False, custom_mapping=sdpa) as fc, torch.no_grad():
        mae_forward(vit, decoder, torch.randn(2, 3, 32, 32), cfg)
    prefix_rows = 2 * 16 * 4 * 4 * 3  # the decoder predicts the class token's pixels too, then drops them
    assert flops_per_image(enc, cfg) + prefix_rows == pytest.approx(fc.get_total_flops() / 2, rel=1e-6)
