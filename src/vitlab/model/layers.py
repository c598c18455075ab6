"""The layers a ViT is built from, one table per config choice: norms (NORMS), activations (ACTIVATIONS),
poolings (POOLS), MLPs (MLPS), plus stochastic depth, patch dropout, LayerScale and the patch embedding; attention
(ATTENTIONS) and the attention pool are in attention.py. Parameter names are timm's.
Shapes: B batch, N tokens (prefix + patches), D embed_dim, H heads, Dh head dim, P patch size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.model.draws import DrawSite, Dropout, random_order, rows_for, uniform

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


NormLayer = Callable[[int], nn.Module]  # dim -> a norm over the last axis (timm's and dinov2's `norm_layer`)


def norm_layer(name: str, eps: float) -> NormLayer:
    """The norm a config names (NORMS) with its epsilon, as a `norm_layer` the layers call with their width."""
    return partial(NORMS[name], eps=eps)


def optional_norm(layer: NormLayer | None, dim: int) -> nn.Module:
    """`layer(dim)`, or an identity where a norm is switched off (None), as timm's `norm_layer(dim) if ... else
    nn.Identity()`."""
    return layer(dim) if layer is not None else nn.Identity()


# ---- regularisation and residual scaling -----------------------------------------------------------


class DropPath(DrawSite):
    """Stochastic depth (Huang et al. 2016): drop the whole residual branch per sample. The keep probability is a
    float64 scalar tensor (a non-persistent buffer, recomputed from `p` after every move or cast), not a Python float:
    the same draws, and every block's rate is an input of a compiled block rather than a constant of it, so
    compile=regional's blocks share one graph whatever their rates. Within `drawn_by_rows`, each sample's draw is
    its row's of the global batch."""

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
        rows = rows_for(x.shape[0])
        if rows is not None:
            # views of the batch stacked view after view (multi-crop: m of them): each view's rows of its global batch
            # (keyed by m and the shape: each kind of view its own)
            drawn = uniform((x.shape[0],), rows, (x.shape[0] // rows.count, *x.shape[1:]), x.device, self.site_key)
            mask = (drawn < self.keep).to(x.dtype)
            return x * mask.view(-1, *(1,) * (x.ndim - 1)).div_(self.keep)
        mask = x.new_empty(x.shape[0], 1, 1).bernoulli_(self.keep)  # tokens (B, N, D): one draw per sample
        return x * mask.div_(self.keep)


def stochastic_depth(p: float) -> nn.Module:
    return DropPath(p) if p > 0 else nn.Identity()


class PatchDropout(DrawSite):
    """In training, keep a random max(1, int(L * (1 - p))) of the L patch tokens of each image, prefix tokens
    always (Li et al. 2023, FLIP; timm's PatchDropout, unordered). A draw site: within `drawn_by_rows` each image's
    patches are its row's (model/draws.py `random_order`)."""

    def __init__(self, p: float, num_prefix_tokens: int):
        super().__init__()
        self.p, self.num_prefix_tokens = p, num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, prefix + L, D) -> (B, prefix + kept, D)
        return _drop_patches(x, self.p, self.num_prefix_tokens, self.site_key)[0] if self.training else x

    def forward_with_kept(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In training: the tokens and the indices of the kept patches (B, kept) (a RoPE table follows them)."""
        return _drop_patches(x, self.p, self.num_prefix_tokens, self.site_key)


@torch.fx.wrap  # the kept count comes from the input's shape
def _drop_patches(x: torch.Tensor, p: float, num_prefix: int, site: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    prefix, x = x[:, :num_prefix], x[:, num_prefix:]
    L = x.shape[1]
    keep = random_order(x.shape[0], L, x.device, site=site)[:, : max(1, int(L * (1.0 - p)))]
    x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([prefix, x], dim=1), keep


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


def scale_and_drop(dim: int, init_values: float | None, drop_path: float) -> tuple[nn.Module, nn.Module]:
    """How a residual branch ends in every block: LayerScale (init_values) and stochastic depth, each an
    identity when switched off; assigned as the block's `ls` and `drop_path` (timm's names)."""
    ls = LayerScale(dim, init_values) if init_values else nn.Identity()
    return ls, stochastic_depth(drop_path)


# ---- MLPs --------------------------------------------------------------------------------------------


class _Mlp(nn.Module):
    """What every MLP shares (timm's Mlp arguments): its input layers (passed in, so that they register first, as
    timm's), then activation, dropout, the optional norm of the hidden features (`norm_layer`, BEiT-3's
    scale_mlp_norm), fc2 back to `dim` and dropout. A subclass makes the activated hidden features (`_hidden`)."""

    def __init__(
        self,
        dim: int,
        inputs: dict[str, nn.Module],
        hidden: int,
        act_layer: Callable[[], nn.Module],
        norm_layer: NormLayer | None,
        bias: bool,
        drop: float,
    ):
        super().__init__()
        for name, layer in inputs.items():
            self.add_module(name, layer)
        self.act = act_layer()
        self.drop1 = Dropout(drop)
        self.norm = optional_norm(norm_layer, hidden)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop2 = Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        return self.drop2(self.fc2(self.norm(self.drop1(self._hidden(x)))))


class Mlp(_Mlp):
    """fc1 -> activation -> fc2 (the paper's MLP; GELU unless the config names another). `hidden`: fc1's width."""

    def __init__(self, dim: int, hidden: int, *, act_layer=nn.GELU, norm_layer=None, bias=True, drop=0.0):
        fc1 = nn.Linear(dim, hidden, bias=bias)
        super().__init__(dim, dict(fc1=fc1), hidden, act_layer, norm_layer, bias, drop)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x))


class SwiGLU(_Mlp):
    """Gated MLP (Shazeer 2020): act(fc1_g x) * fc1_x x -> fc2, timm's `SwiGLU`."""

    def __init__(self, dim: int, hidden: int, *, act_layer=nn.GELU, norm_layer=None, bias=True, drop=0.0):
        fc1_g, fc1_x = nn.Linear(dim, hidden, bias=bias), nn.Linear(dim, hidden, bias=bias)
        super().__init__(dim, dict(fc1_g=fc1_g, fc1_x=fc1_x), hidden, act_layer, norm_layer, bias, drop)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1_g(x)) * self.fc1_x(x)


class SwiGLUPacked(_Mlp):
    """The gated MLP with one fc1 whose output halves are (gate, value): act(gate) * value -> fc2 of half
    the width, timm's `SwiGLUPacked` (DINOv2 giant)."""

    def __init__(self, dim: int, hidden: int, *, act_layer=nn.GELU, norm_layer=None, bias=True, drop=0.0):
        fc1 = nn.Linear(dim, hidden, bias=bias)
        super().__init__(dim, dict(fc1=fc1), hidden // 2, act_layer, norm_layer, bias, drop)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.act(gate) * value


MLPS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked}  # config.py: mlp_layer; (dim, hidden, ...)

# ---- the patch embedding ------------------------------------------------------


class PatchEmbed(nn.Module):
    """Non-overlapping PxP patches, linearly projected (paper Eq. 1) as one strided convolution. With
    `dynamic_img_pad` an input is first zero-padded on the right and bottom to a multiple of P (timm's)."""

    def __init__(
        self,
        img_size: tuple[int, int],
        patch_size: tuple[int, int],
        in_chans: int,
        embed_dim: int,
        *,
        bias: bool = True,
        norm_layer: NormLayer | None = None,
        dynamic_img_pad: bool = False,
    ):
        super().__init__()
        p = self.patch_size = patch_size
        self.img_size = img_size
        self.grid_size = (img_size[0] // p[0], img_size[1] // p[1])  # timm's: its checkpoint filter reads the grid
        self.dynamic_img_pad = dynamic_img_pad
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=p, stride=p, bias=bias)
        self.norm = optional_norm(norm_layer, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, ceil(H/P), ceil(W/P), D)
        if self.dynamic_img_pad:
            (ph, pw), H, W = self.patch_size, x.shape[-2], x.shape[-1]
            x = F.pad(x, (0, (pw - W % pw) % pw, 0, (ph - H % ph) % ph))
        return self.norm(self.proj(x).permute(0, 2, 3, 1))
