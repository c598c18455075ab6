"""Which ViT fits how many 80 GB GPUs under DDP and under FSDP, by vitlab's start-up estimate (training/devices/memory.py):
AdamW, bf16-mixed, the paper's resolution (224 px), with and without gradient checkpointing. The models are built
on the meta device (no memory), so the biggest costs nothing here.

    python experiments/sharding/fit_table.py [--batch 32] [--budget-gb 72]

Writes fit_table.json and fit.png beside this file and prints the README's table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vitlab.model.config import ViTConfig
from vitlab.training.devices import memory
from vitlab.training.module import ViTModule

HERE = Path(__file__).parent
MODELS = {"B/16": "vit_b16", "L/16": "vit_l16", "H/14": "vit_h14", "g/14": "vit_g14", "G/14": "vit_gigantic14"}
GPUS = (1, 2, 4, 8, 16, 32, 64)


def per_gpu(variant: str, batch: int, checkpointing: bool) -> dict:
    with torch.device("meta"):
        module = ViTModule(model=ViTConfig.from_variant(variant, grad_checkpointing=checkpointing).to_dict())
    out: dict = {"params": sum(p.numel() for p in module.model.parameters())}
    for strategy, sharded in (("ddp", False), ("fsdp", True)):
        runs = [memory.estimate(module, "adamw", batch, n, "bf16-mixed", sharded, device="cuda") for n in GPUS]
        out[strategy] = [e.total / memory.GB for e in runs]
        out[f"{strategy}_state"] = [(e.total - e.activations) / memory.GB for e in runs]
    out["activations_per_image"] = runs[0].activations / batch / memory.GB
    return out


def largest_batch(state_gb: float, per_image_gb: float, budget: float) -> int:
    return max(0, int((budget - state_gb) / per_image_gb))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32, help="images per GPU (the plot)")
    parser.add_argument("--budget-gb", type=float, default=72.0, help="of an 80 GB GPU, leaving room for CUDA")
    args = parser.parse_args()
    rows = {f"{v}{' +ckpt' * c}": per_gpu(v, args.batch, c) for v in MODELS for c in (False, True)}
    (HERE / "fit_table.json").write_text(json.dumps({"batch": args.batch, "gpus": GPUS, "rows": rows}, indent=2))
    eight = GPUS.index(8)
    print(
        "| model | params | weights, gradients, AdamW (+ DDP's buckets, FSDP's gathered blocks) per GPU of 8: "
        f"DDP / FSDP | activations per image | largest batch per GPU in {args.budget_gb:.0f} GB, 8 GPUs: DDP / FSDP |"
    )
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        ddp, fsdp, act = r["ddp_state"][eight], r["fsdp_state"][eight], r["activations_per_image"]
        print(
            f"| {name} | {r['params'] / 1e6:,.0f}M | {ddp:.1f} / {fsdp:.1f} GB | {act * 1000:.0f} MB | "
            f"{largest_batch(ddp, act, args.budget_gb)} / {largest_batch(fsdp, act, args.budget_gb)} |"
        )
    plot(rows, args)


def plot(rows: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, suffix in zip(axes, ("", " +ckpt"), strict=True):
        for i, variant in enumerate(MODELS):
            r = rows[variant + suffix]
            ax.plot(GPUS, r["fsdp"], "o-", color=f"C{i}", label=f"{variant} FSDP")
            ax.plot(GPUS, r["ddp"], "--", color=f"C{i}", label=f"{variant} DDP")
        ax.axhline(args.budget_gb, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="GPUs", title=f"{args.batch} images/GPU, bf16, AdamW{suffix}")
        ax.set_xticks(GPUS, [str(n) for n in GPUS])
    axes[0].set_ylabel("GB per GPU (estimate)")
    axes[1].legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(HERE / "fit.png", dpi=120)


if __name__ == "__main__":
    main()
