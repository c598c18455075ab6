"""NaFlex's config fields (ViTConfig's `naflex` and `pos_embed_*` NaFlex fields): their choices and checks, without
torch (reading a config must not import it). The embedding they build is model/naflex.py's."""

from __future__ import annotations

from typing import Any

from vitlab.utils.errors import UserError

# How the learned table is resampled to each image's grid (F.interpolate's and grid_sample's modes), and the position
# embeddings NaFlex takes ('factorized': one table per axis, NaViT's)
NAFLEX_INTERP_MODES = ("bicubic", "bilinear")
NAFLEX_POS_EMBEDS = ("learn", "factorized", "none")
NAFLEX_BOOLS = (
    "pos_embed_ar_preserving",
    "pos_embed_antialias",
    "pos_embed_align_corners",
    "pos_embed_use_grid_sample",
)
# The ViTConfig fields NaFlex owns (a plain ViT's network ignores them; timm builds them as another class, NaFlexVit)
NAFLEX_FIELDS = ("naflex", "pos_embed_grid_size", "pos_embed_interp_mode", *NAFLEX_BOOLS)


def check_naflex(cfg: Any) -> None:
    """A one-line UserError for a NaFlex field a ViTConfig cannot take (or a NaFlex choice without naflex=true); a
    YAML list for pos_embed_grid_size becomes a tuple."""
    if isinstance(cfg.pos_embed_grid_size, list):
        cfg.pos_embed_grid_size = tuple(cfg.pos_embed_grid_size)
    for name in NAFLEX_BOOLS:
        if not isinstance(getattr(cfg, name), bool):
            raise UserError(f"{name} {getattr(cfg, name)!r} must be true or false")
    if not cfg.naflex:
        if cfg.pos_embed == "factorized":
            raise UserError("pos_embed 'factorized' is NaFlex's (naflex=true)")
        return
    if cfg.pos_embed not in NAFLEX_POS_EMBEDS:
        raise UserError(f"naflex takes pos_embed {list(NAFLEX_POS_EMBEDS)}, not {cfg.pos_embed!r}")
    if cfg.pos_embed_interp_mode not in NAFLEX_INTERP_MODES:
        mode = cfg.pos_embed_interp_mode
        raise UserError(f"pos_embed_interp_mode {mode!r} is not one of {list(NAFLEX_INTERP_MODES)}")
    if cfg.distilled:
        raise UserError("naflex=true has no distillation token (distilled=false)")
    grid = cfg.pos_embed_grid_size
    ints = isinstance(grid, tuple) and len(grid) == 2 and all(type(n) is int and n >= 1 for n in grid)
    if grid is not None and not ints:
        raise UserError(f"pos_embed_grid_size {grid!r} must be [height, width] of positive ints")


def pos_grid(cfg: Any) -> tuple[int, int]:
    """NaFlex: the grid of the learned position table (pos_embed_grid_size, else the image's)."""
    return cfg.pos_embed_grid_size or cfg.grid_size
