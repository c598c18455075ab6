"""The network (vit.py) and its config (config.py). `ViT` and the position-embedding functions are
imported on first use, so reading a config needs no torch (fast `--help` and config errors)."""

from vitlab.model.config import VARIANTS, ViTConfig, parse_variant

__all__ = ["VARIANTS", "ViT", "ViTConfig", "parse_variant", "posemb_sincos_2d", "resample_pos_embed"]


def __getattr__(name: str):
    if name in ("ViT", "posemb_sincos_2d", "resample_pos_embed"):
        from vitlab.model import vit

        return getattr(vit, name)
    raise AttributeError(f"module 'vitlab.model' has no attribute {name!r}")
