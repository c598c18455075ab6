"""State dicts: checked against a ViT config, read from files, loaded into a model, exported for timm.

vitlab keeps timm's parameter names, so a timm state dict *is* a vitlab one: nothing is renamed. What
`fit_state_dict` adds is the strict check (every key used, every shape matched, nothing left over) and the real
exceptions: a pos_embed trained at another resolution is resampled, patch filters for another channel count
adapted, a head of another class count dropped when asked. Every file is read by one reader that never runs
code: safetensors, or `torch.load(weights_only=True)` (which admits argparse.Namespace, and nothing else beyond
tensors and plain data, for MAE's main_pretrain.py checkpoints); a training checkpoint (`read_checkpoint`) and a
weights file (`read_weights`: vitlab's, timm's, MAE's) differ only in what they must hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitlab.convert.families import FAMILIES, WHOLE_FILE_FAMILIES, Family
from vitlab.convert.mae import describe_decoder, load_decoder, split_decoder
from vitlab.model import ViT, ViTConfig, resample_pos_embed
from vitlab.utils.atomic import atomic_write
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


def expected_shapes(cfg: ViTConfig) -> dict[str, torch.Size]:
    """The state-dict keys and shapes of a vitlab ViT of this config, without allocating it."""
    with torch.device("meta"):
        model = ViT(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def adapt_in_chans(weight: torch.Tensor, in_chans: int) -> torch.Tensor:
    """Patch-embedding filters (D, C, P, P) for another channel count, as timm's `adapt_input_conv`:
    summed over C for one channel; otherwise repeated and scaled by C / in_chans."""
    c = weight.shape[1]
    if in_chans == c:
        return weight
    w = weight.float()
    if in_chans == 1:
        w = w.sum(dim=1, keepdim=True)
    else:
        w = w.repeat(1, math.ceil(in_chans / c), 1, 1)[:, :in_chans] * (c / in_chans)
    return w.to(weight.dtype)


def fit_state_dict(
    sd: StateDict,
    cfg: ViTConfig,
    *,
    resample: bool = True,
    reset_head: bool = False,
    fresh: tuple[str, ...] = (),
    src: str = "timm",
    resample_patch: bool = False,
) -> StateDict:
    """`sd` (timm's keys, which are ours) checked against a ViT of `cfg`: every key used, every shape matched,
    returned in our key order. `resample` fits a pos_embed of another grid (square source grids, as timm
    assumes) and patch filters of another channel count; `resample_patch` patch filters of another size (timm's
    resample_patch_embed); `reset_head` drops the classifier so a new one (another class count) keeps its fresh
    initialisation, as do the `fresh` prefixes. `src` names the state dict's origin in the errors."""
    want = expected_shapes(cfg)
    unknown = [key for key in sd if key not in want]
    out: StateDict = {key: value for key, value in sd.items() if key in want}
    if unknown:
        raise UserError(
            f"{src} state dict has keys this ViT config does not use: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    drop = ("head.",) * reset_head + tuple(fresh)
    if drop:
        for k in [k for k in out if k.startswith(drop)]:
            del out[k]
        want = {k: v for k, v in want.items() if not k.startswith(drop)}
    if resample and "pos_embed" in out and out["pos_embed"].shape != want.get("pos_embed"):
        n_prefix = cfg.num_prefix_tokens if cfg.embeds_prefix else 0
        rows = out["pos_embed"].shape[1] - n_prefix
        out["pos_embed"] = resample_pos_embed(out["pos_embed"], cfg.grid_size, None, n_prefix, cfg.pos_embed_resample)
        other = next(r for r in ("timm", "dino") if r != cfg.pos_embed_resample)
        log.info("%s: its position table of %d patches resampled to the %dx%d grid by %s's rule (model."
                 "pos_embed_resample=%s; the other: model.pos_embed_resample=%s, dino for weights DINO's or DINOv2's "
                 "code trained)", src, rows, *cfg.grid_size, cfg.pos_embed_resample, cfg.pos_embed_resample,
                 other)  # fmt: skip
    key = "patch_embed.proj.weight"
    if resample and key in out and out[key].shape[1] != cfg.in_chans:  # e.g. RGB weights for grayscale data
        out[key] = adapt_in_chans(out[key], cfg.in_chans)
    if resample_patch and key in out and key in want and out[key].shape[-2:] != want[key][-2:]:
        from timm.layers import resample_patch_embed  # FlexiViT's pseudo-inverse resize, as timm's loader

        out[key] = resample_patch_embed(out[key], list(want[key][-2:]))
    missing = sorted(set(want) - set(out))
    if missing:
        raise UserError(f"{src} state dict lacks keys this ViT config needs: {missing[:8]}")
    bad = [f"{k} {tuple(out[k].shape)} != {tuple(want[k])}" for k in want if out[k].shape != want[k]]
    if bad:
        raise UserError(f"{src} state dict does not fit this ViT config: {'; '.join(bad[:4])}{_fix(out, want)}")
    return {k: out[k] for k in want}  # our key order


def _fix(out: StateDict, want: dict[str, torch.Size]) -> str:
    """What to type when the weights' patches are another size than the model's."""
    key = "patch_embed.proj.weight"
    if key not in out or key not in want or out[key].shape[-2:] == want[key][-2:]:
        return ""
    h, w = out[key].shape[-2:]
    size = h if h == w else f"[{h},{w}]"
    ours = f"{want[key][-2]}x{want[key][-1]}"
    return (
        f". The weights' patches are {h}x{w}, this model's {ours}: set model.patch_size={size}, or "
        "model.resample_patch=true to resample the patch filters (FlexiViT; timm's resample_patch_embed)"
    )


def check_state_dict(sd: StateDict, cfg: ViTConfig, src: str = "vitlab") -> StateDict:
    """`sd` checked to be exactly a ViT of `cfg`'s (nothing resampled or dropped), in our key order: what timm's
    VisionTransformer of the same arguments loads."""
    return fit_state_dict(sd, cfg, resample=False, src=src)


# ---- files ----------------------------------------------------------------------------------------


def is_weights_file(source: str) -> bool:
    """A local weights file (by suffix, or an existing path), as opposed to a timm model name."""
    return Path(source).suffix in (".safetensors", ".pth", ".pt", ".bin", ".ckpt") or Path(source).exists()


# How errors name each kind of file read, by the label of its path: (what it is, what it should be, what to give
# instead of a directory).
FILE_KINDS = {
    "ckpt_path": (
        "training checkpoint",
        "checkpoint (a .ckpt file vitlab.train writes in <run>/checkpoints/)",
        "a checkpoint file (.ckpt)",
    ),
    "weights file": ("weights file", "weights file (.safetensors, .pth)", "a weights file (.safetensors, .pth)"),
}


def read_file(path: str | os.PathLike, label: str) -> Any:
    """The one reader: a .safetensors file, or a torch.save file read with weights_only=True (memory-mapped when
    it is a zip). A file that would run code when unpickled is refused, never executed; one cut short is called
    corrupt; one that is neither torch's zip nor a pickle is another kind of file. `label` names the path in
    errors (a key of FILE_KINDS)."""
    path, (noun, should_be, instead) = Path(path), FILE_KINDS[label]
    if is_sharded_checkpoint(path):
        return read_sharded_checkpoint(path)
    if path.is_dir() and label == "ckpt_path" and (path / "config.json").is_file():  # timm's folder (an export)
        raise MissingFileError(
            f"ckpt_path {str(path)!r} is a timm folder (vitlab.export format=timm writes them), not a training "
            f"checkpoint: read it with model.pretrained=local-dir:{path} instead of ckpt_path"
        )
    if path.is_dir():
        raise MissingFileError(f"{label} {str(path)!r} is a directory; give {instead} in it")
    if not path.is_file():
        raise MissingFileError(f"{label} {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:
            raise UserError(f"{label} {str(path)!r} is not a valid safetensors file: {e}") from e
    with open(path, "rb") as f:
        head = f.read(2)
    if not head:
        raise UserError(f"{label} {str(path)!r} is empty (0 bytes): not a {should_be}")
    # Neither torch.save's zip nor a pickle (an ONNX model, JSON, a text file): torch's reader would fail deep inside
    # (an IndexError, a KeyError of the first byte) rather than say so.
    if head != b"PK" and head[:1] != b"\x80":
        raise UserError(f"{label} {str(path)!r} is not a {should_be}; it holds another kind of file")
    try:
        return _load_weights_only(path)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{label} {str(path)!r} cannot be read safely as a {noun} (only tensors and plain data are allowed; "
            f"nothing in it was run): {str(e).splitlines()[0][:200]}"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(
            f"{label} {str(path)!r} is corrupt or incomplete (cut short while copying or saving?): "
            f"{str(e).splitlines()[0].split('. ')[0]}"
        ) from e


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint directory of shards (trainer=fsdp with save_distributed_checkpoint=true): torch.distributed.
    checkpoint's `.metadata` and shard files, and Lightning's meta.pt with everything else."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / SHARDED_META).is_file()


SHARDED_META = "meta.pt"


def read_sharded_checkpoint(path: str | os.PathLike, weights: bool = True) -> dict[str, Any]:
    """A directory of shards as the one-file checkpoint it stands for: meta.pt (loops, callbacks, hyper-parameters)
    and, with `weights`, the weights and optimizer states gathered whole in memory (torch's no-process-group load;
    the whole model must fit in this host's memory) with the optimizer states in the one-file form."""
    # What torch's format_utils.dcp_to_torch_save does, into memory instead of a file.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    ckpt = read_file(path / SHARDED_META, "ckpt_path")
    if weights:
        state: dict[str, Any] = {}
        _load_state_dict(state, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        ckpt["state_dict"] = state.pop("state_dict")
        count = sum(1 for k in state if k.startswith("optimizer_"))
        ckpt["optimizer_states"] = [numbered_optimizer_state(state[f"optimizer_{i}"]) for i in range(count)]
    return ckpt


def numbered_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """torch's optimizer state keyed by parameter name (torch.distributed.checkpoint.state_dict's form: each group's
    `params` their names) -> the form one process writes: states numbered in group order, each group's
    `param_names` beside the numbers. vitlab's optimizers load either by those names (training.optim)."""
    groups, index, numbered = [], 0, {}
    for group in state["param_groups"]:
        names = list(group["params"])
        ids = list(range(index, index + len(names)))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids, "param_names": names})
        numbered |= {i: state["state"][n] for i, n in zip(ids, names, strict=True) if n in state["state"]}
        index += len(names)
    return {"state": numbered, "param_groups": groups}


def _load_weights_only(path: Path) -> Any:
    """torch.load(weights_only=True), memory-mapped when the file is a zip checkpoint (every file torch
    has written since 1.6); older pickle files are read whole. argparse.Namespace is the one class admitted beyond
    torch's: MAE's main_pretrain.py saves its arguments as one (rebuilt as attributes; nothing is called)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _family(obj: Any, families: list[Family], path: Any) -> tuple[StateDict, StateDict, str] | None:
    family = next((f for f in families if f.recognise(obj)), None)
    return None if family is None else (*family.read(obj, path), family.what)


def read_weights(path: str | os.PathLike) -> tuple[StateDict, StateDict, str]:
    """A weights file as (the ViT's state dict, an MAE decoder's in MAE's names (empty if none), what the file is): a
    bare state dict, or one inside 'state_dict' / 'model' / 'state_dict_ema' (Lightning's and timm's training
    checkpoints; MAE's released weights and main_pretrain.py checkpoints), read by its family (convert/families.py)."""
    obj = read_file(path, "weights file")
    if (found := _family(obj, WHOLE_FILE_FAMILIES, path)) is not None:
        return found
    if isinstance(obj, dict):
        for key in ("state_dict_ema", "state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"weights file {str(path)!r} does not hold a state dict (a mapping of names to tensors)")
    if (found := _family(obj, FAMILIES, path)) is not None:
        return found
    encoder, decoder = split_decoder(obj)
    return encoder, decoder, "MAE checkpoint" if decoder else "weights file"


def read_state_dict(path: str | os.PathLike) -> StateDict:
    """The ViT's weights of a weights file (read_weights), an MAE decoder in it left out (and named in the log)."""
    encoder, decoder, _ = read_weights(path)
    if decoder:
        log.info("%s: took the encoder; left out the MAE decoder (%s)", path, describe_decoder(decoder))
    return encoder


def read_checkpoint(path: str | os.PathLike, weights: bool = True) -> dict[str, Any]:
    """A vitlab training checkpoint (what vitlab.train writes in <run>/checkpoints/: a file, or a directory of
    shards) as plain data; without `weights`, a directory's metadata only (its hyper-parameters, loops)."""
    sharded = not weights and is_sharded_checkpoint(path)
    ckpt = read_sharded_checkpoint(path, weights=False) if sharded else read_file(path, "ckpt_path")
    if (
        not isinstance(ckpt, dict)
        or ("state_dict" not in ckpt and not sharded)
        or not isinstance((ckpt.get("hyper_parameters") or {}).get("model"), dict)
    ):
        raise UserError(f"ckpt_path {str(path)!r} is not a vitlab training checkpoint (it holds no model config)")
    return ckpt


def load_state(
    model: ViT,
    sd: StateDict,
    mae_decoder: StateDict,
    src: str,
    *,
    reset_head: bool | None = None,
    decoder: nn.Module | None = None,
    resample_patch: bool = False,
) -> None:
    """Load a state dict `sd` (and an MAE decoder's, possibly empty) into `model`, named `src` in logs and errors (what
    convert.source's `Weights.load_into` reads once). The pos_embed is resampled to the model's img_size;
    `resample_patch` resamples patch filters of another size. `reset_head`: keep the model's fresh head; None decides
    by whether the checkpoint's head fits. `decoder` (objective=mae's) takes the file's MAE decoder, so pretraining
    goes on; without it an MAE decoder in the file is left out, and said so."""
    if reset_head is None:
        head = sd.get("head.weight")
        reset_head = head is None or not isinstance(model.head, nn.Linear) or head.shape != model.head.weight.shape
    fresh: tuple[str, ...] = ()
    if "norm.weight" in sd and isinstance(model.norm, nn.Identity) and "fc_norm.weight" not in sd:
        # A token-pooled encoder (MAE's) fine-tuned with average pooling: its final norm is dropped and fc_norm
        # starts fresh, as MAE's main_finetune.py does.
        sd, fresh = {k: v for k, v in sd.items() if not k.startswith("norm.")}, ("fc_norm.",)
    fitted = fit_state_dict(sd, model.cfg, reset_head=reset_head, fresh=fresh, src=src, resample_patch=resample_patch)
    if decoder is not None and mae_decoder:
        load_decoder(decoder, mae_decoder, src)
    model.load_state_dict(fitted, strict=not (reset_head or fresh))
    if decoder is not None and not mae_decoder:
        log.warning("%s holds no MAE decoder: the decoder starts from its initialisation", src)
    took = "" if not mae_decoder else " with its MAE decoder" if decoder is not None else "; left out its MAE decoder"
    log.info(
        "loaded %s%s%s%s%s",
        src,
        " (new head)" if reset_head and isinstance(model.head, nn.Linear) else "",
        " (final norm dropped, new fc_norm)" * bool(fresh),
        took,
        f" ({describe_decoder(mae_decoder)})" if mae_decoder else "",
    )


def export_timm(model: ViT, path: str | os.PathLike, timm_name: str | None = None) -> Path:
    """Write `model` as a timm-loadable .safetensors file (config in its metadata). Written to a
    temporary file, read back and compared, then renamed into place: a crash leaves no half file."""
    from safetensors.torch import load_file, save

    path = Path(path)
    if path.suffix != ".safetensors":
        raise UserError(f"export path {str(path)!r} must end in .safetensors")
    sd = {k: v.detach().cpu().contiguous() for k, v in check_state_dict(model.state_dict(), model.cfg).items()}
    meta = {"format": "pt", "vitlab_config": json.dumps(model.cfg.to_dict())}
    if timm_name:
        meta["timm_name"] = timm_name

    def verify(tmp: Path) -> None:
        back = load_file(str(tmp))
        if back.keys() != sd.keys() or any(not torch.equal(back[k], sd[k]) for k in sd):
            raise OSError(f"verification of {tmp} failed: the file read back differs")

    atomic_write(path, lambda f: f.write(save(sd, metadata=meta)), verify, what="weights file")
    return path
