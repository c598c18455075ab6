"""Weights between timm's VisionTransformer and vitlab's ViT.

vitlab keeps timm's parameter names, so no key is renamed (the key table is the identity, and is not
written out); what the conversion adds is the strict check (every key used, every shape matched,
nothing left over) and the real exceptions: a pos_embed trained at another resolution is resampled, a head of another
class count is dropped when asked. Reading files never runs code: safetensors, or
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from vitlab.atomic import atomic_write
from vitlab.errors import MissingFileError, OfflineError, UserError
from vitlab.model import ViT, ViTConfig, resample_pos_embed
from vitlab.model.config import DROPOUTS, NORM_LAYERS

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


def _convert(sd: StateDict, cfg: ViTConfig, *, src: str, resample: bool, reset_head: bool) -> StateDict:
    want = expected_shapes(cfg)
    unknown = [key for key in sd if key not in want]
    out: StateDict = {key: value for key, value in sd.items() if key in want}
    if unknown:
        raise UserError(
            f"{src} state dict has keys this ViT config does not use: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    if reset_head:
        for k in [k for k in out if k.startswith("head.")]:
            del out[k]
        want = {k: v for k, v in want.items() if not k.startswith("head.")}
    if resample and "pos_embed" in out and out["pos_embed"].shape != want.get("pos_embed"):
        n_prefix = cfg.num_prefix_tokens if cfg.embeds_prefix else 0
        out["pos_embed"] = resample_pos_embed(out["pos_embed"], cfg.grid_size, None, n_prefix)
    key = "patch_embed.proj.weight"
    if resample and key in out and out[key].shape[1] != cfg.in_chans:  # e.g. RGB weights for grayscale data
        out[key] = adapt_in_chans(out[key], cfg.in_chans)
    missing = sorted(set(want) - set(out))
    if missing:
        raise UserError(f"{src} state dict lacks keys this ViT config needs: {missing[:8]}")
    bad = [f"{k} {tuple(out[k].shape)} != {tuple(want[k])}" for k in want if out[k].shape != want[k]]
    if bad:
        raise UserError(f"{src} state dict does not fit this ViT config: {'; '.join(bad[:4])}")
    return {k: out[k] for k in want}  # our key order


def timm_to_vitlab(sd: StateDict, cfg: ViTConfig, *, resample: bool = True, reset_head: bool = False) -> StateDict:
    """A timm VisionTransformer state dict -> vitlab's, checked against `cfg`. `resample` fits a pos_embed
    of another grid (square source grids, as timm assumes) and patch filters of another channel count;
    `reset_head` drops the classifier so a new one (another class count) keeps its fresh initialisation."""
    return _convert(sd, cfg, src="timm", resample=resample, reset_head=reset_head)


def vitlab_to_timm(sd: StateDict, cfg: ViTConfig) -> StateDict:
    """vitlab state dict -> timm VisionTransformer's, checked against `cfg`."""
    return _convert(sd, cfg, src="vitlab", resample=False, reset_head=False)


# ---- timm models ----------------------------------------------------------------------------------


def timm_kwargs(cfg: ViTConfig) -> dict[str, Any]:
    """Arguments of timm's VisionTransformer that build the same network as `cfg`. A fixed sin-cos
    embedding becomes a learned one with the same values (timm has no fixed one)."""
    import timm.models.vision_transformer as tv
    from timm.layers import Mlp, RmsNorm, SwiGLU, SwiGLUPacked

    d = cfg.to_dict()
    del d["norm_eps"]
    d["img_size"], d["patch_size"] = tuple(cfg.img_hw), tuple(cfg.patch_hw)
    if cfg.pos_embed == "sincos2d":
        d.update(pos_embed="learn", no_embed_class=True)
    elif cfg.pos_embed == "sincos1d":  # prefix rows as no_embed_class says
        d.update(pos_embed="learn")
    d["norm_layer"] = partial({"layernorm": nn.LayerNorm, "rmsnorm": RmsNorm}[cfg.norm_layer], eps=cfg.norm_eps)
    d["mlp_layer"] = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked}[cfg.mlp_layer]
    d["embed_norm_layer"] = d["norm_layer"] if d.pop("embed_norm") else None
    blocks = {"block": tv.Block, "parallel_scaling": tv.ParallelScalingBlock, "res_post": tv.ResPostBlock}
    blocks.update(parallel_things=tv.ParallelThingsBlock, diff_parallel_scaling=tv.DiffParallelScalingBlock)
    d["block_fn"] = blocks[cfg.block_fn]
    return d  # act_layer: timm reads the same names


# ---- from a timm architecture name to a ViTConfig --------------------------------------------------

# timm arguments our ViT has no counterpart for, with the value that means "off" (timm's default)
TIMM_UNSUPPORTED = {
    "embed_layer": "PatchEmbed",
}


def timm_vit_names() -> list[str]:
    """Every architecture registered in timm's `vision_transformer` module."""
    import timm

    return timm.list_models(module="vision_transformer")


# Where timm.create_model reads a model from instead of its registry: a folder as timm saves one (config.json
# with the architecture, its arguments and pretrained_cfg, and the weights), or a Hugging Face repository.
TIMM_SOURCES = ("local-dir:", "hf-hub:")


def _source_config(name: str) -> tuple[dict, str, dict]:
    """(pretrained_cfg, architecture, model_args) of a `local-dir:` / `hf-hub:` name, read by timm."""
    from timm.models._hub import load_model_config_from_hf, load_model_config_from_path

    source, _, where = name.partition(":")
    if source == "local-dir":
        if not (Path(where) / "config.json").is_file():
            raise MissingFileError(f"{name!r}: {where}/config.json does not exist (a folder as timm saves a model)")
        return load_model_config_from_path(where)
    with from_the_hub(name):
        return load_model_config_from_hf(where)


def timm_architecture(name: str) -> str:
    """The registered architecture `name` builds: the name without its pretrained tag, or the architecture in
    the config.json of a `local-dir:` / `hf-hub:` source."""
    return _source_config(name)[1] if name.startswith(TIMM_SOURCES) else name.partition(".")[0]


def timm_model_args(name: str, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments timm passes to VisionTransformer for `name` (an architecture, optionally with a
    pretrained tag, or a TIMM_SOURCES folder or repository), `overrides` merged and the pretrained config's
    defaults (input size, class count) filled in, exactly as `timm.create_model(name, **overrides)` does: it
    runs, and its call to VisionTransformer is answered with the arguments instead of a model (nothing
    allocated; nothing downloaded but a hub repository's config.json)."""
    import timm
    import timm.models.vision_transformer as tv

    arch = timm_architecture(name)
    names = timm_vit_names()
    if arch not in names:
        raise UserError(
            f"{arch!r} is not an architecture of timm's vision_transformer module ({len(names)} are)"
            + (f"; did you mean {close}?" if (close := close_matches(arch, names)) else "")
        )
    check_timm_name(name)

    class Captured(Exception):
        pass

    args: dict[str, Any] = {}

    def capture(**kwargs: Any):
        args.update(kwargs)
        raise Captured

    real, tv.VisionTransformer = tv.VisionTransformer, capture
    try:
        timm.create_model(name, pretrained=False, **overrides)
    except Captured:
        pass
    finally:
        tv.VisionTransformer = real
    return args


def _component_name(value: Any) -> str:
    """A timm component (class, partial, or name) as its class name, lower case."""
    if isinstance(value, str):
        return value.lower()
    value = getattr(value, "func", value)  # functools.partial
    return getattr(value, "__name__", type(value).__name__).lower()


def _norm(value: Any) -> dict[str, Any]:
    kind = _component_name(value)
    if kind not in NORM_LAYERS:
        raise UserError(f"norm_layer {kind!r}")
    eps = getattr(value, "keywords", {}).get("eps", 1e-6) if not isinstance(value, str) else 1e-6
    return {"norm_layer": kind, "norm_eps": eps}


def _mlp(value: Any) -> str:
    kind = _component_name(value)
    if kind == "mlp":
        return "mlp"
    if kind == "swiglu":
        return "swiglu"
    keywords = getattr(value, "keywords", {})
    if kind in ("glumlp", "swiglupacked") and keywords.get("gate_last", True) is False:
        if _component_name(keywords.get("act_layer", "silu")) == "silu":
            return "swiglu_packed"
    raise UserError(f"mlp_layer {kind!r} {keywords or ''}")


# timm's component names and class names (lower case) -> ours, per argument
COMPONENT_NAMES = {
    "act_layer": {"gelu": "gelu", "gelutanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "quickgelu": "quick_gelu",
                  "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"},
    "attn_layer": {"attn": "attn", "attention": "attn", "diff": "diff", "diffattention": "diff"},
    "block_fn": {"block": "block", "parallelscalingblock": "parallel_scaling", "respostblock": "res_post",
                 "parallelthingsblock": "parallel_things", "diffparallelscalingblock": "diff_parallel_scaling"},
}  # fmt: skip


def vitlab_args(args: dict[str, Any]) -> dict[str, Any]:
    """timm's VisionTransformer arguments as ViTConfig fields; a UserError names the first one that our ViT
    cannot express."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in TIMM_UNSUPPORTED:
            default = TIMM_UNSUPPORTED[key]
            off = value == default or (isinstance(default, str) and _component_name(value) == default.lower())
            if not off:
                raise UserError(f"{key}={_component_name(value) if callable(value) else value!r}")
        elif key in COMPONENT_NAMES:  # a timm class or name -> ours
            ours = COMPONENT_NAMES[key].get(_component_name(value))
            if ours is None:
                raise UserError(f"{key}={_component_name(value)!r}")
            out[key] = ours
        elif key == "norm_layer":
            out.update(_norm(value))
        elif key == "embed_norm_layer":
            out["embed_norm"] = value is not None
        elif key == "mlp_layer":
            out["mlp_layer"] = _mlp(value)
        elif key in ("patch_size", "img_size") and isinstance(value, (tuple, list)):
            out[key] = list(value)  # ViTConfig keeps an int for squares
        else:
            out[key] = value
    if out.get("embed_norm") and _norm(args["embed_norm_layer"]) != _norm(args.get("norm_layer", "layernorm")):
        raise UserError(f"embed_norm_layer={_component_name(args['embed_norm_layer'])!r} unlike norm_layer")
    return out


def config_from_timm(name: str, **overrides: Any) -> ViTConfig:
    """The ViTConfig of `name`, an architecture registered in timm's `vision_transformer` module, from the
    arguments timm registers for it, with timm's keyword `overrides` applied (`depth=2`, `img_size=384`,
    `num_classes=10`), so that `timm_to_vitlab(timm.create_model(name, **overrides).state_dict(), cfg)`
    loads into `ViT(cfg)`. An architecture our ViT cannot express is a UserError saying which argument."""
    args = timm_model_args(name, **overrides)
    try:
        return ViTConfig.from_dict(vitlab_args(args))
    except UserError as e:
        raise UserError(f"timm's {timm_architecture(name)} is not expressible by vitlab's ViT: {e}") from None


# What a run decides for itself when it starts from a timm architecture (model.pretrained=<timm name>): the size
# of its images, their channels, its classes and its regularisation; every other field is the architecture's.
RUN_FIELDS = ("img_size", "in_chans", "num_classes", "dynamic_img_size", "dynamic_img_pad", *DROPOUTS)
PREPROCESSING = ("mean", "std", "crop_pct", "crop_mode", "interpolation", "input_size")


def timm_pretrained_cfg(name: str) -> dict[str, Any]:
    """What timm's weights `name` (an architecture, or with a pretrained tag) expect of their input, from timm's
    registry (nothing downloaded): mean, std, crop_pct, crop_mode, interpolation, input_size (C, H, W), and
    the tag (timm's default weights when `name` has none)."""
    from timm.models import get_pretrained_cfg

    check_timm_name(name)
    if name.startswith(TIMM_SOURCES):  # the folder's or repository's own config.json
        cfg = _source_config(name)[0]
        return {key: cfg[key] for key in PREPROCESSING if key in cfg} | {"tag": name}
    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise UserError(f"timm has no pretrained configuration for {name!r}")
    return {key: getattr(cfg, key) for key in PREPROCESSING} | {"tag": f"{name.partition('.')[0]}.{cfg.tag}"}


def is_weights_file(source: str) -> bool:
    """A local weights file (by suffix, or an existing path), as opposed to a timm model name."""
    return Path(source).suffix in (".safetensors", ".pth", ".pt", ".bin", ".ckpt") or Path(source).exists()


def create_timm_model(cfg: ViTConfig, name: str | None = None, pretrained: bool = False) -> nn.Module:
    """timm's model for `cfg`: the registered `name` with cfg's arguments on top, or a bare
    VisionTransformer. Pretrained weights come through timm's own hub download."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    kwargs = timm_kwargs(cfg)
    if name is None:
        if pretrained:
            raise UserError("pretrained weights need a timm model name")
        return VisionTransformer(**kwargs)
    check_timm_name(name)
    if not pretrained:
        return timm.create_model(name, **kwargs)
    with from_the_hub(name):
        return timm.create_model(name, pretrained=True, **kwargs)


def check_timm_name(name: str) -> None:
    """A timm model name, optionally with a pretrained tag (`vit_base_patch16_224.augreg_in21k`), that
    timm knows; otherwise a one-line error with the closest names."""
    import timm

    if name.startswith(TIMM_SOURCES):
        name = timm_architecture(name)  # a folder without config.json, or an unreachable repository, fails here
    arch, _, tag = name.partition(".")
    if not timm.is_model(arch):
        close = close_matches(arch, timm.list_models())
        hint = f"did you mean {close}? " if close else ""
        raise UserError(
            f"{name!r} is neither a weights file nor a timm model name; {hint}"
            "timm.list_models('vit_*') lists timm's ViTs"
        )
    if tag and name not in timm.list_pretrained(f"{arch}.*"):
        raise UserError(f"timm has no pretrained weights {name!r}; it has {timm.list_pretrained(f'{arch}.*')[:6]}")


def close_matches(word: str, choices: list[str]) -> list[str]:
    """Up to three of `choices` that look like `word`, for a `did you mean` hint."""
    import difflib

    return difflib.get_close_matches(word, choices, n=3, cutoff=0.6)


@contextlib.contextmanager
def from_the_hub(name: str) -> Iterator[None]:
    """The one way vitlab downloads from the Hugging Face hub: looked for first (an unreachable hub reads the
    cache alone, at once), and an error that says "no network" (huggingface_hub raises many kinds) becomes
    the one-line OfflineError naming `name` and the ways out."""
    _unless_hub_reachable_read_the_cache()
    try:
        yield
    except Exception as e:
        if _looks_offline(e):
            raise OfflineError(offline_message(name)) from e
        raise


def _offline_errors() -> tuple[type[BaseException], ...]:
    """What the Hugging Face hub and the HTTP stacks under it raise without a network (the ones
    installed here; each is optional)."""
    import socket

    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]
    for module, names in (
        ("huggingface_hub.errors", ("LocalEntryNotFoundError", "OfflineModeIsEnabled")),
        ("requests.exceptions", ("ConnectionError", "Timeout")),
        ("httpx", ("ConnectError", "TimeoutException")),
        ("urllib3.exceptions", ("MaxRetryError", "NameResolutionError", "NewConnectionError")),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        kinds += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(kinds)


def _looks_offline(e: BaseException) -> bool:
    offline = _offline_errors()
    return any(isinstance(x, offline) for x in _chain(e))


def _chain(e: BaseException | None):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _unless_hub_reachable_read_the_cache() -> None:
    """Without a network, huggingface_hub retries each request for about a minute before it gives up (50 s for one
    timm name, measured): look for the hub once, in 2 s, and if it cannot be reached let huggingface_hub read its
    cache alone, as HF_HUB_OFFLINE=1 does. (Behind a proxy the look would mislead: it is left to the hub.)"""
    from huggingface_hub import constants

    proxy = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if constants.is_offline_mode() or proxy:
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=2).close()
    except OSError:
        constants.HF_HUB_OFFLINE = True


def offline_message(name: str) -> str:
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return (
        f"cannot fetch timm weights {name!r}: no network and not in the Hugging Face cache ({cache}); "
        "run once online, or give a local .safetensors/.pth file or a timm folder (local-dir:<folder>) instead"
    )


def timm_pretrained_state_dict(name: str) -> StateDict:
    """timm's pretrained weights for a registered name, as timm itself loads them (its checkpoint
    filter converts original JAX/npz layouts), downloaded through the Hugging Face hub and cached."""
    import timm

    check_timm_name(name)
    with from_the_hub(name):
        model = timm.create_model(name, pretrained=True)
    return model.state_dict()


# ---- files ----------------------------------------------------------------------------------------


def read_state_dict(path: str | os.PathLike) -> StateDict:
    """A weights file: .safetensors, or a PyTorch pickle read with weights_only=True (no code runs).
    Accepts a bare state dict, or one inside 'state_dict' / 'model' / 'state_dict_ema' (Lightning and
    timm training checkpoints); Lightning's 'model.' prefix is removed."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:
            raise UserError(f"weights file {str(path)!r} is not a valid safetensors file: {e}") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"weights file {str(path)!r} cannot be read safely as PyTorch weights "
            f"(only plain tensors are allowed; nothing was executed): {str(e).splitlines()[0]}"
        ) from e
    if isinstance(obj, dict):
        for key in ("state_dict_ema", "state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"weights file {str(path)!r} does not hold a state dict (a mapping of names to tensors)")
    if all(k.startswith("model.") for k in obj):
        obj = {k[len("model.") :]: v for k, v in obj.items()}
    return obj


def load_timm_weights(model: ViT, source: str, *, reset_head: bool | None = None) -> None:
    """Load timm weights into `model`: `source` is a local file, or a timm model name (downloaded
    through timm when online). The pos_embed is resampled to the model's img_size. `reset_head`:
    keep the model's fresh head; None decides by whether the checkpoint's head fits."""
    if is_weights_file(source):
        sd = read_state_dict(source)
    else:
        sd = timm_pretrained_state_dict(source)
        pretrained = timm_pretrained_cfg(source)
        model.pretrained_cfg.update(
            {k: pretrained[k] for k in PREPROCESSING if k != "input_size"}, tag=pretrained["tag"]
        )
    if reset_head is None:
        head = sd.get("head.weight")
        reset_head = head is None or not isinstance(model.head, nn.Linear) or head.shape != model.head.weight.shape
    model.load_state_dict(timm_to_vitlab(sd, model.cfg, reset_head=reset_head), strict=not reset_head)
    log.info("loaded timm weights %s%s", source, " (new head)" if reset_head else "")


def export_timm(model: ViT, path: str | os.PathLike, timm_name: str | None = None) -> Path:
    """Write `model` as a timm-loadable .safetensors file (config in its metadata). Written to a
    temporary file, read back and compared, then renamed into place: a crash leaves no half file."""
    from safetensors.torch import load_file, save

    path = Path(path)
    if path.suffix != ".safetensors":
        raise UserError(f"export path {str(path)!r} must end in .safetensors")
    sd = {k: v.detach().cpu().contiguous() for k, v in vitlab_to_timm(model.state_dict(), model.cfg).items()}
    meta = {"format": "pt", "vitlab_config": json.dumps(model.cfg.to_dict())}
    if timm_name:
        meta["timm_name"] = timm_name

    def verify(tmp: Path) -> None:
        back = load_file(str(tmp))
        if back.keys() != sd.keys() or any(not torch.equal(back[k], sd[k]) for k in sd):
            raise OSError(f"verification of {tmp} failed: the file read back differs")

    atomic_write(path, lambda f: f.write(save(sd, metadata=meta)), verify, what="weights file")
    return path
