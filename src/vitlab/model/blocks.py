"""The encoder blocks (table BLOCKS, config.py's block_fn), built with (cfg, drop_path, layer index).
Parameter names are timm's. Shapes: B batch, N tokens, D embed_dim.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model.config import ViTConfig
from vitlab.model.layers import ACTIVATIONS, ATTENTIONS, MLPS, DropPath, LayerScale, _Differential, norm


class Block(nn.Module):
    """Pre-norm encoder block (paper Eq. 2-3): x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, cfg: ViTConfig, drop_path: float, layer: int = 0):
        super().__init__()
        dim = cfg.embed_dim
        self.norm1 = norm(cfg, dim)
        self.attn = ATTENTIONS[cfg.attn_layer](cfg, layer)
        self.ls1 = LayerScale(dim, cfg.init_values) if cfg.init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(cfg, dim)
        self.mlp = MLPS[cfg.mlp_layer](cfg)
        self.ls2 = LayerScale(dim, cfg.init_values) if cfg.init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        """With `rows`, only the first `rows` tokens are updated and returned: a class-token head reads
        one row of the last block, and every other row's attention query, projection and MLP is waste."""
        shortcut = x if rows is None else x[:, :rows]
        x = shortcut + self.drop_path1(self.ls1(self.attn(self.norm1(x), rows, attn_mask)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.attention_map(self.norm1(x))


class ParallelScalingBlock(nn.Module):
    """Attention and MLP in parallel from one norm and one input projection (ViT-22B, Dehghani et al.
    2023; timm's ParallelScalingBlock): in_proj yields the MLP's hidden features and q, k, v at once, and
    x + ls(attn_out_proj(attention) + mlp_out_proj(act(hidden))). Without qkv_bias the MLP keeps a bias
    of its own (mlp_bias)."""

    def __init__(self, cfg: ViTConfig, drop_path: float, layer: int = 0):
        super().__init__()
        dim, hidden = cfg.embed_dim, int(cfg.mlp_ratio * cfg.embed_dim)
        self.num_heads, self.head_dim = cfg.num_heads, dim // cfg.num_heads
        self.in_norm = norm(cfg, dim)
        self.in_proj = nn.Linear(dim, hidden + 3 * dim, bias=cfg.qkv_bias)
        self.in_split = [hidden, dim, dim, dim]
        self.mlp_bias = None if cfg.qkv_bias else nn.Parameter(torch.zeros(hidden))
        self.q_norm = norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.attn_drop = cfg.attn_drop_rate
        self.mlp_drop = nn.Dropout(cfg.proj_drop_rate)
        self.mlp_act = ACTIVATIONS[cfg.act_layer]()
        self.attn_out_proj = nn.Linear(dim, dim, bias=cfg.proj_bias)
        self.mlp_out_proj = nn.Linear(hidden, dim, bias=cfg.proj_bias)
        self.ls = LayerScale(dim, cfg.init_values) if cfg.init_values else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.mlp_bias
        heads = (self.num_heads, self.head_dim)
        q = self.q_norm(q.unflatten(-1, heads)).transpose(1, 2)
        k = self.k_norm(k.unflatten(-1, heads)).transpose(1, 2)
        return hidden, q, k, v.unflatten(-1, heads).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        hidden, q, k, v = self._project(x)
        drop = self.attn_drop if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop).transpose(1, 2).flatten(2)
        y = self.attn_out_proj(attn) + self.mlp_out_proj(self.mlp_drop(self.mlp_act(hidden)))
        x = x + self.drop_path(self.ls(y))
        return x if rows is None else x[:, :rows]

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        _, q, k, _ = self._project(x)
        return ((q * self.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)


class DiffParallelScalingBlock(_Differential, nn.Module):
    """The parallel block with differential attention (timm's DiffParallelScalingBlock): one norm and one input
    projection give the MLP's hidden features and q, k, v; x + ls(out_proj([diff_attention, act(hidden)]))."""

    def __init__(self, cfg: ViTConfig, drop_path: float, layer: int = 0):
        super().__init__()
        dim, hidden = cfg.embed_dim, int(cfg.mlp_ratio * cfg.embed_dim)
        self.in_norm = norm(cfg, dim)
        self.in_proj = nn.Linear(dim, hidden + 3 * dim, bias=cfg.qkv_bias)
        self.in_split = [hidden, dim, dim, dim]
        self.mlp_bias = None if cfg.qkv_bias else nn.Parameter(torch.zeros(hidden))
        self._differential(cfg, layer)
        self.mlp_drop = nn.Dropout(cfg.proj_drop_rate)
        self.mlp_act = ACTIVATIONS[cfg.act_layer]()
        self.out_proj = nn.Linear(dim + hidden, dim, bias=cfg.proj_bias)
        self.ls = LayerScale(dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.mlp_bias
        q, k, v = self._heads(q, k, v)
        return hidden, q, k, v

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        hidden, q, k, v = self._project(x)
        if rows is not None:
            x, hidden = x[:, :rows], hidden[:, :rows]
        y = torch.cat([self._attend(q, k, v, rows, attn_mask), self.mlp_drop(self.mlp_act(hidden))], dim=-1)
        return x + self.drop_path(self.ls(self.out_proj(y)))

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        _, q, k, _ = self._project(x)
        return self._map(q, k)


class ResPostBlock(nn.Module):
    """Post-norm residuals (Swin V2's res-post-norm; timm's ResPostBlock): x + norm1(attn(x)), then
    x + norm2(mlp(x)). `init_values` starts the norms' weights (not a LayerScale), as timm's."""

    def __init__(self, cfg: ViTConfig, drop_path: float, layer: int = 0):
        super().__init__()
        self.attn = ATTENTIONS[cfg.attn_layer](cfg, layer)
        self.norm1 = norm(cfg, cfg.embed_dim)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.mlp = MLPS[cfg.mlp_layer](cfg)
        self.norm2 = norm(cfg, cfg.embed_dim)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        if cfg.init_values is not None:
            nn.init.constant_(self.norm1.weight, cfg.init_values)
            nn.init.constant_(self.norm2.weight, cfg.init_values)

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        shortcut = x if rows is None else x[:, :rows]
        x = shortcut + self.drop_path1(self.norm1(self.attn(x, rows, attn_mask)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.attention_map(x)


class ParallelThingsBlock(nn.Module):
    """Two attention branches side by side, then two MLP branches ("Three things everyone should know about
    Vision Transformers", Touvron et al. 2022; timm's ParallelThingsBlock): x + sum_i attn_i(x), then
    x + sum_i mlp_i(x), each branch norm -> layer -> LayerScale -> stochastic depth."""

    def __init__(self, cfg: ViTConfig, drop_path: float, layer: int = 0, num_parallel: int = 2):
        super().__init__()

        def branch(name: str, layer: nn.Module) -> nn.Sequential:
            ls = LayerScale(cfg.embed_dim, cfg.init_values) if cfg.init_values else nn.Identity()
            dp = DropPath(drop_path) if drop_path > 0 else nn.Identity()
            return nn.Sequential(OrderedDict(norm=norm(cfg, cfg.embed_dim), **{name: layer}, ls=ls, drop_path=dp))

        self.attns = nn.ModuleList(
            [branch("attn", ATTENTIONS[cfg.attn_layer](cfg, layer)) for _ in range(num_parallel)]
        )
        self.ffns = nn.ModuleList([branch("mlp", MLPS[cfg.mlp_layer](cfg)) for _ in range(num_parallel)])

    def forward(
        self, x: torch.Tensor, rows: int | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        shortcut = x if rows is None else x[:, :rows]
        attn = [b.drop_path(b.ls(b.attn(b.norm(x), rows, attn_mask))) for b in self.attns]
        x = shortcut + torch.stack(attn).sum(dim=0)
        return x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:  # the mean of the branches' maps
        return torch.stack([b.attn.attention_map(b.norm(x)) for b in self.attns]).mean(dim=0)


BLOCKS = {
    "block": Block,
    "parallel_scaling": ParallelScalingBlock,
    "diff_parallel_scaling": DiffParallelScalingBlock,
    "res_post": ResPostBlock,
    "parallel_things": ParallelThingsBlock,
}
