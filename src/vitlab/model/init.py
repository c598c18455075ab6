"""Weight initialisation: timm's `weight_init` schemes, one table (WEIGHT_INITS, config.py's weight_init).

A scheme initialises a built ViT in place. '' (timm's), 'jax' / 'jax_nlhb' (big_vision's) and 'moco' (MoCo v3's)
start the position embedding and prefix tokens as timm does, then apply their rule to every Linear/Conv2d
(by its module path); 'mae' is MAE's (models_mae.py initialize_weights, with main_finetune.py's head); 'skip' keeps
what PyTorch's constructors drew, with zero tokens and position embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from vitlab.model.config import ViTConfig


def _lecun_normal_(w: torch.Tensor) -> None:
    """Truncated at 2 std, corrected so the variance is 1/fan_in (JAX's lecun_normal)."""
    nn.init.trunc_normal_(w, std=1.0, a=-2.0, b=2.0)
    w.mul_(math.sqrt(1.0 / w[0].numel()) / 0.87962566103423978)


def log_prior_head_bias_(head: nn.Linear, num_classes: int) -> None:
    """Head bias -log(K): every class starts improbable, each logit's sigmoid at ~1/K ('jax_nlhb' below;
    big_vision's head_bias_init, -6.9 for 1,000 classes, for a sigmoid loss)."""
    nn.init.constant_(head.bias, -math.log(num_classes))


# ---- the rules, per layer (name is the module's path in the model) -------------------------------------


def _timm_rule(name: str, m: nn.Module, cfg: ViTConfig) -> None:  # truncated normal 0.02, zero biases
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def _jax_rule(name: str, m: nn.Module, cfg: ViTConfig) -> None:
    """big_vision's: Xavier-uniform Linears (MLP biases ~1e-6), LeCun-normal patch conv, zero head whose bias is
    -log(num_classes) with 'jax_nlhb' (start from uniform class probabilities)."""
    if isinstance(m, nn.Linear) and name.startswith("head"):
        nn.init.zeros_(m.weight)
        log_prior_head_bias_(m, cfg.num_classes) if cfg.weight_init == "jax_nlhb" else nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.normal_(m.bias, std=1e-6) if "mlp" in name else nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        _lecun_normal_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def _moco_rule(name: str, m: nn.Module, cfg: ViTConfig) -> None:
    """MoCo v3's: Xavier-uniform Linears, with q, k and v's fan counted separately in the fused qkv."""
    if isinstance(m, nn.Linear):
        if "qkv" in name:
            bound = math.sqrt(6.0 / (m.weight.shape[0] // 3 + m.weight.shape[1]))
            nn.init.uniform_(m.weight, -bound, bound)
        else:
            nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def _mae_rule(name: str, m: nn.Module, cfg: ViTConfig) -> None:
    """MAE's: Xavier-uniform Linears (the fused qkv as one matrix) with zero biases, the patch projection as a Linear
    (Xavier on its flattened (D, C*P*P) weight; the bias PyTorch's), LayerNorms 1 and 0; a head as main_finetune.py
    leaves it: trunc-normal 2e-5, zero bias."""
    if isinstance(m, nn.Linear) and name.startswith("head"):
        nn.init.trunc_normal_(m.weight, std=2e-5)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
        if m.bias is not None:  # models_mae.py leaves the conv's bias as nn.Conv2d drew it
            bound = 1.0 / math.sqrt(m.weight[0].numel())
            nn.init.uniform_(m.bias, -bound, bound)
    elif isinstance(m, nn.LayerNorm) and m.weight is not None:
        nn.init.ones_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


# ---- the schemes, per model ----------------------------------------------------------------------------


@torch.no_grad()
def _scheme(rule: Callable[[str, nn.Module, ViTConfig], None], model: nn.Module) -> None:
    """timm's init_weights: position embedding trunc-normal 0.02, prefix tokens normal 1e-6, the attention pool's
    latent query trunc-normal D^-0.5; `rule` for every layer (PyTorch's default for a layer it skips, such as
    the patch conv under ''); with fix_init, deeper blocks write smaller residuals (timm's fix_init_weight)."""
    cfg = model.cfg
    if model.dist_token is not None:  # first, as timm's VisionTransformerDistilled draws it
        nn.init.trunc_normal_(model.dist_token, std=0.02)
    if isinstance(model.pos_embed, nn.Parameter):
        nn.init.trunc_normal_(model.pos_embed, std=0.02)
    for tok in (model.cls_token, model.reg_token):
        if tok is not None:
            nn.init.normal_(tok, std=1e-6)
    if model.attn_pool is not None:
        nn.init.trunc_normal_(model.attn_pool.latent, std=cfg.embed_dim**-0.5)
    for name, m in model.named_modules():
        rule(name, m, cfg)
    if cfg.fix_init:
        for i, blk in enumerate(model.blocks):
            blk.attn.proj.weight.div_(math.sqrt(2.0 * (i + 1)))
            blk.mlp.fc2.weight.div_(math.sqrt(2.0 * (i + 1)))


@torch.no_grad()
def _mae_scheme(model: nn.Module) -> None:
    """MAE's: its rule on every layer, and N(0, 0.02) prefix tokens (models_mae.py: normal_, its comment says
    timm's trunc_normal_ at 2 std is the same); a learned pos_embed starts as timm's (MAE's is a fixed table)."""
    _scheme(_mae_rule, model)
    for tok in (model.cls_token, model.reg_token, model.dist_token):
        if tok is not None:
            nn.init.normal_(tok, std=0.02)


def _pytorch_default(model: nn.Module) -> None:
    """'skip': every layer keeps what its PyTorch constructor drew; tokens and position embedding stay zero."""


WEIGHT_INITS: dict[str, Callable[[nn.Module], None]] = {
    "": partial(_scheme, _timm_rule),
    "jax": partial(_scheme, _jax_rule),
    "jax_nlhb": partial(_scheme, _jax_rule),
    "moco": partial(_scheme, _moco_rule),
    "mae": _mae_scheme,
    "skip": _pytorch_default,
}


def init_weights(model: nn.Module) -> None:
    """Initialise a ViT in place by its config's scheme (`cfg.weight_init`)."""
    WEIGHT_INITS[model.cfg.weight_init](model)
