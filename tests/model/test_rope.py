"""RoPE in our ViT (model/rope.py, issue 63 point 1): each table equals the one timm's module computes
(timm.layers.pos_embed_sincos: RotaryEmbeddingCat, RotaryEmbeddingMixed, RotaryEmbeddingDinoV3) for options no
registered name uses together, DINOv3's training-time augmentations draw as timm's and only in training, a model of
our own RoPE config equals timm's Eva of the same arguments, and a RoPE option that contradicts the rest is one line
naming the value."""

import pytest
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed
from timm.models.eva import Eva

from tests.helpers.configs import tiny
from vitlab.convert.timm_eva import eva_kwargs
from vitlab.model import ViT, ViTConfig
from vitlab.model.rope import Rope, keep_rows
from vitlab.model.vit import rope_spec
from vitlab.utils.errors import UserError

AUGMENT = dict(rope_shift_coords=0.5, rope_jitter_coords=1.5, rope_rescale_coords=2.0)
TIMM_AUGMENT = dict(shift_coords=0.5, jitter_coords=1.5, rescale_coords=2.0)
HEAD = 8  # tiny(): embed_dim 32, 4 heads


def ours(**rope) -> Rope:
    cfg = tiny(dynamic_img_size=True, **rope)
    return Rope(
        rope_spec(cfg), depth=cfg.depth, num_heads=cfg.num_heads, grid_size=cfg.grid_size, dynamic_img_size=True
    )


def table(rope: Rope, hw, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return rope(torch.zeros(1, *hw, 32))


CASES = {
    "axial_reference_grid_offset_xy_half": (
        dict(rope="axial", rope_temperature=100.0, rope_ref_feat_shape=(3, 5), rope_grid_offset=1.0,
             rope_grid_indexing="xy", rope_rotate_half=True),
        lambda: RotaryEmbeddingCat(HEAD, temperature=100.0, in_pixels=False, ref_feat_shape=[3, 5], grid_offset=1.0,
                                   grid_indexing="xy", rotate_half=True),
    ),
    "dinov3_periods_min_offset": (
        dict(rope="dinov3", rope_period_range=(0.5, 50.0), rope_normalize_coords="min", rope_grid_offset=0.25),
        lambda: RotaryEmbeddingDinoV3(HEAD, min_period=0.5, max_period=50.0, normalize_coords="min", grid_offset=0.25,
                                      rotate_half=False),
    ),
    "dinov3_temperature_max_xy_augmented": (
        dict(rope="dinov3", rope_temperature=100.0, rope_normalize_coords="max", rope_grid_indexing="xy",
             rope_rotate_half=True, **AUGMENT),
        lambda: RotaryEmbeddingDinoV3(HEAD, temperature=100.0, normalize_coords="max", grid_indexing="xy",
                                      rotate_half=True, **TIMM_AUGMENT),
    ),
    "axial_augmented": (
        dict(rope="axial", **AUGMENT),
        lambda: RotaryEmbeddingCat(HEAD, in_pixels=False, **TIMM_AUGMENT),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_tables_are_timms_and_augmented_in_training_only(case):
    cfg, make_theirs = CASES[case]
    mine, theirs = ours(**cfg), make_theirs()
    for hw in [(3, 5), (6, 2)]:
        for training in (False, True):
            mine.train(training), theirs.train(training)
            torch.manual_seed(1)
            reference = theirs.get_embed(list(hw))
            assert torch.equal(table(mine, hw, seed=1), reference)
        augments = any(k in cfg for k in AUGMENT)
        assert torch.equal(table(mine.eval(), hw), table(mine.train(), hw, seed=2)) is not augments


def test_mixed_tables_are_timms_from_the_same_frequencies():
    mine = ours(rope="mixed", rope_temperature=10.0, **AUGMENT)
    theirs = RotaryEmbeddingMixed(32, depth=2, num_heads=4, temperature=10.0, grid_indexing="ij", **TIMM_AUGMENT)
    mine.reset_parameters()
    assert mine.freqs.shape == theirs.freqs.shape == (2, 2, 4, HEAD // 2)
    with torch.no_grad():
        theirs.freqs.copy_(mine.freqs)
    for training in (False, True):
        mine.train(training), theirs.train(training)
        torch.manual_seed(3)
        reference = theirs.get_embed([4, 3])
        assert torch.equal(table(mine, (4, 3), seed=3), reference)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope="axial", rope_rotate_half=True, rope_ref_feat_shape=(2, 6), attn_layer="eva", qkv_fused=False),
        dict(rope="mixed", pos_embed="learn", no_embed_class=True, reg_tokens=2, global_pool="avg"),
        dict(rope="dinov3", rope_grid_offset=0.5, reg_tokens=1, init_values=1e-5, qkv_bias=False),
    ],
    ids=["axial", "mixed", "dinov3"],
)
def test_a_rope_config_of_our_own_is_timms_eva(rope):
    """Our configs (not registered names) against timm's Eva of `eva_kwargs`: logits at the config's size, and with
    dynamic_img_size at another, the class and register tokens left unrotated in both."""
    for dynamic, hw in ((False, (32, 32)), (True, (24, 40))):
        cfg = tiny(block_fn="eva", weight_init="eva", fix_init=True, pos_embed="none", dynamic_img_size=dynamic)
        cfg = cfg.replace(**rope, pool_include_prefix=False)
        torch.manual_seed(0)
        model = ViT(cfg).eval()
        theirs = Eva(**eva_kwargs(cfg)).eval()
        theirs.load_state_dict(model.state_dict())
        x = torch.randn(2, 3, *hw)
        with torch.no_grad():
            torch.testing.assert_close(model(x), theirs(x), atol=1e-5, rtol=0)
            torch.testing.assert_close(model.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)


def test_kept_rows_follow_patch_dropout():
    rope = ours(rope="axial")
    full = table(rope, (4, 4))  # (16, 2*Dh)
    keep = torch.tensor([[3, 0, 7], [15, 2, 9]])
    kept = keep_rows(full, keep)
    assert kept.shape == (2, 1, 3, 2 * HEAD) and torch.equal(kept[1, 0, 0], full[15])
    mixed = ours(rope="mixed")
    mixed.reset_parameters()
    per_block = table(mixed, (4, 4))  # (depth, H, 16, 2*Dh)
    assert torch.equal(keep_rows(per_block, keep)[1, 0, 3, 2], per_block[1, 3, 7])  # block 1, image 0, head 3


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(rope="axial", rope_ref_feat_shape=[0, 14]), r"rope_ref_feat_shape \(0, 14\)"),  # not a grid
        (
            dict(rope="dinov3", rope_ref_feat_shape=16),
            r"16 .* needs rope 'axial' \(got rope 'dinov3'\)",
        ),  # not its grid
        (dict(rope="axial", rope_ref_feat_shape=[16]), r"rope_ref_feat_shape \(16,\) must be a grid"),  # issue 74, 11
        (dict(rope="mixed", embed_dim=36, num_heads=6), r"embed_dim / num_heads 6 .* divisible by 4"),
        (dict(rope="axial", pos_embed="sincos1d"), r"rope with pos_embed 'sincos1d'"),
        (dict(rope="mixed", rope_rotate_half=True), r"rope 'mixed' .* rope_rotate_half must be false"),
        (dict(rope="axial", block_fn="parallel_scaling"), r"not 'attn' in 'parallel_scaling'"),
        (dict(rope="rotary"), r"rope 'rotary' is not one of \['', 'axial', 'mixed', 'dinov3'\]"),
        (dict(rope="dinov3", rope_jitter_coords=0.5), r"rope_jitter_coords 0.5 must be a finite number >= 1"),
        (dict(rope="axial", rope_period_range=[1.0, 10.0]), r"rope_period_range \(1.0, 10.0\) .* with rope 'dinov3'"),
        (dict(rope="dinov3", rope_grid_indexing="yx"), r"rope_grid_indexing 'yx' is not one of \['ij', 'xy'\]"),
        (dict(qkv_bias_separate=True), r"qkv_bias_separate adds attn_layer 'eva''s"),
    ],
)
def test_a_rope_option_that_contradicts_the_rest_is_one_line_naming_it(fields, named):
    with pytest.raises(UserError, match=named) as e:
        ViTConfig(**{**dict(embed_dim=64, num_heads=4, img_size=32, patch_size=8), **fields})
    assert "\n" not in str(e.value)


def test_rope_fields_round_trip_as_plain_data():
    cfg = tiny(rope="axial", rope_ref_feat_shape=[4, 6], block_fn="eva", attn_layer="eva", init_values=1e-5)
    assert cfg.rope_ref_feat_shape == (4, 6) and ViTConfig.from_dict(cfg.to_dict()) == cfg
    assert ViT(cfg).no_weight_decay() == {"pos_embed", "cls_token", "reg_token", "dist_token"}
    assert "rope.freqs" in ViT(tiny(rope="mixed")).no_weight_decay()


def test_evas_init_draws_as_timms_eva():
    """weight_init 'eva' (timm's Eva.init_weights): Linears trunc-normal 0.02, class and register tokens trunc-normal
    0.02 (not timm ViT's 1e-6), the head scaled by 0.001, fix_init's depth scaling of the output projections."""
    cfg = tiny(embed_dim=64, depth=4, num_classes=1000, reg_tokens=4, block_fn="eva", attn_layer="eva", init_values=0.1,
               weight_init="eva", fix_init=True, rope="dinov3", pos_embed="none")  # fmt: skip
    torch.manual_seed(0)
    model = ViT(cfg)
    torch.manual_seed(0)
    theirs = Eva(**eva_kwargs(cfg))
    for name in ("head.weight", "cls_token", "reg_token", "blocks.0.attn.qkv.weight", "blocks.3.attn.proj.weight"):
        ours_std, their_std = model.get_parameter(name).std().item(), theirs.get_parameter(name).std().item()
        assert abs(ours_std / their_std - 1) < 0.2, (name, ours_std, their_std)
    assert model.head.weight.std() < 1e-4 and torch.equal(model.blocks[0].gamma_1, theirs.blocks[0].gamma_1)


def test_mixed_initial_frequencies_are_timms_draw_and_magnitudes():
    """RoPE-Mixed's initial frequencies (issue 74 point 12): the comparisons above copy ours into timm's module, so a
    wrong magnitude would pass them. Drawn under the same seed they equal timm's init_random_2d_freqs; and in a
    model, each pair (f_x, f_y) has the magnitude 1 / T^(4i / Dh), i < Dh/4, whatever direction it was drawn in."""
    from timm.layers.pos_embed_sincos import init_random_2d_freqs

    head_dim, depth, heads = 16, 3, 2
    mine = Rope(rope_spec(tiny(rope="mixed", embed_dim=32, num_heads=heads, depth=depth)), depth=depth,
                num_heads=heads, grid_size=(4, 4))  # fmt: skip
    torch.manual_seed(5)
    mine.reset_parameters()
    torch.manual_seed(5)
    torch.testing.assert_close(mine.freqs, init_random_2d_freqs(head_dim, depth, heads, temperature=1e4), rtol=0,
                               atol=0)  # fmt: skip
    model = ViT(tiny(rope="mixed", rope_temperature=100.0, embed_dim=64, num_heads=2))  # Dh 32: 8 magnitudes
    magnitude = model.rope.freqs.detach().norm(dim=0)  # (depth, H, Dh/2): |(f_x, f_y)| per pair
    expected = 1.0 / 100.0 ** (4 * torch.arange(8) / 32)
    torch.testing.assert_close(magnitude, expected.repeat(2).expand_as(magnitude), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rotate_half", [False, True])
def test_rotation_is_timms_bit_for_bit_and_an_unchanged_grid_keeps_its_table(rotate_half):
    """Issue 74 point 16: the rotation with the sign in the table and identity rows for the prefix (no negation, no
    concatenation) equals timm's apply_rot_embed_cat on the patches bit for bit, for a table of any values; with
    dynamic_img_size the kept table answers for the kept grid (timm rebuilds it), another grid is computed."""
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    from vitlab.model.rope import rotate_pairs

    g = torch.Generator().manual_seed(0)
    q, k, rows = torch.randn(2, 3, 1 + 6, 8, generator=g), torch.randn(2, 3, 1 + 6, 8, generator=g), torch.randn(6, 16)
    for ours_x, x in zip(rotate_pairs((q, k), rows, 1, rotate_half), (q, k), strict=True):
        theirs = torch.cat([x[:, :, :1], apply_rot_embed_cat(x[:, :, 1:], rows, half=rotate_half)], dim=2)
        assert torch.equal(ours_x, theirs)
    rope = ours(rope="axial")  # tiny(): a 4x4 grid
    rope.reset_parameters()
    assert table(rope, (4, 4)) is rope.cached and table(rope, (3, 5)) is not rope.cached
    assert torch.equal(table(rope, (3, 5)), RotaryEmbeddingCat(HEAD, in_pixels=False).get_embed([3, 5]))


@pytest.mark.parametrize("rotate_half", [False, True])
def test_attentions_eager_rotation_by_complex_products_is_timms(rotate_half):
    """Issue 74 point 16: run eagerly, the model hands its blocks a table's complex turns and attention turns each
    channel pair by one complex product (model/rope.py turns, rotate), for any angles, the prefix rows left as they
    are: timm's apply_rot_embed_cat bit for bit at a head of 64 channels (the products vectorised), within rounding
    at a head of 8 (its products in scalar code that may fuse a multiply and an add); a bfloat16 query as timm's
    float32 promotion gives it; and the gradients of the queries, keys and angles (mixed RoPE learns its frequencies
    through them) as timm's."""
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    from vitlab.model.rope import rotate, turns

    g = torch.Generator().manual_seed(0)
    for head, dtype, exact in ((64, torch.float32, True), (8, torch.float32, False), (64, torch.bfloat16, True)):
        qkv = torch.randn(2, 1 + 6, 3, 3, head, generator=g).to(dtype).requires_grad_()
        q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, Dh) views of one projection, as attention's
        angles = (4 * torch.randn(6, head // 2, generator=g)).requires_grad_()
        layout = (lambda t: torch.cat([t, t], -1)) if rotate_half else (lambda t: t.repeat_interleave(2, -1))
        rows = torch.cat([layout(angles.sin()), layout(angles.cos())], -1)
        ours = rotate((q, k), turns(rows, 1, rotate_half), 1, rotate_half)
        theirs = [torch.cat([x[:, :, :1], apply_rot_embed_cat(x[:, :, 1:], rows, half=rotate_half).type_as(x)], 2)
                  for x in (q, k)]  # fmt: skip
        for o, t in zip(ours, theirs, strict=True):
            assert o.dtype == t.dtype and (torch.equal(o, t) if exact else torch.allclose(o, t, atol=1e-6, rtol=0))
        up = torch.randn(2, *ours[0].shape, generator=g).to(dtype)
        grads = [torch.autograd.grad((torch.stack(out) * up).sum(), (qkv, angles), retain_graph=True)
                 for out in (ours, theirs)]  # fmt: skip
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)  # (a bf16 ulp)
        for mine, ref in zip(*grads, strict=True):
            torch.testing.assert_close(mine, ref, **tol)


def test_the_blocks_turns_are_kept_for_the_kept_grid_and_follow_a_new_one(monkeypatch):
    """Issue 74 point 16: the kept grid's turns are built with its table (a buffer, not in the state dict): forwards at
    that grid build none, a forward at another grid builds its own once for every block, and a new input size
    (set_input_size) rebuilds the kept ones, here a grid of as many patches (2x8 for 4x4), whose stale turns would
    rotate by the old grid's angles; the logits timm's Eva's at each."""
    from vitlab.model import rope as rope_module

    built, build = [], rope_module.turns
    monkeypatch.setattr(rope_module, "turns", lambda t, *args: built.append(tuple(t.shape)) or build(t, *args))
    cfg = tiny(block_fn="eva", weight_init="eva", fix_init=True, pos_embed="none", dynamic_img_size=True, rope="axial",
               reg_tokens=1, pool_include_prefix=False)  # fmt: skip
    torch.manual_seed(0)
    model = ViT(cfg).eval()
    with torch.no_grad():  # weights large enough that each rotation moves the logits (EVA's init nearly hides them)
        [p.normal_(0.0, 0.5) for p in model.parameters()]
    assert not any("turns" in k for k in model.state_dict())

    def timms_at(hw, x):
        theirs = Eva(**eva_kwargs(cfg.replace(img_size=hw))).eval()
        theirs.load_state_dict(model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(x), theirs(x), atol=1e-5, rtol=0)

    built.clear()
    for hw in ((32, 32), (32, 32), (24, 40)):
        timms_at((32, 32), torch.randn(2, 3, *hw))
    assert built == [(15, 2 * HEAD)]  # the 3x5 grid's table, once for both blocks; the kept 4x4 grid's none
    model.set_input_size(img_size=(16, 64))
    built.clear()
    for hw in ((16, 64), (16, 64)):
        timms_at((16, 64), torch.randn(2, 3, *hw))
    assert built == []
