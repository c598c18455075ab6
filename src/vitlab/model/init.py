"""Weight initialisation: timm's `weight_init` schemes, one table (WEIGHT_INITS, config.py's weight_init).

`init_weights` sets every parameter and buffer of a ViT: each layer reset to PyTorch's defaults (our layers' own
`reset_parameters`), the position embedding and prefix tokens started as timm does, then the scheme's rule for every
Linear/Conv2d (by its module path): '' (timm's), 'jax' / 'jax_nlhb' (big_vision's), 'moco' (MoCo v3's), 'mae'
(MAE's models_mae.py initialize_weights, with main_finetune.py's head); 'skip' keeps PyTorch's defaults, with zero
tokens and position embedding. The constructor builds on the meta device and runs it, so a model built there and
materialised with `to_empty` is initialised by the same call, to the same values for the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

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


def _eva_rule(name: str, m: nn.Module, cfg: ViTConfig) -> None:
    """timm's Eva's: trunc-normal 0.02 Linears with zero biases, the head's then scaled by its head_init_scale 0.001
    (the class and register tokens trunc-normal 0.02 too, in _init_root; fix_init, which Eva always applies, is the
    config's own switch)."""
    _timm_rule(name, m, cfg)
    if isinstance(m, nn.Linear) and name == "head":
        m.weight.mul_(EVA_HEAD_INIT_SCALE)
        m.bias.mul_(EVA_HEAD_INIT_SCALE)


EVA_HEAD_INIT_SCALE = 0.001  # timm's Eva(head_init_scale=0.001)

# ---- the schemes, per model ----------------------------------------------------------------------------
# One pass over the modules, children before their parent (a ResPost block sets its norms' weights after they are
# reset), each module's own tensors set at its turn: PyTorch's defaults (or our layer's own, `reset_parameters`), then
# the scheme's rule. The same pass initialises a model built on the host, on the meta device after `to_empty`, or one
# block at a time (training/devices/sharding.py): the same seed gives the same values, since every tensor is drawn whole
# in the same order.

WEIGHT_INITS: dict[str, Callable[[str, nn.Module, ViTConfig], None]] = {
    "": _timm_rule,
    "jax": _jax_rule,
    "jax_nlhb": _jax_rule,
    "moco": _moco_rule,
    "mae": _mae_rule,
    "eva": _eva_rule,
    "skip": lambda name, m, cfg: None,  # every layer keeps PyTorch's own initialisation
}


def walk(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name, module) as named_modules() names them, children before their parent."""
    for name, child in module.named_children():
        yield from walk(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


@torch.no_grad()
def init_module(model: nn.Module, name: str, m: nn.Module, reset: bool = True) -> None:
    """The tensors `m` (the module `name` of `model`, or a stand-in for it) holds itself, not its children's: reset,
    then the scheme."""
    cfg = model.cfg
    if name == "":
        _init_root(m)
    elif name == "attn_pool":  # its latent query (timm's AttentionPoolLatent: trunc-normal D^-0.5; skip: zero)
        skip = cfg.weight_init == "skip"
        nn.init.zeros_(m.latent) if skip else nn.init.trunc_normal_(m.latent, std=cfg.embed_dim**-0.5)
    elif reset and hasattr(m, "reset_parameters"):
        m.reset_parameters()
    WEIGHT_INITS[cfg.weight_init](name, m, cfg)
    if cfg.fix_init and name.startswith("blocks.") and name.count(".") == 1:  # deeper blocks write smaller residuals
        i = int(name.split(".")[1])
        m.attn.proj.weight.div_(math.sqrt(2.0 * (i + 1)))
        m.mlp.fc2.weight.div_(math.sqrt(2.0 * (i + 1)))


def _init_root(model: nn.Module) -> None:
    """The prefix tokens and the position embedding: a learned one trunc-normal 0.02, a fixed one computed; the class
    and register tokens normal 1e-6, DeiT's distillation token trunc-normal 0.02 (timm's); MAE's tokens N(0, 0.02)
    (models_mae.py: normal_, its comment says timm's trunc_normal_ at 2 std is the same); 'skip': zeros."""
    from vitlab.model.posemb import POS_EMBEDS

    cfg, skip = model.cfg, model.cfg.weight_init == "skip"
    if model.dist_token is not None:
        nn.init.zeros_(model.dist_token) if skip else nn.init.trunc_normal_(model.dist_token, std=0.02)
    if isinstance(model.pos_embed, nn.Parameter):
        nn.init.zeros_(model.pos_embed) if skip else nn.init.trunc_normal_(model.pos_embed, std=0.02)
    elif model.pos_embed is not None:  # fixed: the table for the current grid (the buffer holds it)
        pe = POS_EMBEDS[cfg.pos_embed](cfg.grid_size, cfg.pos_prefix_rows, cfg.embed_dim, device=model.pos_embed.device)
        model.pos_embed.copy_(pe)
    for tok in (model.cls_token, model.reg_token):
        if tok is not None:
            nn.init.zeros_(tok) if skip else nn.init.normal_(tok, std=1e-6)
    if cfg.weight_init in ("mae", "eva"):  # MAE's N(0, 0.02); timm's Eva's trunc-normal 0.02
        for tok in (model.cls_token, model.reg_token, model.dist_token):
            if tok is not None:
                (nn.init.normal_ if cfg.weight_init == "mae" else nn.init.trunc_normal_)(tok, std=0.02)


def init_weights(model: nn.Module, reset: bool = True) -> None:
    """Initialise every parameter and buffer of a ViT in place by its config's scheme (`cfg.weight_init`); without
    `reset`, the layers keep what they hold and only the scheme's rules are applied (timm's needs_reset=False)."""
    for name, m in walk(model):
        init_module(model, name, m, reset)


def init_weights_by_module(model: nn.Module, take: Callable[[nn.Module, nn.Module], None], device="cpu") -> None:
    """The values `init_weights` gives `model`, drawn one module at a time into a stand-in that holds that module's
    own tensors whole on `device` (its children are the model's), each handed to `take(module, stand_in)`: the same
    draws in the same order as a model built on the host, while only one module's tensors are ever whole here. For a
    model whose tensors are elsewhere: on the meta device, or sharded (training/devices/sharding.py keeps each process's
    shard). `take` must put the values in place before the next module, whose init may read them (fix_init)."""
    for name, m in walk(model):
        stand_in = whole_copy(m, device)
        init_module(model, name, stand_in)
        take(m, stand_in)


def whole_copy(m: nn.Module, device) -> nn.Module:
    """A shallow copy of `m` with empty whole tensors of its own parameters' and buffers' shapes and dtypes (a
    DTensor's global shape) on `device`; its children are `m`'s."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    stand_in = object.__new__(type(m))  # copy.copy would call the class's __new__ (FSDP's re-runs __init__)
    stand_in.__dict__.update(m.__dict__)
    stand_in._parameters = {
        n: None if p is None else nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for n, p in m._parameters.items()
    }
    stand_in._buffers = {n: None if b is None else empty(b) for n, b in m._buffers.items()}
    return stand_in
