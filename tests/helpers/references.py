"""Reference implementations: those vendored under tests/reference/, and MAE's (facebookresearch/mae) written
from its code."""

import importlib
import sys

import torch

from tests.helpers.commands import ROOT


def reference(repo: str, module: str):
    """A module of a reference implementation vendored verbatim under tests/reference/<repo>/ (its README: which
    commit, which license), imported as its own code imports itself (`dino`'s files are top-level modules, `dinov2` a
    package), so that a test holds vitlab to the reference's code rather than to a copy typed out here."""
    path = str(ROOT / "tests" / "reference" / repo)
    sys.path.insert(0, path)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(path)


def mae_get_2d_sincos_pos_embed(embed_dim: int, grid_size: int):
    """facebookresearch/mae util/pos_embed.py get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=True), line by
    line (np.float for np.float64): (1 + grid_size**2, embed_dim) float64."""
    import numpy as np

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])

    def get_1d(embed_dim, pos):
        omega = np.arange(embed_dim // 2, dtype=np.float64)
        omega /= embed_dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([get_1d(embed_dim // 2, grid[0]), get_1d(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


def mae_state_dict_like_maes(
    depth: int = 2, decoder_depth: int = 1, dim: int = 768, decoder_dim: int = 512, patch: int = 16, img: int = 224,
    chans: int = 3, seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """What `MaskedAutoencoderViT(...).state_dict()` of models_mae.py holds (mae_vit_base_patch16_dec512d8b's names
    and shapes at the default widths, fewer blocks): its own parameters (cls_token, pos_embed, mask_token,
    decoder_pos_embed), then patch_embed, blocks (timm 0.3.2's Block), norm, decoder_embed, decoder_blocks,
    decoder_norm, decoder_pred; random values, the two fixed tables MAE's sin-cos."""
    g = torch.Generator().manual_seed(seed)
    grid = img // patch

    def block(prefix: str, d: int) -> dict[str, tuple]:  # timm 0.3.2's Block: norm1, attn.qkv, attn.proj, norm2, mlp
        layers = {"norm1": [(d,)], "attn.qkv": [(3 * d, d), (3 * d,)], "attn.proj": [(d, d)], "norm2": [(d,)],
                  "mlp.fc1": [(4 * d, d), (4 * d,)], "mlp.fc2": [(d, 4 * d)]}  # fmt: skip
        out = {}
        for name, (weight, *bias) in layers.items():
            out |= {f"{prefix}.{name}.weight": weight, f"{prefix}.{name}.bias": bias[0] if bias else (weight[0],)}
        return out

    shapes = {"cls_token": (1, 1, dim), "pos_embed": None, "mask_token": (1, 1, decoder_dim), "decoder_pos_embed": None,
              "patch_embed.proj.weight": (dim, chans, patch, patch), "patch_embed.proj.bias": (dim,)}  # fmt: skip
    for i in range(depth):
        shapes |= block(f"blocks.{i}", dim)
    shapes |= {"norm.weight": (dim,), "norm.bias": (dim,), "decoder_embed.weight": (decoder_dim, dim)}
    shapes |= {"decoder_embed.bias": (decoder_dim,)}
    for i in range(decoder_depth):
        shapes |= block(f"decoder_blocks.{i}", decoder_dim)
    shapes |= {"decoder_norm.weight": (decoder_dim,), "decoder_norm.bias": (decoder_dim,)}
    shapes |= {
        "decoder_pred.weight": (patch * patch * chans, decoder_dim),
        "decoder_pred.bias": (patch * patch * chans,),
    }
    sd = {k: torch.randn(s, generator=g) * 0.02 if s else None for k, s in shapes.items()}
    sd["pos_embed"] = torch.from_numpy(mae_get_2d_sincos_pos_embed(dim, grid)).float()[None]
    sd["decoder_pos_embed"] = torch.from_numpy(mae_get_2d_sincos_pos_embed(decoder_dim, grid)).float()[None]
    return sd
