"""vitlab's ViT against timm's, layer by layer: both get the same weights (timm's pretrained ones, or
random ones ported across), see the same fixed batch in fp32 eval mode, and are compared at the patch
embedding, after every block, at the final features and the logits; then one backward pass of the
same loss compares every parameter's gradient. `compare_timm_arch` does the same for any architecture
timm registers, built from timm's own arguments. Pure torch + timm (no Hydra): `python -m vitlab.parity`
and the parity-zoo study call it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitlab.convert.timm_args import config_from_timm, create_timm_model, timm_model_args
from vitlab.convert.timm_hub import timm_vit_names
from vitlab.convert.weights import check_state_dict, fit_state_dict
from vitlab.model import ViT, ViTConfig
from vitlab.utils.errors import OfflineError, UserError


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.detach().double() - b.detach().double()).abs()
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item()}


def timm_taps(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks that record timm's patch embedding and every block's output by our names."""
    taps: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            taps[name] = output.flatten(1, 2) if output.ndim == 4 else output

        return hook

    handles = [model.patch_embed.register_forward_hook(keep("patch_embed"))]
    handles += [blk.register_forward_hook(keep(f"blocks.{i}")) for i, blk in enumerate(model.blocks)]
    return taps, handles


def build_pair(cfg: ViTConfig, timm_name: str | None, pretrained: bool) -> tuple[ViT, nn.Module, str]:
    """Our ViT and timm's with the same weights: timm's pretrained ones ported into ours, or ours
    (random) ported into timm's. Offline, pretrained weights are an error: never a silent fallback."""
    if pretrained:
        if not timm_name:
            raise UserError("pretrained=true needs a model with a timm counterpart (model.timm_name)")
        try:
            theirs = create_timm_model(cfg, timm_name, pretrained=True)
        except OfflineError as e:  # never report a check of weights that were not loaded
            raise OfflineError(f"{e}; or check parity on random weights with pretrained=false") from e
        ours = ViT(cfg)
        ours.load_state_dict(fit_state_dict(theirs.state_dict(), cfg))
        weights = f"timm pretrained ({timm_name})"
    else:
        ours = ViT(cfg)
        theirs = create_timm_model(cfg, timm_name)
        theirs.load_state_dict(check_state_dict(ours.state_dict(), cfg))
        weights = "random"
    return ours.eval(), theirs.eval(), weights


def gradient_diff(ours: nn.Module, theirs: nn.Module) -> dict[str, Any]:
    """The largest difference between the two models' parameter gradients, and where."""
    grads_theirs = dict(theirs.named_parameters())
    worst, worst_name, scale = 0.0, "", 0.0
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        q = grads_theirs[name].grad
        d = (p.grad.double() - q.double()).abs().max().item()
        scale = max(scale, q.abs().max().item())
        if d >= worst:
            worst, worst_name = d, name
    return {"max_abs": worst, "worst_param": worst_name, "max_grad": scale, "relative": worst / scale if scale else 0.0}


def compare(
    cfg: ViTConfig, timm_name: str | None = None, pretrained: bool = False, batch_size: int = 2, seed: int = 0
) -> dict[str, Any]:
    """Build both models with the same weights, run the same batch, return every difference."""
    torch.manual_seed(seed)
    ours, theirs, weights = build_pair(cfg, timm_name, pretrained)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.in_chans, *cfg.img_hw, generator=g)

    names = ["patch_embed"] + [f"blocks.{i}" for i in range(cfg.depth)] + ["norm"]
    ours_out = ours.intermediates_by_name(x, names)
    logits_ours = ours.forward_head(ours_out["norm"])
    taps, handles = timm_taps(theirs)
    feats_theirs = theirs.forward_features(x)
    logits_theirs = theirs.forward_head(feats_theirs)
    for h in handles:
        h.remove()

    layers = {name: _diff(ours_out[name], taps[name]) for name in names[:-1]}
    layers["features"] = _diff(ours_out["norm"], feats_theirs)
    layers["logits"] = _diff(logits_ours, logits_theirs)
    top1 = (logits_ours.argmax(-1) == logits_theirs.argmax(-1)).float().mean().item()

    # One backward pass of the same loss: a fixed random projection of the outputs.
    w = torch.randn(logits_ours.shape, generator=g)
    (logits_ours * w).sum().backward()
    (logits_theirs * w).sum().backward()
    return {
        "model": {"timm_name": timm_name, "config": cfg.to_dict()},
        "weights": weights,
        "batch_size": batch_size,
        "seed": seed,
        "layers": layers,
        "top1_agreement": top1,
        "grad": gradient_diff(ours, theirs),
    }


def passes(report: dict[str, Any], atol: float, grad_rtol: float) -> bool:
    return (
        report["layers"]["logits"]["max_abs"] <= atol
        and report["top1_agreement"] == 1.0
        and report["grad"]["relative"] <= grad_rtol
    )


def compare_timm_arch(name: str, depth_cap: int = 2, batch_size: int = 1, seed: int = 0) -> dict[str, Any]:
    """One architecture of timm's vision_transformer and deit modules as timm registers it (depth capped at
    `depth_cap`), against our ViT of `config_from_timm`: expressible or why not, the weights converted
    timm -> vitlab -> timm (bit-identical?), the logits' and the gradients' largest difference."""
    import timm

    depth = min(int(timm_model_args(name).get("depth", 12)), depth_cap)
    row: dict[str, Any] = {"arch": name, "depth": depth}
    try:
        cfg = config_from_timm(name, depth=depth)
    except UserError as e:
        return {**row, "expressible": False, "reason": str(e).split(": ", 1)[-1]}
    torch.manual_seed(seed)
    theirs = timm.create_model(name, pretrained=False, depth=depth).eval()
    ours = ViT(cfg).eval()
    ours.load_state_dict(fit_state_dict(theirs.state_dict(), cfg))
    back = check_state_dict(ours.state_dict(), cfg)
    round_trip = back.keys() == theirs.state_dict().keys() and all(
        torch.equal(back[k], v) for k, v in theirs.state_dict().items()
    )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.in_chans, *cfg.img_hw, generator=g)
    logits_ours, logits_theirs = ours(x), theirs(x)
    w = torch.randn(logits_ours.shape, generator=g)
    (logits_ours * w).sum().backward()
    (logits_theirs * w).sum().backward()
    return {
        **row,
        "expressible": True,
        "reason": "",
        "round_trip_exact": round_trip,
        "logits_max_abs": (logits_ours - logits_theirs).abs().max().item(),
        "grad": gradient_diff(ours, theirs),
    }


def timm_zoo(
    pattern: str, depth_cap: int = 2, batch_size: int = 1, seed: int = 0, atol: float = 1e-5, grad_rtol: float = 1e-4
) -> list[dict[str, Any]]:
    """`compare_timm_arch` for every architecture of timm's vision_transformer and deit modules matching `pattern`
    ('all', or a glob), each row marked `passed` (expressible, round trip exact, within both tolerances);
    prints a line per architecture as it goes."""
    import fnmatch

    names = [n for n in timm_vit_names() if pattern == "all" or fnmatch.fnmatch(n, pattern)]
    if not names:
        raise UserError(f"timm_zoo {pattern!r} matches no architecture of timm's vision_transformer and deit modules")
    rows = []
    for i, name in enumerate(names):
        row = compare_timm_arch(name, depth_cap, batch_size, seed)
        row["passed"] = row["expressible"] and (
            row["round_trip_exact"] and row["logits_max_abs"] <= atol and row["grad"]["relative"] <= grad_rtol
        )
        rows.append(row)
        shown = f"logits {row['logits_max_abs']:.1e}" if row["expressible"] else f"not expressible: {row['reason']}"
        print(f"[{i + 1}/{len(names)}] {name}: {shown}", flush=True)
    return rows


def zoo_table(rows: list[dict[str, Any]], atol: float) -> str:
    """The rows of `timm_zoo` as a markdown table."""
    lines = [
        f"| arch | depth | expressible | max logit diff | grad diff (rel.) | round trip exact | within {atol:g} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["expressible"]:
            cells = ["yes", f"{r['logits_max_abs']:.1e}", f"{r['grad']['relative']:.1e}"]
            cells += [str(r["round_trip_exact"]).lower(), "yes" if r["passed"] else "**no**"]
        else:
            cells = [f"no: {r['reason']}", "", "", "", ""]
        lines.append(f"| {r['arch']} | {r['depth']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
