"""MAE's checkpoints (facebookresearch/mae) <-> vitlab: the released `{'model': ...}` weights, main_pretrain.py's
training checkpoints (model, optimizer, epoch, scaler, args), and a vitlab MAE run exported to MAE's names.

MAE's `MaskedAutoencoderViT` (models_mae.py) names its encoder as timm's VisionTransformer does, which are the ViT's
names here, and its decoder as MAEDecoder does (`mask_token`, `decoder_embed`, `decoder_blocks.i.*` with timm's block
names, `decoder_norm`, `decoder_pred`); the table below lists them in MAE's order. The one real exception is
`decoder_pos_embed`, a fixed table (MAE's sin-cos, zero class row) that MAE saves and vitlab recomputes: it is
compared with this decoder's own table, never loaded. Every key is used and every shape checked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from vitlab.model import ViT
from vitlab.model.mae import MAEDecoder
from vitlab.model.posemb import posemb_sincos_2d_mae
from vitlab.utils.atomic import atomic_write
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]

# models_mae.py MaskedAutoencoderViT's state dict, in its order: its own parameters, then its modules' ({i}: a block,
# timm 0.3.2's Block). Every name is the same here, in the ViT (the encoder's) or in MAEDecoder (mask_token, decoder_*).
LAYERS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
BLOCK = [f"{layer}.{p}" for layer in LAYERS for p in ("weight", "bias")]
MAE_KEYS = ["cls_token", "pos_embed", "mask_token", "decoder_pos_embed",
            "patch_embed.proj.weight", "patch_embed.proj.bias", "blocks.{i}.*", "norm.weight", "norm.bias",
            "decoder_embed.weight", "decoder_embed.bias", "decoder_blocks.{i}.*", "decoder_norm.weight",
            "decoder_norm.bias", "decoder_pred.weight", "decoder_pred.bias"]  # fmt: skip
FIXED = ("decoder_pos_embed",)  # saved by MAE, recomputed here
DECODER_PREFIXES = ("mask_token", "decoder_")  # how a decoder key is told from an encoder key


def mae_keys(depth: int, decoder_depth: int) -> list[str]:
    """The keys of MAE's MaskedAutoencoderViT with `depth` encoder and `decoder_depth` decoder blocks, in its order."""
    keys = []
    for name in MAE_KEYS:
        prefix = name.removesuffix("{i}.*")
        n = decoder_depth if prefix.startswith("decoder_") else depth
        keys += [f"{prefix}{i}.{b}" for i in range(n) for b in BLOCK] if name.endswith("{i}.*") else [name]
    return keys


def split_decoder(sd: StateDict) -> tuple[StateDict, StateDict]:
    """A state dict in MAE's names as (encoder, decoder); the decoder empty for an encoder alone."""
    decoder = {k: v for k, v in sd.items() if k.startswith(DECODER_PREFIXES)}
    return {k: v for k, v in sd.items() if k not in decoder}, decoder


def describe_decoder(decoder: StateDict) -> str:
    """'mask_token, decoder_embed.*, decoder_blocks.*, ...': what a log line says was left out."""
    names = dict.fromkeys(k if "." not in k else k.split(".")[0] + ".*" for k in decoder)
    return ", ".join(names)


def _table_fix(decoder: MAEDecoder, saved: torch.Tensor) -> str:
    """What differs between a file's decoder_pos_embed and the decoder's: the size, the encoder's pos_embed kind (the
    file holds MAE's table), or the file's own values (neither table: changed or learned after MAE wrote it)."""
    encoder = decoder.encoder_cfg
    if saved.shape != decoder.decoder_pos_embed.shape:
        return "; give the model the image and patch size it was trained at"
    mae = posemb_sincos_2d_mae(encoder.grid_size, saved.shape[-1], encoder.num_prefix_tokens)
    if encoder.pos_embed != "sincos2d_mae" and torch.allclose(saved.float(), mae, atol=1e-6):
        return " (MAE's sin-cos frequencies): set model.pos_embed=sincos2d_mae, whose decoder table is MAE's"
    return (
        ": the file's table is not the fixed sin-cos one MAE's code writes for this size (its values were changed or "
        "learned), and this decoder's table is fixed; the file cannot be loaded as an MAE checkpoint"
    )


def load_decoder(decoder: MAEDecoder, sd: StateDict, src: str) -> None:
    """An MAE decoder's weights (MAE's names) into `decoder`: every key used, every shape matched, MAE's saved
    decoder_pos_embed equal to this decoder's fixed table (else the encoder's pos_embed kind is named as the fix)."""
    sd = dict(sd)
    saved = sd.pop("decoder_pos_embed", None)
    ours = decoder.decoder_pos_embed
    if saved is not None and (saved.shape != ours.shape or not torch.allclose(saved.float(), ours.float(), atol=1e-6)):
        raise UserError(f"{src}: its decoder_pos_embed {tuple(saved.shape)} is not this decoder's fixed table "
                        f"{tuple(ours.shape)}{_table_fix(decoder, saved)}")  # fmt: skip
    want = decoder.state_dict()
    unknown, missing = sorted(set(sd) - set(want)), sorted(set(want) - set(sd))
    bad = [f"{k} {tuple(sd[k].shape)} != {tuple(w.shape)}" for k, w in want.items() if sd.get(k, w).shape != w.shape]
    if unknown or missing or bad:
        what = "; ".join(
            f"{label} {items[:6]}" for label, items in (("unknown", unknown), ("missing", missing), ("shapes", bad))
            if items
        )  # fmt: skip
        raise UserError(
            f"{src}: its MAE decoder does not fit objective=mae's ({what}); set objective.decoder_embed_dim, "
            "decoder_depth and decoder_num_heads to the checkpoint's"
        )
    decoder.load_state_dict(sd)


def mae_state_dict(vit: ViT, decoder: MAEDecoder) -> StateDict:
    """A vitlab MAE encoder and decoder as MAE's MaskedAutoencoderViT state dict (its keys, order and shapes), what
    `torch.load(f)['model']` gives MAE's code. Refused in one line where MAE's model has no place for a part."""
    cfg = vit.cfg
    ours = {**vit.state_dict(), **decoder.state_dict(), "decoder_pos_embed": decoder.decoder_pos_embed}
    keys = mae_keys(cfg.depth, len(decoder.decoder_blocks))
    extra = sorted(set(ours) - set(keys))
    missing = sorted(set(keys) - set(ours))
    rows = ours["pos_embed"].shape[1] if "pos_embed" in ours else 0
    if missing or extra or cfg.num_prefix_tokens != 1 or rows != 1 + cfg.num_patches:
        raise UserError(
            "format=mae writes MAE's MaskedAutoencoderViT (a class token, a pos_embed row for it, timm's blocks); "
            f"this model has extra keys {extra[:4]}, lacks {missing[:4]}, pos_embed rows {rows} for {cfg.num_patches} "
            "patches: export an encoder built as MAE's (class token, model.pos_embed=sincos2d_mae or learn)"
        )
    return {k: ours[k].detach().cpu().contiguous() for k in keys}


def export_mae(vit: ViT, decoder: MAEDecoder, path: str | os.PathLike) -> Path:
    """Write `{'model': MAE's state dict}` (the format of MAE's released weights, which its main_finetune.py
    --finetune and main_pretrain.py --resume read) to `path` (.pth), read back and compared before it is put there."""
    path = Path(path)
    if path.suffix != ".pth":
        raise UserError(f"output {str(path)!r} must end in .pth for format=mae (MAE's checkpoints are .pth files)")
    sd = mae_state_dict(vit, decoder)

    def verify(tmp: Path) -> None:
        back = torch.load(tmp, map_location="cpu", weights_only=True)["model"]
        if list(back) != list(sd) or any(not torch.equal(back[k], sd[k]) for k in sd):
            raise OSError(f"verification of {tmp} failed: the file read back differs")

    atomic_write(path, lambda f: torch.save({"model": sd}, f), verify, what="MAE checkpoint")
    return path
