"""The model's layers built alone from explicit arguments (issue 73 point 5), against their timm counterparts: our
Attention vs timm.layers.Attention, our EvaAttention vs timm's (fused q/v biases, RoPE on the patch tokens), our
Block vs timm's Block, our EvaBlock vs timm's (LayerScale gammas of 1), 8 query heads over 2 key/value heads vs
timm's AttentionRope. The reference's own random weights, with every bias and norm moved off its init (a zero bias
or a unit norm weight hides a swapped pair), are loaded into ours under the same keys; outputs held to 1e-6."""

from functools import partial

import pytest
import torch
from timm.layers import Attention as TimmAttention
from timm.layers import AttentionRope as TimmAttentionRope
from timm.models.eva import EvaAttention as TimmEvaAttention
from timm.models.eva import EvaBlock as TimmEvaBlock
from timm.models.vision_transformer import Block as TimmBlock
from torch import nn

from vitlab.model.attention import Attention, EvaAttention
from vitlab.model.blocks import Block, EvaBlock
from vitlab.model.layers import Mlp, SwiGLUPacked

DIM, HEADS, N = 48, 4, 11  # head width 12, 1 class token + 10 patches
NORM = partial(nn.LayerNorm, eps=1e-6)


def _perturbed(reference: nn.Module) -> nn.Module:
    """The reference with every parameter random: biases and norm weights included (their inits would hide a bias
    added to the wrong rows, or q and k's norms swapped)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.5)
    return reference.eval()


def _same(ours: nn.Module, reference: nn.Module, *args, **kwargs) -> None:
    ours.load_state_dict(reference.state_dict())  # the same keys (timm's): strict
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours.eval()(x, *args), reference(x, **kwargs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_built_alone_is_timms(qk_norm):
    reference = _perturbed(TimmAttention(DIM, HEADS, qkv_bias=True, qk_norm=qk_norm, norm_layer=NORM))
    ours = Attention(DIM, HEADS, qkv_bias=True, qk_norm=NORM if qk_norm else None)
    _same(ours, reference)


@pytest.mark.parametrize("separate", [False, True])
def test_eva_attention_built_alone_is_timms_with_rope_on_the_patches(separate):
    """Fused q/v biases (no key bias) inside or after the projection, queries and keys normed, then rotated by a RoPE
    table (N - 1, 2 * Dh) [sin | cos] on the patch tokens only: the class token's row is left as it is."""
    kwargs = dict(qkv_bias=True, qkv_bias_separate=separate, num_prefix_tokens=1, rotate_half=True)
    reference = TimmEvaAttention(DIM, HEADS, qk_norm=True, scale_norm=False, norm_layer=NORM, **kwargs)
    ours = EvaAttention(DIM, HEADS, qk_norm=NORM, **kwargs)
    rope = torch.randn(N - 1, 2 * DIM // HEADS, generator=torch.Generator().manual_seed(2))
    _same(ours, _perturbed(reference), None, None, rope, rope=rope)


def test_block_built_alone_from_its_layers_is_timms():
    """The pre-norm block of an attention and an MLP handed as layers to build, with LayerScale at a scale that
    leaves each branch its weight (a LayerScale of 1e-5 would shrink a wrong branch below the tolerance)."""
    reference = TimmBlock(DIM, HEADS, mlp_ratio=3.0, qkv_bias=True, qk_norm=True, init_values=0.5, norm_layer=NORM)
    ours = Block(
        DIM,
        attn_layer=partial(Attention, DIM, HEADS, qkv_bias=True, qk_norm=NORM),
        mlp_layer=partial(Mlp, DIM, 3 * DIM),
        norm_layer=NORM,
        init_values=0.5,
    )
    _same(ours, _perturbed(reference))


def test_eva_block_with_layerscale_gammas_of_one_is_timms():
    """timm's EvaBlock (EvaAttention with random q/v biases, RoPE, the packed SwiGLU) against ours built from its
    layers, gammas set to 1 (issue 74 point 13): at EVA's LayerScale of 1e-5 a swapped q/v bias moves the block's
    output by ~1e-5, inside the tolerance."""
    kwargs = dict(qkv_bias=True, num_prefix_tokens=1, rotate_half=True)
    reference = _perturbed(TimmEvaBlock(DIM, HEADS, mlp_ratio=2.0, swiglu_mlp=True, init_values=1e-5,
                                        norm_layer=NORM, **kwargs))  # fmt: skip
    with torch.no_grad():
        reference.gamma_1.fill_(1.0), reference.gamma_2.fill_(1.0)
    ours = EvaBlock(
        DIM,
        attn_layer=partial(EvaAttention, DIM, HEADS, **kwargs),
        mlp_layer=partial(SwiGLUPacked, DIM, 4 * DIM, act_layer=nn.SiLU),  # timm's GluMlp: fc1 (gate; value)
        norm_layer=NORM,
        init_values=1e-5,
    )
    rope = torch.randn(N - 1, 2 * DIM // HEADS, generator=torch.Generator().manual_seed(2))
    _same(ours, reference, None, None, rope, rope=rope)


def test_grouped_query_heads_are_timms_attention_rope():
    """8 query heads over 2 key/value heads (issue 74 point 14): key/value head j serves query heads 4j..4j+3, as
    timm's AttentionRope tiles them (repeat_interleave). One key/value head would hide a tiling in the wrong order."""
    dim, heads, kv_heads = 64, 8, 2
    kwargs = dict(qkv_bias=True, qkv_fused=False, num_kv_heads=kv_heads, num_prefix_tokens=1)
    reference = _perturbed(TimmAttentionRope(dim, heads, **kwargs))
    ours = Attention(dim, heads, **kwargs)
    ours.load_state_dict(reference.state_dict())
    assert ours.k_proj.weight.shape == (dim // heads * kv_heads, dim)
    x = torch.randn(2, N, dim, generator=torch.Generator().manual_seed(1))
    rope = torch.randn(N - 1, 2 * dim // heads, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours.eval()(x, None, None, rope), reference(x, rope=rope), atol=1e-6, rtol=0)


def test_within_drawn_by_rows_stochastic_depth_is_the_global_batch_row_s_views_included():
    """Issue 78: each sample's keep is its row's of the global batch: two processes' halves drop what one process
    drops of the whole batch; a stack of views (m x the rows, multi-crop's) draws each view as its own global batch,
    and views of another shape draw apart."""
    from vitlab.model.draws import drawn_by_rows
    from vitlab.model.layers import DropPath

    net = torch.nn.Sequential(DropPath(0.5), DropPath(0.5)).train()
    x = torch.ones(8, 3, 4)
    with drawn_by_rows(net, 11, 0, 8, 8):
        whole = net(x)
    halves = []
    for r in range(2):
        with drawn_by_rows(net, 11, 4 * r, 4, 8):
            halves.append(net(x[:4]))
    torch.testing.assert_close(whole, torch.cat(halves), rtol=0, atol=0)
    assert 0 < (whole == 0).all(-1).all(-1).sum() < 8  # some samples dropped, not all
    views = torch.ones(3 * 8, 3, 4)  # three views of the batch, one after another
    with drawn_by_rows(net, 11, 0, 8, 8):
        stacked, other_shape = net(views), net(torch.ones(3 * 8, 5, 4))
    shares = []
    for r in range(2):
        with drawn_by_rows(net, 11, 4 * r, 4, 8):
            shares.append(net(torch.ones(3 * 4, 3, 4)).view(3, 4, 3, 4))
    torch.testing.assert_close(stacked.view(3, 8, 3, 4), torch.cat(shares, 1), rtol=0, atol=0)
    assert not torch.equal(stacked[:, 0, 0] == 0, other_shape[:, 0, 0] == 0)
