"""python -m vitlab.parity model=<name> [overrides]: vitlab's ViT against timm's, layer by layer
(vitlab.convert.compare). Prints a table, writes parity.json in the run directory, and exits 1 when the
logits or gradients differ beyond tolerance.

python -m vitlab.parity timm_zoo=all (or a pattern, 'vit_base*'): every architecture registered in timm's
vision_transformer and deit modules, as timm registers it with depth capped at 2, converted both ways and compared;
writes timm_zoo.json and the table timm_zoo.md, and exits 1 when an expressible one differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point
from vitlab.model.config import vit_config


def print_report(report: dict[str, Any], atol: float, grad_rtol: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from vitlab.convert.compare import passes

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


def zoo(cfg: DictConfig) -> None:
    from vitlab.convert.compare import timm_zoo, zoo_table

    rows = timm_zoo(cfg.timm_zoo, cfg.zoo_depth, cfg.batch_size, cfg.seed, cfg.atol, cfg.grad_rtol)
    out = Path(cfg.paths.output_dir)
    (out / "timm_zoo.json").write_text(json.dumps(rows, indent=2))
    (out / "timm_zoo.md").write_text(zoo_table(rows, cfg.atol))
    expressible = [r for r in rows if r["expressible"]]
    failed = [r["arch"] for r in expressible if not r["passed"]]
    print(f"{len(expressible)} of {len(rows)} expressible; {len(expressible) - len(failed)} match timm to {cfg.atol:g}")
    print(f"wrote {out / 'timm_zoo.md'}")
    if failed:
        raise SystemExit(f"differ from timm: {failed}")


@entry_point("parity")
def main(cfg: DictConfig) -> None:
    from vitlab.convert.compare import compare, passes

    if cfg.timm_zoo:
        return zoo(cfg)
    report = compare(vit_config(cfg.model), cfg.model.timm_name, cfg.pretrained, cfg.batch_size, cfg.seed)
    report.update(atol=cfg.atol, grad_rtol=cfg.grad_rtol, passed=passes(report, cfg.atol, cfg.grad_rtol))
    print_report(report, cfg.atol, cfg.grad_rtol)
    out = Path(cfg.paths.output_dir) / "parity.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if not report["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
