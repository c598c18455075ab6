"""The attention layers, one table (ATTENTIONS, config.py's attn_layer): softmax attention with a fused or separate
q/k/v projection (timm's Attention / AttentionRope), EVA's (no key bias; timm's EvaAttention), differential attention
(timm's DiffAttention), and the attention pool of the 'map' head. RoPE (model/rope.py) rotates the queries and keys
of the first two. Parameter names are timm's.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model.draws import DrawSite, Dropout, sdpa
from vitlab.model.layers import Mlp, NormLayer, optional_norm
from vitlab.model.rope import rotate

torch.fx.wrap("rotate")  # FX records one call (its path is chosen by how it runs: model/rope.py)

# ---- self-attention ---------------------------------------------------------------------------------------
# Every attention path takes `rows`: with it only the first `rows` tokens query (every token is still a key and
# value), so the output is (B, rows, D). A class-token head reads one row of the last block (ViT.forward).


@torch.fx.wrap  # traced with or without a mask
def _mask_rows(attn_mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The mask of the first `rows` queries; None, or a mask with no query axis, as it is."""
    return attn_mask if attn_mask is None or attn_mask.ndim < 2 else attn_mask[..., :rows, :]


def _queries(q: torch.Tensor, attn_mask: torch.Tensor | None, rows: int | None) -> tuple:
    """The first `rows` queries (..., rows, Dh) and their rows of the mask; every query without `rows`."""
    return (q, attn_mask) if rows is None else (q[..., :rows, :], _mask_rows(attn_mask, rows))


class _MultiHead(DrawSite):
    """What every attention keeps per head: their number and width, the score scale 1/sqrt(Dh), the q/k norms and
    the attention dropout. `_attend` and `_map` come from `_Softmax` or `_Differential`."""

    def _init_heads(self, num_heads: int, head_dim: int, attn_drop: float, qk_norm: NormLayer | None) -> None:
        """`qk_norm`: the norm over each head's queries and keys (ViT-22B), or None."""
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5  # SDPA's default scale too
        self.attn_drop = attn_drop  # (a draw site: model/draws.py)
        self.q_norm, self.k_norm = optional_norm(qk_norm, head_dim), optional_norm(qk_norm, head_dim)


class _Softmax(_MultiHead):
    """softmax(q k^T / sqrt(Dh)) v over q, k, v (B, H, N, Dh), by SDPA (flash/mem-efficient kernels)."""

    def _attend(self, q, k, v, rows: int | None, attn_mask: torch.Tensor | None) -> torch.Tensor:  # (B, rows|N, D)
        """`attn_mask`: SDPA's, broadcastable to (B, H, N, N), bool (True attends) or added to the scores."""
        q, attn_mask = _queries(q, attn_mask, rows)  # (B, H, rows, Dh)
        drop = self.attn_drop if self.training else 0.0
        return sdpa(q, k, v, attn_mask, drop, self.site_key).transpose(1, 2).flatten(2)

    def _map(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # (B, H, N, N), rows summing to 1
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


class _Differential(_MultiHead):
    """Differential attention (Ye et al. 2024, "Differential Transformer"; timm's DiffAttention): each head
    splits q and k in two halves of Dh/2 and attends twice with values of width Dh,
    softmax(q1 k1^T) v - lambda softmax(q2 k2^T) v, then an RMSNorm per head and a scale of (1 - lambda_init);
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 layer). Shared by
    DiffAttention and DiffParallelScalingBlock, which build the heads with head_dim Dh/2, then call
    `_init_differential` for the parameters below (timm's names)."""

    LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")

    def _init_differential(self, layer: int) -> None:
        for name in self.LAMBDAS:
            self.register_parameter(name, nn.Parameter(torch.empty(self.head_dim).normal_(std=0.1)))
        self.sub_norm = nn.RMSNorm(2 * self.head_dim, eps=1e-5)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)

    def reset_parameters(self) -> None:  # the lambdas, then what a parallel block's other base holds (mlp_bias)
        for name in self.LAMBDAS:
            nn.init.normal_(getattr(self, name), std=0.1)
        if hasattr(super(), "reset_parameters"):
            super().reset_parameters()

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        halves = (self.num_heads, 2, self.head_dim)
        q = self.q_norm(q.unflatten(-1, halves).permute(0, 2, 3, 1, 4))  # (B, H, 2, N, Dh/2)
        k = self.k_norm(k.unflatten(-1, halves).permute(0, 2, 3, 1, 4))
        return q, k, v.unflatten(-1, (self.num_heads, 2 * self.head_dim)).transpose(1, 2)  # v: (B, H, N, Dh)

    def _lambda(self) -> torch.Tensor:
        l1, l2 = (self.lambda_q1 * self.lambda_k1).sum(-1), (self.lambda_q2 * self.lambda_k2).sum(-1)
        return l1.float().exp() - l2.float().exp() + self.lambda_init

    def _attend(self, q, k, v, rows: int | None, attn_mask: torch.Tensor | None) -> torch.Tensor:  # (B, rows|N, D)
        q, attn_mask = _queries(q, attn_mask, rows)  # (B, H, 2, rows, Dh/2)
        drop = self.attn_drop if self.training else 0.0
        a1, a2 = (sdpa(q[:, :, i], k[:, :, i], v, attn_mask, drop, self.site_key, i) for i in (0, 1))
        x = self.sub_norm(a1 - self._lambda().type_as(a1) * a2) * (1 - self.lambda_init)
        return x.transpose(1, 2).flatten(2)

    def _map(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # the differential map (may be negative)
        maps = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, 2, N, N)
        return maps[:, :, 0] - self._lambda().type_as(maps) * maps[:, :, 1]


class Attention(_Softmax):
    """Multi-head self-attention with one fused qkv projection, or (qkv_fused false) q_proj, k_proj and v_proj (timm's
    AttentionRope), with `num_kv_heads` key/value heads (grouped-query attention; None: num_heads). With a RoPE table
    (model/rope.py) the patch tokens' queries and keys are rotated after their norms, the first `num_prefix_tokens`
    left as they are (`rotate_half`: the table's layout). `qk_norm` and `scale_norm` (BEiT-3's norm before the
    output projection) are norm layers, or None for none. `layer`: the block's index (differential attention's
    lambda_init)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        qkv_bias: bool = True,
        qkv_fused: bool = True,
        num_kv_heads: int | None = None,
        qk_norm: NormLayer | None = None,
        scale_norm: NormLayer | None = None,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        num_prefix_tokens: int = 1,
        rotate_half: bool = False,
        layer: int = 0,
        head_dim: int | None = None,
    ):
        super().__init__()
        self._projections(dim, num_heads, num_kv_heads, qkv_bias, qkv_fused)
        self._init_heads(num_heads, head_dim or dim // num_heads, attn_drop, qk_norm)
        self.num_prefix_tokens, self.rotate_half = num_prefix_tokens, rotate_half
        self.norm = optional_norm(scale_norm, dim)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = Dropout(proj_drop)

    def _projections(self, dim: int, num_heads: int, num_kv_heads: int | None, bias: bool, fused: bool,
                     k_bias: bool = True) -> None:  # fmt: skip
        self.num_kv_heads = num_kv_heads or num_heads  # grouped-query attention: fewer key/value heads, each shared
        kv_dim = dim // num_heads * self.num_kv_heads
        if fused:
            self.qkv = nn.Linear(dim, 3 * dim, bias=bias)  # rows ordered q; k; v
        else:
            self.qkv = None
            self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=bias), nn.Linear(dim, kv_dim, bias=bias and k_bias)
            self.v_proj = nn.Linear(dim, kv_dim, bias=bias)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, 3D)
        return self.qkv(x)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            qkv = self._fused(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # each (B, H, N, Dh), views: no copy
        else:
            q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
            kv = (self.num_kv_heads, self.head_dim)
            k, v = (p(x).unflatten(-1, kv).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        return self.q_norm(q), self.k_norm(k), v

    def _rotated(self, x: torch.Tensor, rope: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        q, k, v = self._qkv(x)
        if rope is not None:
            n = self.num_prefix_tokens
            q, k = rotate((q, k), rope, n, self.rotate_half)
        if self.num_kv_heads != self.num_heads:  # each key/value head serves its group of query heads (as timm's)
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rows: int | None = None,
        attn_mask: torch.Tensor | None = None,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        return self.proj_drop(self.proj(self.norm(self._attend(*self._rotated(x, rope), rows, attn_mask))))

    def attention_map(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """The attention probabilities (B, H, N, N). For visualisation only; the forward pass never
        materialises them."""
        return self._map(*self._rotated(x, rope)[:2])


class EvaAttention(Attention):
    """EVA's attention (timm's EvaAttention): the keys have no bias; fused, the qkv projection has none and the query
    and value biases are parameters of their own (q_bias, v_bias: timm's keys), added inside the projection or after
    it (qkv_bias_separate); unfused, k_proj has no bias."""

    def __init__(self, dim: int, num_heads: int, *, qkv_bias: bool = True, qkv_bias_separate: bool = False, **kwargs):
        """Attention's arguments, and `qkv_bias_separate`: the fused q/v biases added after the projection."""
        self.qkv_bias_separate = qkv_bias_separate
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, **kwargs)

    def _projections(self, dim: int, num_heads: int, num_kv_heads: int | None, bias: bool, fused: bool,
                     k_bias: bool = False) -> None:  # fmt: skip
        super()._projections(dim, num_heads, num_kv_heads, bias and not fused, fused, k_bias=False)
        fused_bias = fused and bias
        self.q_bias = nn.Parameter(torch.zeros(dim)) if fused_bias else None
        self.register_buffer("k_bias", torch.zeros(dim) if fused_bias else None, persistent=False)
        self.v_bias = nn.Parameter(torch.zeros(dim)) if fused_bias else None

    def reset_parameters(self) -> None:  # init.py resets every layer (after to_empty too)
        for bias in (self.q_bias, self.k_bias, self.v_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, 3D), in timm's order of operations
        if self.q_bias is None:
            return self.qkv(x)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if self.qkv_bias_separate:
            return self.qkv(x) + bias
        return F.linear(x, weight=self.qkv.weight, bias=bias)


class DiffAttention(_Differential, Attention):
    """Attention with the differential attention of `_Differential` in place of softmax attention."""

    def __init__(self, dim: int, num_heads: int, *, layer: int = 0, **kwargs):
        super().__init__(dim, num_heads, layer=layer, head_dim=dim // num_heads // 2, **kwargs)  # v: full head width
        self._init_differential(layer)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self._heads(q, k, v)


ATTENTIONS = {
    "attn": Attention,
    "diff": DiffAttention,
    "eva": EvaAttention,
}  # config.py: attn_layer; built with (dim, num_heads, Attention's keywords)

# ---- the attention pool ----


class AttentionPool(nn.Module):
    """Multi-head attention pooling with one learned query (SigLIP's 'map' head; timm's AttentionPoolLatent):
    the latent query attends over the patch tokens, then a residual MLP on the pooled token."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        *,
        norm_layer: NormLayer,
        act_layer: Callable[[], nn.Module] = nn.GELU,
        mlp_norm_layer: NormLayer | None = None,
    ):
        """`mlp_norm_layer`: the norm of the MLP's hidden features (scale_mlp_norm), or None."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = norm_layer(dim)
        # timm's: biases on, no dropout, its own ratio
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, norm_layer=mlp_norm_layer)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, N, D) -> (B, D)
        """`attn_mask` (B, 1, 1, N): NaFlex's padded keys (model/naflex.py)."""
        heads = (self.num_heads, self.head_dim)
        q = self.q(self.latent.expand(x.shape[0], -1, -1)).unflatten(-1, heads).transpose(1, 2)  # (B, H, 1, Dh)
        k, v = self.kv(x).unflatten(-1, (2, *heads)).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).flatten(2)  # (B, 1, D)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]
