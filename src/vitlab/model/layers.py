"""The layers a ViT is built from, one table per config choice: norms (NORMS), activations (ACTIVATIONS),
poolings (POOLS), attention (ATTENTIONS), MLPs (MLPS), plus stochastic depth, patch dropout, LayerScale, the
attention pool and the patch embedding. Parameter names are timm's.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim, P patch size.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model.config import ViTConfig

# ---- activations, norms, poolings ----------------------------------------------------------------------


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# The components a config names (config.py: act_layer, norm_layer), built as timm builds them.
ACTIVATIONS = {
    "gelu": nn.GELU,  # exact (erf), as the paper
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
}
NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}  # (dim, eps=...); RMSNorm has a weight, no bias
POOLS = {  # global_pool over tokens (B, N, D) -> (B, D); 'token' and 'map' (AttentionPool) are the model's own
    "avg": lambda t: t.mean(dim=1),
    "max": lambda t: t.amax(dim=1),
    "avgmax": lambda t: 0.5 * (t.amax(dim=1) + t.mean(dim=1)),
}


def norm(cfg: ViTConfig, dim: int) -> nn.Module:
    return NORMS[cfg.norm_layer](dim, eps=cfg.norm_eps)


def qk_norms(cfg: ViTConfig, head_dim: int) -> tuple[nn.Module, nn.Module]:
    """q_norm and k_norm: a norm over each head's queries and keys (qk_norm; ViT-22B), else identities."""
    if not cfg.qk_norm:
        return nn.Identity(), nn.Identity()
    return norm(cfg, head_dim), norm(cfg, head_dim)


# ---- regularisation and residual scaling -----------------------------------------------------------


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop the whole residual branch per sample. The keep probability is a
    float64 scalar tensor (a non-persistent buffer, recomputed from `p` after every move or cast), not a Python float:
    the same draws, and every block's rate is an input of a compiled block rather than a constant of it, so
    compile=regional's blocks share one graph whatever their rates."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.register_buffer("keep", torch.tensor(1.0 - p, dtype=torch.float64), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.keep = torch.full((), 1.0 - self.p, dtype=torch.float64, device=self.keep.device)  # never cast
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = x.new_empty(x.shape[0], 1, 1).bernoulli_(self.keep)  # tokens (B, N, D): one draw per sample
        return x * mask.div_(self.keep)


def stochastic_depth(p: float) -> nn.Module:
    return DropPath(p) if p > 0 else nn.Identity()


class PatchDropout(nn.Module):
    """In training, keep a random max(1, int(L * (1 - p))) of the L patch tokens of each image, prefix tokens
    always (Li et al. 2023, FLIP; timm's PatchDropout, unordered)."""

    def __init__(self, p: float, num_prefix_tokens: int):
        super().__init__()
        self.p, self.num_prefix_tokens = p, num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, prefix + L, D) -> (B, prefix + kept, D)
        return _drop_patches(x, self.p, self.num_prefix_tokens) if self.training else x


def random_order(n: int, length: int, device=None) -> torch.Tensor:
    """A random permutation of range(length) per row (n, length), from torch's generator (as timm draws it)."""
    return torch.randn(n, length, device=device).argsort(dim=-1)


@torch.fx.wrap  # the kept count comes from the input's shape
def _drop_patches(x: torch.Tensor, p: float, num_prefix: int) -> torch.Tensor:
    prefix, x = x[:, :num_prefix], x[:, num_prefix:]
    L = x.shape[1]
    keep = random_order(x.shape[0], L, x.device)[:, : max(1, int(L * (1.0 - p)))]
    x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([prefix, x], dim=1)


class LayerScale(nn.Module):
    """Per-channel residual scaling (CaiT, Touvron et al. 2021)."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.init_values = float(init_values)
        self.gamma = nn.Parameter(torch.full((dim,), self.init_values))

    def reset_parameters(self) -> None:  # init.py resets every layer (after to_empty too)
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def scale_and_drop(cfg: ViTConfig, drop_path: float) -> tuple[nn.Module, nn.Module]:
    """How a residual branch ends in every block: LayerScale (init_values) and stochastic depth, each an
    identity when switched off; assigned as the block's `ls` and `drop_path` (timm's names)."""
    ls = LayerScale(cfg.embed_dim, cfg.init_values) if cfg.init_values else nn.Identity()
    return ls, stochastic_depth(drop_path)


# ---- attention ---------------------------------------------------------------------------------------
# Every attention path takes `rows`: with it only the first `rows` tokens query (every token is still a key and
# value), so the output is (B, rows, D). A class-token head reads one row of the last block (ViT.forward).


@torch.fx.wrap  # traced with or without a mask
def _mask_rows(attn_mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The mask of the first `rows` queries; None, or a mask with no query axis, as it is."""
    return attn_mask if attn_mask is None or attn_mask.ndim < 2 else attn_mask[..., :rows, :]


def _queries(q: torch.Tensor, attn_mask: torch.Tensor | None, rows: int | None) -> tuple:
    """The first `rows` queries (..., rows, Dh) and their rows of the mask; every query without `rows`."""
    return (q, attn_mask) if rows is None else (q[..., :rows, :], _mask_rows(attn_mask, rows))


class _MultiHead(nn.Module):
    """What every attention keeps per head: their number and width, the score scale 1/sqrt(Dh), the q/k norms and
    the attention dropout. `_attend` and `_map` come from `_Softmax` or `_Differential`."""

    def _init_heads(self, cfg: ViTConfig, head_dim: int) -> None:
        self.num_heads, self.head_dim = cfg.num_heads, head_dim
        self.scale = head_dim**-0.5  # SDPA's default scale too
        self.attn_drop = cfg.attn_drop_rate
        self.q_norm, self.k_norm = qk_norms(cfg, head_dim)


class _Softmax(_MultiHead):
    """softmax(q k^T / sqrt(Dh)) v over q, k, v (B, H, N, Dh), by SDPA (flash/mem-efficient kernels)."""

    def _attend(self, q, k, v, rows: int | None, attn_mask: torch.Tensor | None) -> torch.Tensor:  # (B, rows|N, D)
        """`attn_mask`: SDPA's, broadcastable to (B, H, N, N), bool (True attends) or added to the scores."""
        q, attn_mask = _queries(q, attn_mask, rows)  # (B, H, rows, Dh)
        drop = self.attn_drop if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop).transpose(1, 2).flatten(2)

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

    def _init_differential(self, cfg: ViTConfig, layer: int) -> None:
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
        a1, a2 = (F.scaled_dot_product_attention(q[:, :, i], k[:, :, i], v, attn_mask, drop) for i in (0, 1))
        x = self.sub_norm(a1 - self._lambda().type_as(a1) * a2) * (1 - self.lambda_init)
        return x.transpose(1, 2).flatten(2)

    def _map(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # the differential map (may be negative)
        maps = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, 2, N, N)
        return maps[:, :, 0] - self._lambda().type_as(maps) * maps[:, :, 1]


class Attention(_Softmax):
    """Multi-head self-attention with one fused qkv projection."""

    def __init__(self, cfg: ViTConfig, layer: int = 0, head_dim: int | None = None):  # layer: ATTENTIONS' signature
        super().__init__()
        dim = cfg.embed_dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=cfg.qkv_bias)  # rows ordered q; k; v
        self._init_heads(cfg, head_dim or dim // cfg.num_heads)
        self.norm = norm(cfg, dim) if cfg.scale_attn_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=cfg.proj_bias)
        self.proj_drop = nn.Dropout(cfg.proj_drop_rate)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, Dh), views: no copy
        return self.q_norm(q), self.k_norm(k), v

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        return self.proj_drop(self.proj(self.norm(self._attend(*self._qkv(x), rows, attn_mask))))

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """The attention probabilities (B, H, N, N). For visualisation only; the forward pass never
        materialises them."""
        return self._map(*self._qkv(x)[:2])


class DiffAttention(_Differential, Attention):
    """Attention with the differential attention of `_Differential` in place of softmax attention."""

    def __init__(self, cfg: ViTConfig, layer: int = 0):
        super().__init__(cfg, layer, head_dim=cfg.embed_dim // cfg.num_heads // 2)  # v keeps the full head width
        self._init_differential(cfg, layer)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self._heads(q, k, v)


ATTENTIONS = {"attn": Attention, "diff": DiffAttention}  # config.py: attn_layer; built with (cfg, layer index)

# ---- MLPs --------------------------------------------------------------------------------------------


class _Mlp(nn.Module):
    """What every MLP shares: its input layers (passed in, so that they register first, as timm's), then
    activation, dropout, the optional hidden norm (scale_mlp_norm), fc2 and dropout. A subclass makes the
    activated hidden features (`_hidden`)."""

    def __init__(self, cfg: ViTConfig, inputs: dict[str, nn.Module], hidden: int):
        super().__init__()
        for name, layer in inputs.items():
            self.add_module(name, layer)
        self.act = ACTIVATIONS[cfg.act_layer]()
        self.drop1 = nn.Dropout(cfg.proj_drop_rate)
        self.norm = norm(cfg, hidden) if cfg.scale_mlp_norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, cfg.embed_dim, bias=cfg.proj_bias)
        self.drop2 = nn.Dropout(cfg.proj_drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        return self.drop2(self.fc2(self.norm(self.drop1(self._hidden(x)))))


def _fc(cfg: ViTConfig, hidden: int) -> nn.Linear:
    return nn.Linear(cfg.embed_dim, hidden, bias=cfg.proj_bias)


class Mlp(_Mlp):
    """fc1 -> activation -> fc2 (the paper's MLP; GELU unless the config names another)."""

    def __init__(self, cfg: ViTConfig):
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        super().__init__(cfg, dict(fc1=_fc(cfg, hidden)), hidden)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x))


class SwiGLU(_Mlp):
    """Gated MLP (Shazeer 2020): act(fc1_g x) * fc1_x x -> fc2, timm's `SwiGLU`."""

    def __init__(self, cfg: ViTConfig):
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        super().__init__(cfg, dict(fc1_g=_fc(cfg, hidden), fc1_x=_fc(cfg, hidden)), hidden)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1_g(x)) * self.fc1_x(x)


class SwiGLUPacked(_Mlp):
    """The gated MLP with one fc1 whose output halves are (gate, value): act(gate) * value -> fc2 of half
    the width, timm's `SwiGLUPacked` (DINOv2 giant)."""

    def __init__(self, cfg: ViTConfig):
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        super().__init__(cfg, dict(fc1=_fc(cfg, hidden)), hidden // 2)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.act(gate) * value


MLPS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked}  # config.py: mlp_layer; built with (cfg)

# ---- the attention pool and the patch embedding ------------------------------------------------------


class AttentionPool(nn.Module):
    """Multi-head attention pooling with one learned query (SigLIP's 'map' head; timm's AttentionPoolLatent):
    the latent query attends over the patch tokens, then a residual MLP on the pooled token."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D = cfg.embed_dim
        self.num_heads, self.head_dim = cfg.num_heads, D // cfg.num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, D))
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(D, D)
        self.norm = norm(cfg, D)
        self.mlp = Mlp(cfg.replace(proj_bias=True, proj_drop_rate=0.0))  # timm's: biases on, no dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, N, D) -> (B, D)
        """`attn_mask` (B, 1, 1, N): NaFlex's padded keys (model/naflex.py)."""
        heads = (self.num_heads, self.head_dim)
        q = self.q(self.latent.expand(x.shape[0], -1, -1)).unflatten(-1, heads).transpose(1, 2)  # (B, H, 1, Dh)
        k, v = self.kv(x).unflatten(-1, (2, *heads)).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).flatten(2)  # (B, 1, D)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class PatchEmbed(nn.Module):
    """Non-overlapping PxP patches, linearly projected (paper Eq. 1) as one strided convolution. With
    `dynamic_img_pad` an input is first zero-padded on the right and bottom to a multiple of P (timm's)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        p = self.patch_size = cfg.patch_hw
        self.img_size, self.grid_size = cfg.img_hw, cfg.grid_size  # timm's: its checkpoint filter reads the grid
        self.dynamic_img_pad = cfg.dynamic_img_pad
        self.proj = nn.Conv2d(cfg.in_chans, cfg.embed_dim, kernel_size=p, stride=p, bias=not cfg.pre_norm)
        self.norm = norm(cfg, cfg.embed_dim) if cfg.embed_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, ceil(H/P), ceil(W/P), D)
        if self.dynamic_img_pad:
            (ph, pw), H, W = self.patch_size, x.shape[-2], x.shape[-1]
            x = F.pad(x, (0, (pw - W % pw) % pw, 0, (ph - H % ph) % ph))
        return self.norm(self.proj(x).permute(0, 2, 3, 1))
