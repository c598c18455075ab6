"""The architecture mapping between timm's VisionTransformer arguments and ViTConfig, both ways, from one table:
`timm_kwargs(cfg)` builds timm's model for a config (parity tests, benchmarks), `config_from_timm(name)` reads
the config of any architecture timm registers from timm's own arguments."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from torch import nn

from vitlab.convert.timm_hub import check_timm_name, from_the_hub, timm_architecture, timm_eva_names, timm_model_names
from vitlab.model import ViTConfig
from vitlab.model.choices import ATTENTION_KINDS, DROPOUTS
from vitlab.model.naflex_config import NAFLEX_FIELDS
from vitlab.utils.errors import UnknownArgumentError, UnsupportedRequestError, UserError, close_matches


def timm_components() -> dict[str, dict[str, Any]]:
    """Per argument, our component name -> what timm's VisionTransformer takes for it (a name timm reads, or its
    class). `timm_kwargs` reads it forwards; `vitlab_args` backwards, by the class's name (and TIMM_ALIASES)."""
    import timm.models.vision_transformer as tv
    from timm.layers import Mlp, RmsNorm, SwiGLU, SwiGLUPacked

    return {
        "act_layer": {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "silu"},
        "attn_layer": {name: kind.timm[0] for name, kind in ATTENTION_KINDS.items() if kind.timm},
        "norm_layer": {"layernorm": nn.LayerNorm, "rmsnorm": RmsNorm},
        "mlp_layer": {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked},
        "block_fn": {"block": tv.Block, "parallel_scaling": tv.ParallelScalingBlock, "res_post": tv.ResPostBlock,
                     "parallel_things": tv.ParallelThingsBlock, "diff_parallel_scaling": tv.DiffParallelScalingBlock},
    }  # fmt: skip


# Other names timm's registered models give the same components (class names, lower case).
TIMM_ALIASES = {
    "act_layer": {"gelutanh": "gelu_tanh", "quickgelu": "quick_gelu", "swish": "silu"},
    "attn_layer": {alias: name for name, kind in ATTENTION_KINDS.items() for alias in kind.timm[1:]}
    | {"evaattention": "eva"},
    "block_fn": {"evablock": "eva"},  # timm's NaFlexVit builds EvaBlocks for RoPE (convert/timm_naflex.py)
}

# timm arguments our ViT has no counterpart for, with the value that means "off" (timm's default)
TIMM_UNSUPPORTED = {
    "embed_layer": "PatchEmbed",
}


def timm_kwargs(cfg: ViTConfig) -> dict[str, Any]:
    """Arguments of timm's VisionTransformer that build the same network as `cfg`. A fixed sin-cos
    embedding becomes a learned one with the same values (timm has no fixed one)."""
    from vitlab.convert.timm_eva import EVA_ONLY_FIELDS, is_eva_config

    if is_eva_config(cfg):
        raise UserError(
            "this config is one of timm's Eva (eva module), not its VisionTransformer: convert.timm_eva.eva_kwargs"
        )
    d = {k: v for k, v in cfg.to_dict().items() if k not in EVA_ONLY_FIELDS and not k.startswith("rope_")}
    del d["norm_eps"], d["grad_checkpointing"]  # timm: set_grad_checkpointing(), not an argument
    del d["pos_embed_resample"]  # timm resamples by its own rule (DINO's: only in vitlab, model/posemb.py)
    del d["drop_path_uniform"]  # timm's drop path grows with depth (training only: the network is the same)
    del d["distilled"]  # timm: another class (VisionTransformerDistilled, create_timm_model)
    for key in NAFLEX_FIELDS:  # timm: another class (NaFlexVit, convert/timm_naflex.py)
        del d[key]
    d["img_size"], d["patch_size"] = cfg.img_hw, cfg.patch_hw
    if cfg.pos_embed == "sincos2d":
        d.update(pos_embed="learn", no_embed_class=True)
    elif cfg.pos_embed in ("sincos1d", "sincos2d_mae"):  # prefix rows as no_embed_class says
        d.update(pos_embed="learn")
    if cfg.weight_init == "mae":  # timm has no MAE init (the weights are what matters; they are copied over)
        d["weight_init"] = ""
    for key, table in timm_components().items():
        d[key] = table[d[key]]
    d["norm_layer"] = partial(d["norm_layer"], eps=cfg.norm_eps)
    d["embed_norm_layer"] = d["norm_layer"] if d.pop("embed_norm") else None
    return d


def timm_model_args(name: str, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments timm passes to VisionTransformer for `name` (an architecture, optionally with a
    pretrained tag, or a TIMM_SOURCES folder or repository), `overrides` merged and the pretrained config's
    defaults (input size, class count) filled in, exactly as `timm.create_model(name, **overrides)` does: it
    runs, and its call to VisionTransformer is answered with the arguments instead of a model (nothing
    allocated; nothing downloaded but a hub repository's config.json)."""
    import timm

    arch = timm_architecture(name)
    names = timm_model_names()
    if arch not in names:
        raise UserError(
            f"{arch!r} is not an architecture of timm's vision_transformer, deit, eva or naflexvit modules "
            f"({len(names)} are)" + (f"; did you mean {close}?" if (close := close_matches(arch, names)) else "")
        )
    check_timm_name(name, weights=False)

    class Captured(Exception):
        pass

    args: dict[str, Any] = {}

    def capture(**kwargs: Any):
        args.update(kwargs)
        raise Captured

    try:
        with timm_builds(capture):
            timm.create_model(name, pretrained=False, **overrides)
    except Captured:
        pass
    return args


_BUILDS = threading.RLock()


@contextlib.contextmanager
def timm_builds(build: Callable[..., Any]) -> Iterator[None]:
    """Within the block, timm's factory calls `build(**kwargs)` where it would construct its VisionTransformer (the
    arguments it resolved for the name, DeiT's distilled class as `distilled=True`); one thread at a time."""
    import timm.models.deit as deit
    import timm.models.eva as eva
    import timm.models.vision_transformer as tv

    from vitlab.convert.timm_naflex import naflex_class

    # Each module's own name for the class (deit imports VisionTransformer), DeiT's distilled one with its token, the
    # eva module's Eva (its arguments are read by config_from_args, which knows the architecture), and NaFlex's row
    # from its own file.
    classes = [(tv, "VisionTransformer", build), (deit, "VisionTransformer", build),
               (deit, "VisionTransformerDistilled", lambda **kw: build(**kw, distilled=True)),
               (eva, "Eva", build), naflex_class(build)]  # fmt: skip
    with _BUILDS:
        real = [getattr(module, cls) for module, cls, _ in classes]
        try:
            for module, cls, fake in classes:
                setattr(module, cls, fake)
            yield
        finally:
            for (module, cls, _), was in zip(classes, real, strict=True):
                setattr(module, cls, was)


def _component_name(value: Any) -> str:
    """A timm component (class, partial, or name) as its class name, lower case."""
    if isinstance(value, str):
        return value.lower()
    value = getattr(value, "func", value)  # functools.partial
    return getattr(value, "__name__", type(value).__name__).lower()


def _norm(value: Any) -> dict[str, Any]:
    eps = 1e-6 if isinstance(value, str) else getattr(value, "keywords", {}).get("eps", 1e-6)  # timm's default
    return {"norm_layer": _ours("norm_layer", value), "norm_eps": eps}


def _mlp(value: Any) -> str:
    """timm's packed SwiGLU is GluMlp with SiLU and the gate in the first half (gate_last=False); any other
    GluMlp is not one of ours."""
    kind, keywords = _component_name(value), getattr(value, "keywords", {})
    if kind in ("glumlp", "swiglupacked"):
        if keywords.get("gate_last", True) is False and _component_name(keywords.get("act_layer", "silu")) == "silu":
            return "swiglu_packed"
        raise UserError(f"mlp_layer {kind!r} {keywords or ''}")
    return _ours("mlp_layer", value)


def _ours(key: str, value: Any) -> str:
    """timm's component for argument `key` (a name, class or partial) as our name, or a UserError naming it."""
    names = {_component_name(v): ours for ours, v in timm_components()[key].items()} | TIMM_ALIASES.get(key, {})
    if (ours := names.get(_component_name(value))) is None:
        raise UserError(f"{key}={_component_name(value)!r}")
    return ours


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
        elif key in ("act_layer", "attn_layer", "block_fn"):  # a timm class or name -> ours
            out[key] = _ours(key, value)
        elif key == "norm_layer":
            out.update(_norm(value))
        elif key == "embed_norm_layer":
            out["embed_norm"] = value is not None
        elif key == "mlp_layer":
            out["mlp_layer"] = _mlp(value)
        else:
            out[key] = value
    if out.get("embed_norm") and _norm(args["embed_norm_layer"]) != _norm(args.get("norm_layer", "layernorm")):
        raise UserError(f"embed_norm_layer={_component_name(args['embed_norm_layer'])!r} unlike norm_layer")
    return out


def config_from_timm(name: str, **overrides: Any) -> ViTConfig:
    """The ViTConfig of `name`, an architecture registered in timm's `vision_transformer` or `deit` module, from the
    arguments timm registers for it, with timm's keyword `overrides` applied (`depth=2`, `img_size=384`,
    `num_classes=10`), so that `fit_state_dict(timm.create_model(name, **overrides).state_dict(), cfg)`
    loads into `ViT(cfg)`. An architecture our ViT cannot express is a UserError saying which argument."""
    return config_from_args(timm_architecture(name), timm_model_args(name, **overrides), given=overrides)


def config_from_args(arch: str, args: dict[str, Any], given: Iterable[str] = ()) -> ViTConfig:
    """The ViTConfig of timm's VisionTransformer arguments `args` (for architecture `arch`, named in errors), or its
    Eva's for an architecture of timm's eva module (convert/timm_eva.py). A keyword no ViT takes is an
    UnknownArgumentError (a TypeError, as timm's constructor raises); an architecture our ViT cannot express a
    UserError saying which argument. `given`: the keywords the caller set on top of timm's registered ones (a command
    line's, create_model's): a value our config refuses among them, where timm's own arguments make a ViT of ours,
    is the caller's, named with what is allowed (not blamed on timm's architecture)."""
    from vitlab.convert.timm_eva import eva_config_fields

    try:
        fields = eva_config_fields(arch, args) if arch in timm_eva_names() else vitlab_args(args)
    except UnknownArgumentError:
        raise
    except UserError as e:
        raise _not_expressible(arch, e) from None
    try:
        return ViTConfig.from_dict(fields)
    except UserError as e:
        if set(given) & set(args) and _expressible(arch):
            raise  # a value of the caller's that no ViT of ours takes (a typo in a choice, a number out of range)
        raise _not_expressible(arch, e) from None


def _not_expressible(arch: str, e: UserError) -> UserError:
    kind = UnsupportedRequestError if isinstance(e, AssertionError) else UserError  # (timm's asserts stay asserts)
    return kind(f"timm's {arch} is not expressible by vitlab's ViT: {e}")


def _expressible(arch: str) -> bool:
    """Whether timm's registered arguments of `arch` alone make a ViT of ours."""
    try:
        config_from_args(arch, timm_model_args(arch))
    except (UserError, TypeError):
        return False
    return True


# What a run decides for itself when it starts from a timm architecture (model.pretrained=<timm name>): the size
# of its images, their channels, its classes and its regularisation; every other field is the architecture's.
RUN_FIELDS = ("img_size", "in_chans", "num_classes", "dynamic_img_size", "dynamic_img_pad", *DROPOUTS)


def create_timm_model(cfg: ViTConfig, name: str | None = None, pretrained: bool = False) -> nn.Module:
    """timm's model for `cfg`: the registered `name` with cfg's arguments on top, or a bare
    VisionTransformer. Pretrained weights come through timm's own hub download."""
    import timm
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    from vitlab.convert.timm_eva import eva_kwargs, is_eva_config

    eva = is_eva_config(cfg)
    kwargs = eva_kwargs(cfg) if eva else timm_kwargs(cfg)
    if name is None:
        if pretrained:
            raise UserError("pretrained weights need a timm model name")
        return (Eva if eva else VisionTransformerDistilled if cfg.distilled else VisionTransformer)(**kwargs)
    check_timm_name(name)
    if not pretrained:
        return timm.create_model(name, **kwargs)
    with from_the_hub(name):
        return timm.create_model(name, pretrained=True, **kwargs)
