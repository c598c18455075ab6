"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021).

Reads top to bottom: position-embedding helpers -> the component tables a config picks from
(ACTIVATIONS, NORMS, POOLS) -> attention -> MLPs (MLPS) -> blocks (BLOCKS) -> attention pool -> patch
embedding -> the model. Parameter names are timm's, so timm checkpoints load as they are; the computation
follows timm's order of operations, so logits agree with timm's bit for bit on CPU in fp32.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim, P patch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vitlab.model.config import ViTConfig

# ---- position embeddings --------------------------------------------------------------------------


def posemb_sincos_2d(grid_size: tuple[int, int], dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding as big_vision's `posemb_sincos_2d`: (1, H*W, dim)."""
    h, w = grid_size
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    omega = torch.arange(dim // 4, dtype=torch.float32) / max(dim // 4 - 1, 1)
    omega = 1.0 / temperature**omega
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)[None]


def resample_pos_embed(
    posemb: torch.Tensor,  # (1, prefix + h*w, D)
    new_size: Sequence[int],
    old_size: Sequence[int] | None = None,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Resample the patch rows of a position embedding to a new grid (bicubic, antialiased, in fp32),
    keeping the prefix rows, exactly as timm's `resample_abs_pos_embed`. `old_size` defaults to square."""
    new_size = (int(new_size[0]), int(new_size[1]))
    n_old = posemb.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(n_old)
        if side * side != n_old:
            raise ValueError(f"pos_embed has {n_old} patch rows, not a square grid; give its grid size")
        old_size = (side, side)
    old_size = (int(old_size[0]), int(old_size[1]))
    if old_size == new_size:
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim = posemb.shape[-1]
    grid = grid.float().reshape(1, *old_size, dim).permute(0, 3, 1, 2)  # (1, D, h, w)
    grid = F.interpolate(grid, size=new_size, mode="bicubic", antialias=True)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(posemb.dtype)
    return torch.cat([prefix, grid], dim=1) if num_prefix_tokens else grid


# ---- layers ----------------------------------------------------------------------------------------


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


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop the whole residual branch per sample."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class LayerScale(nn.Module):
    """Per-channel residual scaling (CaiT, Touvron et al. 2021)."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection and SDPA (flash/mem-efficient kernels)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        dim = cfg.embed_dim
        self.num_heads = cfg.num_heads
        self.head_dim = dim // cfg.num_heads
        self.scale = self.head_dim**-0.5  # SDPA's default scale too
        self.attn_drop = cfg.attn_drop_rate
        self.qkv = nn.Linear(dim, 3 * dim, bias=cfg.qkv_bias)  # rows ordered q; k; v
        self.q_norm = norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.norm = norm(cfg, dim) if cfg.scale_attn_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=cfg.proj_bias)
        self.proj_drop = nn.Dropout(cfg.proj_drop_rate)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, Dh), views: no copy
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        """With `rows`, only the first `rows` tokens query (every token is still a key and value)."""
        B, N, D = x.shape
        q, k, v = self._qkv(x)
        if rows is not None:
            q = q[:, :, :rows]  # (B, H, rows, Dh)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, -1, D)
        return self.proj_drop(self.proj(self.norm(x)))

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(Dh)): (B, H, N, N), rows summing to 1. For visualisation only; the
        forward pass never materialises it."""
        q, k, _ = self._qkv(x)
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


class _MlpOutput(nn.Module):
    """What every MLP ends with: activation, dropout, the optional hidden norm (scale_mlp_norm), fc2, dropout,
    registered in timm's order (so state-dict keys list as timm's)."""

    def _output_layers(self, cfg: ViTConfig, hidden: int) -> None:
        self.act = ACTIVATIONS[cfg.act_layer]()
        self.drop1 = nn.Dropout(cfg.proj_drop_rate)
        self.norm = norm(cfg, hidden) if cfg.scale_mlp_norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, cfg.embed_dim, bias=cfg.proj_bias)
        self.drop2 = nn.Dropout(cfg.proj_drop_rate)

    def _output(self, h: torch.Tensor) -> torch.Tensor:  # hidden features, activated -> (B, N, D)
        return self.drop2(self.fc2(self.norm(self.drop1(h))))


class Mlp(_MlpOutput):
    """fc1 -> activation -> fc2 (the paper's MLP; GELU unless the config names another)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden, bias=cfg.proj_bias)
        self._output_layers(cfg, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._output(self.act(self.fc1(x)))


class SwiGLU(_MlpOutput):
    """Gated MLP (Shazeer 2020): act(fc1_g x) * fc1_x x -> fc2, timm's `SwiGLU`."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1_g = nn.Linear(cfg.embed_dim, hidden, bias=cfg.proj_bias)
        self.fc1_x = nn.Linear(cfg.embed_dim, hidden, bias=cfg.proj_bias)
        self._output_layers(cfg, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._output(self.act(self.fc1_g(x)) * self.fc1_x(x))


class SwiGLUPacked(_MlpOutput):
    """The gated MLP with one fc1 whose output halves are (gate, value): act(gate) * value -> fc2 of half
    the width, timm's `SwiGLUPacked` (DINOv2 giant)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden, bias=cfg.proj_bias)
        self._output_layers(cfg, hidden // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self._output(self.act(gate) * value)


MLPS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked}


class Block(nn.Module):
    """Pre-norm encoder block (paper Eq. 2-3): x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, cfg: ViTConfig, drop_path: float):
        super().__init__()
        dim = cfg.embed_dim
        self.norm1 = norm(cfg, dim)
        self.attn = Attention(cfg)
        self.ls1 = LayerScale(dim, cfg.init_values) if cfg.init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(cfg, dim)
        self.mlp = MLPS[cfg.mlp_layer](cfg)
        self.ls2 = LayerScale(dim, cfg.init_values) if cfg.init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        """With `rows`, only the first `rows` tokens are updated and returned: a class-token head reads
        one row of the last block, and every other row's attention query, projection and MLP is waste."""
        shortcut = x if rows is None else x[:, :rows]
        x = shortcut + self.drop_path1(self.ls1(self.attn(self.norm1(x), rows)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.attention_map(self.norm1(x))


class ParallelScalingBlock(nn.Module):
    """Attention and MLP in parallel from one norm and one input projection (ViT-22B, Dehghani et al.
    2023; timm's ParallelScalingBlock): in_proj yields the MLP's hidden features and q, k, v at once, and
    x + ls(attn_out_proj(attention) + mlp_out_proj(act(hidden))). Without qkv_bias the MLP keeps a bias
    of its own (mlp_bias)."""

    def __init__(self, cfg: ViTConfig, drop_path: float):
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
        B, N, D = x.shape
        hidden, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.mlp_bias
        heads = (B, N, self.num_heads, self.head_dim)
        q = self.q_norm(q.view(heads)).transpose(1, 2)
        k = self.k_norm(k.view(heads)).transpose(1, 2)
        return hidden, q, k, v.view(heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:  # (B, N, D) -> (B, rows or N, D)
        B, N, D = x.shape
        hidden, q, k, v = self._project(x)
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        attn = attn.transpose(1, 2).reshape(B, N, D)
        y = self.attn_out_proj(attn) + self.mlp_out_proj(self.mlp_drop(self.mlp_act(hidden)))
        x = x + self.drop_path(self.ls(y))
        return x if rows is None else x[:, :rows]

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        _, q, k, _ = self._project(x)
        return ((q * self.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)


BLOCKS = {"block": Block, "parallel_scaling": ParallelScalingBlock}


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, D)
        B, N, D = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, D)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class PatchEmbed(nn.Module):
    """Non-overlapping PxP patches, linearly projected (paper Eq. 1) as one strided convolution. With
    `dynamic_img_pad` an input is first zero-padded on the right and bottom to a multiple of P (timm's)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        p = self.patch_size = cfg.patch_size
        self.dynamic_img_pad = cfg.dynamic_img_pad
        self.proj = nn.Conv2d(cfg.in_chans, cfg.embed_dim, kernel_size=p, stride=p, bias=not cfg.pre_norm)
        self.norm = norm(cfg, cfg.embed_dim) if cfg.embed_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, ceil(H/P), ceil(W/P), D)
        if self.dynamic_img_pad:
            p, (H, W) = self.patch_size, x.shape[-2:]
            x = F.pad(x, (0, (p - W % p) % p, 0, (p - H % p) % p))
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


# ---- the model -------------------------------------------------------------------------------------


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.embed_dim
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.grad_checkpointing = False

        # Registration order matches timm's, so state_dict() lists keys in the same order.
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        if cfg.pos_embed == "learn":
            rows = cfg.num_patches + (cfg.num_prefix_tokens if cfg.embeds_prefix else 0)
            self.pos_embed = nn.Parameter(torch.zeros(1, rows, D))
        elif cfg.pos_embed == "sincos2d":  # fixed: a buffer (nothing to train), saved under timm's key
            self.register_buffer("pos_embed", posemb_sincos_2d(cfg.grid_size, D))
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.norm_pre = norm(cfg, D) if cfg.pre_norm else nn.Identity()
        # Stochastic depth grows linearly with depth (timm's torch.linspace, float32 included).
        dpr = torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu").tolist()
        self.blocks = nn.Sequential(*[BLOCKS[cfg.block_fn](cfg, dpr[i]) for i in range(cfg.depth)])
        self.norm = norm(cfg, D) if cfg.final_norm and not cfg.use_fc_norm else nn.Identity()
        self.attn_pool = AttentionPool(cfg) if cfg.global_pool == "map" else None
        self.fc_norm = norm(cfg, D) if cfg.final_norm and cfg.use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()

        self.init_weights()
        self.register_load_state_dict_pre_hook(_resample_pos_embed_on_load)

    # ---- initialisation --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """timm's default scheme ('': truncated normal 0.02 for every Linear, zero biases, PyTorch's
        default for the patch conv) or big_vision's ('jax': Xavier-uniform Linears, LeCun-normal
        patch conv, zero head)."""
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for tok in (self.cls_token, self.reg_token):
            if tok is not None:
                nn.init.normal_(tok, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.cfg.embed_dim**-0.5)
        jax = self.cfg.weight_init == "jax"
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if jax and name == "head":
                    nn.init.zeros_(m.weight)
                    nn.init.zeros_(m.bias)
                    continue
                if jax:
                    nn.init.xavier_uniform_(m.weight)
                else:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    if jax and ".mlp." in f".{name}":
                        nn.init.normal_(m.bias, std=1e-6)
                    else:
                        nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d) and jax:
                # LeCun normal: truncated at 2 std, corrected so the variance is 1/fan_in.
                fan_in = m.weight[0].numel()
                nn.init.trunc_normal_(m.weight, std=1.0, a=-2.0, b=2.0)
                m.weight.mul_(math.sqrt(1.0 / fan_in) / 0.87962566103423978)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ---- timm's model API (what timm.optim, timm.data and timm users call) ----------------------
    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    @property
    def num_features(self) -> int:  # width of forward_features' tokens and of the pooled features
        return self.cfg.embed_dim

    head_hidden_size = num_features  # no pre-logits layer: the head sees the pooled features

    @property
    def feature_info(self) -> list[dict]:
        """Every block's output as timm describes it: module name, channels, stride in pixels."""
        return [
            dict(module=f"blocks.{i}", num_chs=self.cfg.embed_dim, reduction=self.cfg.patch_size)
            for i in range(self.cfg.depth)
        ]

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth, as timm's: the embeddings, then each block, then the rest (timm.optim's
        layer-wise learning-rate decay reads this)."""
        return dict(
            stem=r"^cls_token|pos_embed|patch_embed|reg_token", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]
        )

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for `num_classes` (0: none, forward returns pooled features), and optionally another
        pooling; the rest of the model is kept. The config follows, so checkpoints record the change."""
        changes: dict = {"num_classes": num_classes}
        if global_pool is not None:
            if (global_pool == "map") != (self.attn_pool is not None):
                raise ValueError("reset_classifier cannot add or remove the attention pool ('map'); build a new model")
            # the norms stay as built (timm's too): pin fc_norm so the config still describes this model
            changes.update(global_pool=global_pool, fc_norm=self.cfg.use_fc_norm)
        self.cfg = self.cfg.replace(**changes)
        device = next(self.parameters()).device
        self.head = nn.Linear(self.cfg.embed_dim, num_classes, device=device) if num_classes > 0 else nn.Identity()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.grad_checkpointing = enable

    # ---- forward ---------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, N, D): patches, prefix tokens, position embedding."""
        H, W = x.shape[-2:]
        if not self.cfg.dynamic_img_size and (H, W) != self.cfg.img_hw:
            raise ValueError(
                f"input size {H}x{W} does not match img_size {self.cfg.img_hw}; "
                "resize the input or build the model with dynamic_img_size=true"
            )
        P = self.cfg.patch_size
        if (H % P or W % P) and not self.cfg.dynamic_img_pad:  # the strided conv would drop the remainder
            raise ValueError(
                f"input size {H}x{W} is not a multiple of patch_size {P}; crop or resize it, or build the "
                "model with dynamic_img_pad=true to pad it"
            )
        x = self.patch_embed(x)  # (B, h, w, D)
        B, h, w, D = x.shape
        x = x.reshape(B, h * w, D)
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        pos = self._pos_embed_for((h, w))
        if pos is None:
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        elif self.cfg.embeds_prefix:  # original ViT: rows for the prefix tokens too; concat then add
            x = torch.cat(prefix + [x], dim=1) if prefix else x
            x = x + pos
        else:  # patches only (DeiT-III, big_vision): add then concat
            x = x + pos
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        return self.norm_pre(self.pos_drop(x))

    def _pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor | None:
        if self.pos_embed is None or grid == self.cfg.grid_size:
            return self.pos_embed
        if self.cfg.pos_embed == "sincos2d":
            return posemb_sincos_2d(grid, self.cfg.embed_dim).to(self.pos_embed)
        prefix = self.num_prefix_tokens if self.cfg.embeds_prefix else 0
        return resample_pos_embed(self.pos_embed, grid, self.cfg.grid_size, prefix)

    def forward_features(self, x: torch.Tensor, last_rows: int | None = None) -> torch.Tensor:
        """Images -> final normed tokens (B, N, D); with `last_rows`, the last block computes and returns
        only the first `last_rows` tokens (B, last_rows, D)."""
        x = self.embed(x)
        ckpt = self.grad_checkpointing and torch.is_grad_enabled()
        for i, blk in enumerate(self.blocks):
            rows = last_rows if i == len(self.blocks) - 1 else None
            x = checkpoint(blk, x, rows, use_reentrant=False) if ckpt else blk(x, rows)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, D) -> logits (B, K); pooled features (B, D) with pre_logits."""
        pool = self.cfg.global_pool
        if pool == "token":
            x = x[:, 0]
        elif pool:  # over the patch tokens (timm's global_pool_nlc), or every token with pool_include_prefix
            tokens = x if self.cfg.pool_include_prefix else x[:, self.num_prefix_tokens :]
            x = self.attn_pool(tokens) if pool == "map" else POOLS[pool](tokens)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A class-token head reads row 0 only: the last block skips the other N - 1 rows' work, about
        # 3/4 of a block (the same logits as timm's to ~1e-6; experiments/throughput).
        rows = 1 if self.cfg.global_pool == "token" else None
        return self.forward_head(self.forward_features(x, last_rows=rows))

    # ---- looking inside --------------------------------------------------------------------------
    def forward_intermediates(self, x: torch.Tensor, layers: Sequence[int | str] = (-1,)) -> dict[str, torch.Tensor]:
        """Named intermediate outputs. `layers` holds block indices (negative count from the end) or
        names: 'patch_embed' (B, h*w, D) before prefix tokens and position embedding, 'embed' (B, N, D)
        the blocks' input, 'blocks.<i>', 'norm' (the final features). Stops after the last one asked."""
        depth = len(self.blocks)
        wanted: list[str] = []
        for layer in layers:
            if isinstance(layer, int):
                if not -depth <= layer < depth:
                    raise ValueError(f"block index {layer} out of range for depth {depth}")
                layer = f"blocks.{layer % depth}"
            valid = {"patch_embed", "embed", "norm"} | {f"blocks.{i}" for i in range(depth)}
            if layer not in valid:
                raise ValueError(f"unknown layer {layer!r}; use 'patch_embed', 'embed', 'blocks.<i>' or 'norm'")
            wanted.append(layer)
        out: dict[str, torch.Tensor] = {}
        if "patch_embed" in wanted:
            out["patch_embed"] = self.patch_embed(x).flatten(1, 2)
        x = self.embed(x)
        out["embed"] = x
        last = max(
            [int(n.split(".")[1]) for n in wanted if n.startswith("blocks.")] + [depth - 1 if "norm" in wanted else -1]
        )
        for i, blk in enumerate(self.blocks[: last + 1]):
            x = blk(x)
            out[f"blocks.{i}"] = x
        if "norm" in wanted:
            out["norm"] = self.norm(x)
        return {name: out[name] for name in wanted}

    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every block's attention probabilities, [(B, H, N, N)] * depth (dropout off)."""
        maps = []
        x = self.embed(x)
        for blk in self.blocks:
            maps.append(blk.attention_map(x))
            x = blk(x)
        return maps


def _resample_pos_embed_on_load(module: ViT, state_dict: dict, prefix: str, *args) -> None:
    """Weights trained at another resolution: resample their pos_embed to this model's grid (as
    timm's checkpoint filter does), or take this model's own fixed sin-cos table."""
    key = prefix + "pos_embed"
    if key not in state_dict or module.pos_embed is None:
        return
    theirs, ours = state_dict[key], module.pos_embed
    if theirs.shape == ours.shape or theirs.ndim != 3 or theirs.shape[-1] != ours.shape[-1]:
        return  # same grid, or a mismatch that load_state_dict reports itself
    if module.cfg.pos_embed == "sincos2d":
        state_dict[key] = ours.detach().clone()
        return
    n_prefix = module.num_prefix_tokens if module.cfg.embeds_prefix else 0
    state_dict[key] = resample_pos_embed(theirs, module.cfg.grid_size, None, n_prefix)
