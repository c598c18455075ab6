from vitlab.model.config import VARIANTS, ViTConfig, parse_variant
from vitlab.model.vit import ViT, posemb_sincos_2d, resample_pos_embed

__all__ = ["VARIANTS", "ViT", "ViTConfig", "parse_variant", "posemb_sincos_2d", "resample_pos_embed"]
