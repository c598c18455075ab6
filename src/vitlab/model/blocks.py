"""The encoder blocks, one table (BLOCKS, config.py's block_fn). A serial block takes its width, its attention and MLP
as layers to build (`attn_layer`, `mlp_layer`: factories, as dinov2's `attn_class` and `ffn_layer`), its `norm_layer`,
LayerScale's `init_values` and its stochastic depth; a `fused` one (ViT-22B's parallel blocks) builds its own
attention and MLP from their arguments. model/vit.py reads the config into them.

Every block maps tokens (B, N, D) -> (B, N, D). With `rows` it updates and returns only the first `rows` tokens
(B, rows, D), every token still a key and value of attention: a class-token head reads one row of the last block
(ViT.forward), and every other row's query, projection and MLP would be waste. Parameter names are timm's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from vitlab.model.attention import _Differential, _Softmax
from vitlab.model.draws import Dropout
from vitlab.model.layers import NormLayer, scale_and_drop, stochastic_depth

Layer = Callable[[], nn.Module]  # a block's attention or MLP, built by the block (in timm's registration order)


class _AttnThenMlp(nn.Module):
    """x + attention branch, then x + MLP branch: the residual structure of the serial blocks. A subclass gives
    the two branches; `rows` is handled here (the attention branch returns the first `rows` tokens)."""

    fused = False  # built from an attention and an MLP layer (model/vit.py)

    def forward(
        self,
        x: torch.Tensor,
        rows: int | None = None,
        attn_mask: torch.Tensor | None = None,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D); rope: this block's RoPE table (model/rope.py)
        shortcut = x if rows is None else x[:, :rows]
        x = shortcut + self._attn_branch(x, rows, attn_mask, rope)
        return x + self._mlp_branch(x)


class Block(_AttnThenMlp):
    """Pre-norm encoder block (paper Eq. 2-3): x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(
        self,
        dim: int,
        *,
        attn_layer: Layer,
        mlp_layer: Layer,
        norm_layer: NormLayer,
        init_values: float | None = None,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer()
        self.ls1, self.drop_path1 = scale_and_drop(dim, init_values, drop_path)
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer()
        self.ls2, self.drop_path2 = scale_and_drop(dim, init_values, drop_path)

    def _attn_branch(self, x: torch.Tensor, rows: int | None, attn_mask, rope=None) -> torch.Tensor:
        return self.drop_path1(self.ls1(self.attn(self.norm1(x), rows, attn_mask, rope)))

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def attention_map(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn.attention_map(self.norm1(x), rope)


class EvaBlock(Block):
    """timm's EvaBlock: the pre-norm block, its LayerScale the block's own gamma_1 / gamma_2 (timm's keys), multiplied
    in before stochastic depth; attn_layer 'eva' or 'attn' (timm's attn_type 'rope'), any MLP of the table (EVA02's
    SwiGLU with its sub-LN: mlp_layer 'swiglu' with scale_mlp_norm)."""

    def __init__(
        self,
        dim: int,
        *,
        attn_layer: Layer,
        mlp_layer: Layer,
        norm_layer: NormLayer,
        init_values: float | None = None,
        drop_path: float = 0.0,
        attn_only_layer_scale: bool = False,
    ):
        """`attn_only_layer_scale`: LayerScale on the attention branch only (Sapiens2)."""
        nn.Module.__init__(self)
        self.init_values = init_values
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer()
        self.gamma_1 = nn.Parameter(torch.empty(dim)) if init_values is not None else None
        self.drop_path1 = stochastic_depth(drop_path)
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer()
        mlp_scale = init_values is not None and not attn_only_layer_scale
        self.gamma_2 = nn.Parameter(torch.empty(dim)) if mlp_scale else None
        self.drop_path2 = stochastic_depth(drop_path)

    def reset_parameters(self) -> None:  # init.py resets every layer (after to_empty too)
        for gamma in (self.gamma_1, self.gamma_2):
            if gamma is not None:
                nn.init.constant_(gamma, self.init_values)

    def _attn_branch(self, x: torch.Tensor, rows: int | None, attn_mask, rope=None) -> torch.Tensor:
        x = self.attn(self.norm1(x), rows, attn_mask, rope)
        return self.drop_path1(x if self.gamma_1 is None else self.gamma_1 * x)

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(self.norm2(x))
        return self.drop_path2(x if self.gamma_2 is None else self.gamma_2 * x)


class ResPostBlock(_AttnThenMlp):
    """Post-norm residuals (Swin V2's res-post-norm; timm's ResPostBlock): x + norm1(attn(x)), then
    x + norm2(mlp(x)). `init_values` starts the norms' weights (not a LayerScale), as timm's."""

    def __init__(
        self,
        dim: int,
        *,
        attn_layer: Layer,
        mlp_layer: Layer,
        norm_layer: NormLayer,
        init_values: float | None = None,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.attn = attn_layer()
        self.norm1 = norm_layer(dim)
        self.drop_path1 = stochastic_depth(drop_path)
        self.mlp = mlp_layer()
        self.norm2 = norm_layer(dim)
        self.drop_path2 = stochastic_depth(drop_path)
        self.init_values = init_values

    def reset_parameters(self) -> None:  # after its norms' own reset (init.py walks children first)
        if self.init_values is not None:
            nn.init.constant_(self.norm1.weight, self.init_values)
            nn.init.constant_(self.norm2.weight, self.init_values)

    def _attn_branch(self, x: torch.Tensor, rows: int | None, attn_mask, rope=None) -> torch.Tensor:
        return self.drop_path1(self.norm1(self.attn(x, rows, attn_mask, rope)))

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path2(self.norm2(self.mlp(x)))

    def attention_map(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn.attention_map(x, rope)


class ParallelThingsBlock(_AttnThenMlp):
    """Two attention branches side by side, then two MLP branches ("Three things everyone should know about
    Vision Transformers", Touvron et al. 2022; timm's ParallelThingsBlock): x + sum_i attn_i(x), then
    x + sum_i mlp_i(x), each branch norm -> layer -> LayerScale -> stochastic depth."""

    def __init__(
        self,
        dim: int,
        *,
        attn_layer: Layer,
        mlp_layer: Layer,
        norm_layer: NormLayer,
        init_values: float | None = None,
        drop_path: float = 0.0,
        num_parallel: int = 2,
    ):
        super().__init__()

        def branch(name: str, layer: nn.Module) -> nn.Sequential:
            ls, dp = scale_and_drop(dim, init_values, drop_path)
            return nn.Sequential(OrderedDict(norm=norm_layer(dim), **{name: layer}, ls=ls, drop_path=dp))

        self.attns = nn.ModuleList([branch("attn", attn_layer()) for _ in range(num_parallel)])
        self.ffns = nn.ModuleList([branch("mlp", mlp_layer()) for _ in range(num_parallel)])

    def _attn_branch(self, x: torch.Tensor, rows: int | None, attn_mask, rope=None) -> torch.Tensor:
        branches = [b.drop_path(b.ls(b.attn(b.norm(x), rows, attn_mask, rope))) for b in self.attns]
        return torch.stack(branches).sum(dim=0)

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)

    def attention_map(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:  # the branches' mean
        return torch.stack([b.attn.attention_map(b.norm(x), rope) for b in self.attns]).mean(dim=0)


class _ParallelScaling(nn.Module):
    """Attention and MLP in parallel from one norm and one input projection (ViT-22B, Dehghani et al. 2023):
    in_proj yields the MLP's hidden features and q, k, v at once; x + ls(out(attention, act(hidden))). Without
    qkv_bias the MLP keeps a bias of its own (mlp_bias). A subclass adds its attention (`_heads`, `_attend`,
    `_map`: `_Softmax` or `_Differential`), the MLP's activation and dropout, and its output projection(s)
    (`_out`). Its arguments are timm's (`mlp_hidden`: the MLP's width; `qk_norm`: a norm layer or None; `layer`:
    the block's index, differential attention's lambda_init)."""

    fused = True  # builds its own attention and MLP (model/vit.py)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_hidden: int,
        norm_layer: NormLayer,
        act_layer: Callable[[], nn.Module] = nn.GELU,
        qkv_bias: bool = True,
        qk_norm: NormLayer | None = None,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        init_values: float | None = None,
        drop_path: float = 0.0,
        layer: int = 0,
    ):
        super().__init__()
        self.in_norm = norm_layer(dim)
        self.in_proj = nn.Linear(dim, mlp_hidden + 3 * dim, bias=qkv_bias)
        self.in_split = [mlp_hidden, dim, dim, dim]
        self.mlp_bias = None if qkv_bias else nn.Parameter(torch.zeros(mlp_hidden))
        self._init_heads(num_heads, self._head_dim(dim, num_heads), attn_drop, qk_norm)
        self._init_layer(layer)
        self.mlp_drop = Dropout(proj_drop)
        self.mlp_act = act_layer()
        self._init_out(dim, mlp_hidden, proj_bias)
        self.ls, self.drop_path = scale_and_drop(dim, init_values, drop_path)

    def reset_parameters(self) -> None:
        if self.mlp_bias is not None:
            nn.init.zeros_(self.mlp_bias)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # -> hidden (B, N, Dm), q, k, v in heads
        hidden, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.mlp_bias
        return (hidden, *self._heads(q, k, v))

    def forward(
        self,
        x: torch.Tensor,
        rows: int | None = None,
        attn_mask: torch.Tensor | None = None,
        rope: None = None,  # (config.py refuses RoPE here)
    ) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        hidden, q, k, v = self._project(x)
        if rows is not None:
            x, hidden = x[:, :rows], hidden[:, :rows]
        y = self._out(self._attend(q, k, v, rows, attn_mask), self.mlp_drop(self.mlp_act(hidden)))
        return x + self.drop_path(self.ls(y))

    def attention_map(self, x: torch.Tensor, rope: None = None) -> torch.Tensor:
        _, q, k, _ = self._project(x)
        return self._map(q, k)


class ParallelScalingBlock(_Softmax, _ParallelScaling):
    """timm's ParallelScalingBlock: softmax attention; x + ls(attn_out_proj(attention) + mlp_out_proj(act(hidden)))."""

    @staticmethod
    def _head_dim(dim: int, num_heads: int) -> int:
        return dim // num_heads

    def _init_layer(self, layer: int) -> None:  # nothing depends on the block's index
        pass

    def _init_out(self, dim: int, hidden: int, bias: bool) -> None:
        self.attn_out_proj = nn.Linear(dim, dim, bias=bias)
        self.mlp_out_proj = nn.Linear(hidden, dim, bias=bias)

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads = (self.num_heads, self.head_dim)  # each (B, N, D) -> (B, H, N, Dh)
        q = self.q_norm(q.unflatten(-1, heads)).transpose(1, 2)
        k = self.k_norm(k.unflatten(-1, heads)).transpose(1, 2)
        return q, k, v.unflatten(-1, heads).transpose(1, 2)

    def _out(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self.attn_out_proj(attn) + self.mlp_out_proj(mlp)


class DiffParallelScalingBlock(_Differential, _ParallelScaling):
    """timm's DiffParallelScalingBlock: differential attention; x + ls(out_proj([attention, act(hidden)]))."""

    @staticmethod
    def _head_dim(dim: int, num_heads: int) -> int:  # q and k halves; v keeps the full head width
        return dim // num_heads // 2

    def _init_layer(self, layer: int) -> None:
        self._init_differential(layer)

    def _init_out(self, dim: int, hidden: int, bias: bool) -> None:
        self.out_proj = nn.Linear(dim + hidden, dim, bias=bias)

    def _out(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.cat([attn, mlp], dim=-1))


BLOCKS = {
    "block": Block,
    "parallel_scaling": ParallelScalingBlock,
    "diff_parallel_scaling": DiffParallelScalingBlock,
    "res_post": ResPostBlock,
    "parallel_things": ParallelThingsBlock,
    "eva": EvaBlock,
}
