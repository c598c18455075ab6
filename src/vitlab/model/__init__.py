"""The networks and their configs. `ARCHS` is the one table of architectures: a second one is a new
module (its config dataclass and its network) plus one line here, selected with `model.arch=<name>`.
Networks are imported on first use, so reading a config needs no torch (fast `--help` and config
errors)."""

from importlib import import_module

from vitlab.errors import UserError
from vitlab.model.config import VARIANTS, ViTConfig, as_hw, parse_variant

# name -> ("module:ConfigClass", "module:NetworkClass")
ARCHS: dict[str, tuple[str, str]] = {
    "vit": ("vitlab.model.config:ViTConfig", "vitlab.model.vit:ViT"),
}

__all__ = [
    "ARCHS",
    "VARIANTS",
    "ViT",
    "ViTConfig",
    "as_hw",
    "config_class",
    "model_class",
    "parse_variant",
    "posemb_sincos_1d",
    "posemb_sincos_2d",
    "resample_patch_embed",
    "resample_pos_embed",
]


def _load(arch: str, which: int) -> type:
    if arch not in ARCHS:
        raise UserError(f"model.arch {arch!r} is not one of {sorted(ARCHS)}")
    module, _, name = ARCHS[arch][which].partition(":")
    return getattr(import_module(module), name)


def config_class(arch: str = "vit") -> type:
    return _load(arch, 0)


def model_class(arch: str = "vit") -> type:
    return _load(arch, 1)


def __getattr__(name: str):
    if name == "ViT":
        from vitlab.model import vit

        return vit.ViT
    if name in ("posemb_sincos_1d", "posemb_sincos_2d", "resample_patch_embed", "resample_pos_embed"):
        from vitlab.model import posemb

        return getattr(posemb, name)
    raise AttributeError(f"module 'vitlab.model' has no attribute {name!r}")
