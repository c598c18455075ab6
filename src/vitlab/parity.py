"""python -m vitlab.parity model=<name> [overrides]: vitlab's ViT against timm's, layer by layer.

Both models get the same weights (timm's pretrained ones with `pretrained=true` when they can be had,
random ones otherwise), see the same fixed batch in fp32 eval mode, and are compared at the patch
embedding, after every block, at the final features and the logits; then one backward pass of the
same loss compares every parameter's gradient. Exits 1 when the logits or gradients differ beyond
tolerance. Writes parity.json in the run directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from vitlab.cli import entry_point, vit_config
from vitlab.convert.timm import create_timm_model, timm_to_vitlab, vitlab_to_timm
from vitlab.errors import OfflineError, UserError
from vitlab.model import ViT, ViTConfig

log = logging.getLogger(__name__)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.detach().double() - b.detach().double()).abs()
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item()}


def _timm_taps(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks that record timm's patch embedding and every block's output by our names."""
    taps: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            taps[name] = output.flatten(1, 2) if output.ndim == 4 else output

        return hook

    handles = [model.patch_embed.register_forward_hook(keep("patch_embed"))]
    handles += [blk.register_forward_hook(keep(f"blocks.{i}")) for i, blk in enumerate(model.blocks)]
    return taps, handles


def compare(
    cfg: ViTConfig, timm_name: str | None = None, pretrained: bool = False, batch_size: int = 2, seed: int = 0
) -> dict[str, Any]:
    """Build both models with the same weights, run the same batch, return every difference."""
    torch.manual_seed(seed)
    weights = "random"
    if pretrained:
        if not timm_name:
            raise UserError("pretrained=true needs a model with a timm counterpart (model.timm_name)")
        try:
            theirs = create_timm_model(cfg, timm_name, pretrained=True)
        except OfflineError as e:  # never report a check of weights that were not loaded
            raise OfflineError(f"{e}; or check parity on random weights with pretrained=false") from e
        weights = f"timm pretrained ({timm_name})"
    if pretrained:
        ours = ViT(cfg)
        ours.load_state_dict(timm_to_vitlab(theirs.state_dict(), cfg))
    else:
        ours = ViT(cfg)
        theirs = create_timm_model(cfg, timm_name)
        theirs.load_state_dict(vitlab_to_timm(ours.state_dict(), cfg))
    ours.eval()
    theirs.eval()

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.in_chans, *cfg.img_hw, generator=g)

    names = ["patch_embed"] + [f"blocks.{i}" for i in range(cfg.depth)] + ["norm"]
    ours_out = ours.forward_intermediates(x, names)
    logits_ours = ours.forward_head(ours_out["norm"])
    taps, handles = _timm_taps(theirs)
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
    return {
        "model": {"timm_name": timm_name, "config": cfg.to_dict()},
        "weights": weights,
        "batch_size": batch_size,
        "seed": seed,
        "layers": layers,
        "top1_agreement": top1,
        "grad": {
            "max_abs": worst,
            "worst_param": worst_name,
            "max_grad": scale,
            "relative": worst / scale if scale else 0.0,
        },
    }


def passes(report: dict[str, Any], atol: float, grad_rtol: float) -> bool:
    return (
        report["layers"]["logits"]["max_abs"] <= atol
        and report["top1_agreement"] == 1.0
        and report["grad"]["relative"] <= grad_rtol
    )


def print_report(report: dict[str, Any], atol: float, grad_rtol: float) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = passes(report, atol, grad_rtol)
    title = f"vitlab vs timm ({report['model']['timm_name'] or 'VisionTransformer'}, {report['weights']} weights)"
    table = Table(title=title)
    table.add_column("output")
    table.add_column("max |diff|", justify="right")
    table.add_column("mean |diff|", justify="right")
    for name, d in report["layers"].items():
        table.add_row(name, f"{d['max_abs']:.3e}", f"{d['mean_abs']:.3e}")
    console = Console()
    console.print(table)
    g = report["grad"]
    console.print(f"top-1 agreement: {report['top1_agreement']:.3f}")
    console.print(
        f"gradients: max |diff| {g['max_abs']:.3e} at {g['worst_param']} "
        f"(relative {g['relative']:.3e} of max |grad| {g['max_grad']:.3e})"
    )
    verdict = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
    console.print(
        f"{verdict}: logits max |diff| {report['layers']['logits']['max_abs']:.3e} "
        f"(tolerance {atol:g}), gradient relative diff tolerance {grad_rtol:g}"
    )


@entry_point("parity")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    report = compare(vit_config(cfg.model), cfg.model.timm_name, cfg.pretrained, cfg.batch_size, cfg.seed)
    report.update(atol=cfg.atol, grad_rtol=cfg.grad_rtol, passed=passes(report, cfg.atol, cfg.grad_rtol))
    print_report(report, cfg.atol, cfg.grad_rtol)
    out = Path(HydraConfig.get().runtime.output_dir) / "parity.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if not report["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
