"""The network and its config: `ViTConfig` (config.py, no torch) and `ViT` (vit.py, its layers in layers.py and
blocks.py). The network is imported on first use, so reading a config needs no torch (fast `--help` and config
errors)."""

from vitlab.model.choices import VARIANTS, parse_variant
from vitlab.model.config import ViTConfig, as_hw, vit_config

__all__ = [
    "VARIANTS",
    "ViT",
    "ViTConfig",
    "as_hw",
    "parse_variant",
    "posemb_sincos_1d",
    "posemb_sincos_2d",
    "resample_patch_embed",
    "resample_pos_embed",
    "vit_config",
]


def __getattr__(name: str):
    if name == "ViT":
        from vitlab.model import vit

        return vit.ViT
    if name in ("posemb_sincos_1d", "posemb_sincos_2d", "resample_patch_embed", "resample_pos_embed"):
        from vitlab.model import posemb

        return getattr(posemb, name)
    raise AttributeError(f"module 'vitlab.model' has no attribute {name!r}")
