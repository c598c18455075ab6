"""DINO's projection head (facebookresearch/dino vision_transformer.py DINOHead; dinov2 layers/dino_head.py): an MLP
of `nlayers` Linear layers (GELU between, hidden 2,048, to a 256-wide bottleneck), the bottleneck L2-normalised, then
a weight-normalised Linear to `out_dim` prototypes without bias. Its parameter names are the references' (`mlp.0`,
`mlp.2`, `mlp.4`, `last_layer.weight_g`, `last_layer.weight_v`: torch's old weight_norm), so their checkpoints load.
No Lightning or Hydra here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WeightNormLinear(nn.Module):
    """`torch.nn.utils.weight_norm(nn.Linear(in_dim, out_dim, bias=False))` as DINO builds it: weight = g * v / ||v||,
    the norm of each output row; g starts at 1. `norm_last_layer`: g stays 1 (not trained)."""

    def __init__(self, in_dim: int, out_dim: int, train_g: bool = True):
        super().__init__()
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=train_g)
        self.weight_v = nn.Parameter(torch.empty(out_dim, in_dim))
        bound = 1 / in_dim**0.5  # nn.Linear's default init, which DINO's head keeps for this layer
        nn.init.uniform_(self.weight_v, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.weight_v
        return F.linear(x, v * (self.weight_g / torch.linalg.vector_norm(v, dim=1, keepdim=True)))


class DINOHead(nn.Module):
    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        nlayers: int = 3,
        norm_last_layer: bool = True,
    ):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            layers: list[nn.Module] = [nn.Linear(in_dim, bottleneck_dim)]
        else:
            layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
            for _ in range(nlayers - 2):
                layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp:
            if isinstance(m, nn.Linear):  # DINO's _init_weights
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim, train_g=not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        eps = 1e-6 if x.dtype == torch.float16 else 1e-12  # dinov2's (DINO's F.normalize default: 1e-12)
        return self.last_layer(F.normalize(x, dim=-1, p=2, eps=eps))
