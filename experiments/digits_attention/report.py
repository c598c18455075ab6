"""What the trained digits ViT attends to: a table over the whole test split and figures for a few
test digits.

    python experiments/digits_attention/report.py <checkpoint of the digits default run>
"""

import sys
from pathlib import Path

import torch

from vitlab.evaluation.figures import attention_rollout, plot_attention, plot_embeddings
from vitlab.training.run.inference import inference_datamodule, load_for_inference

HERE = Path(__file__).parent


def main(ckpt: str) -> None:
    module = load_for_inference(ckpt).eval()
    model = module.model
    dm = inference_datamodule(module, ckpt)
    dm.setup()
    x, y = dm.test_set.images, dm.test_set.labels
    x = dm.resize(x)
    with torch.no_grad():
        maps = model.attention_maps(x)  # [(N_img, heads, T, T)]
        pred = model(x).argmax(-1)
    print(f"test accuracy of this checkpoint: {(pred == y).float().mean():.4f} ({len(y)} images)\n")
    cols = [
        "block",
        "class token -> itself",
        "class token -> patches",
        "entropy of class-token attention (bits, max 2.32) per head",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|")
    for i, a in enumerate(maps):
        cls = a[:, :, 0, :]  # (N, heads, T): the class token's attention
        entropy = -(cls * cls.clamp_min(1e-12).log2()).sum(-1).mean(0)  # per head
        print(
            f"| {i} | {cls[..., 0].mean():.3f} | {cls[..., 1:].sum(-1).mean():.3f} | "
            + " ".join(f"{e:.2f}" for e in entropy)
            + " |"
        )
    rollout = attention_rollout(maps)[:, 0, 1:]  # (N, 4): rollout of the class token over the patches
    print(
        "\nmean rollout of the class token over the 2x2 patches (top-left, top-right, bottom-left, bottom-right):",
        " ".join(f"{v:.3f}" for v in rollout.mean(0) / rollout.mean(0).sum()),
    )
    plot_embeddings(model, HERE)
    for k, idx in enumerate((0, 100, 200)):
        files = plot_attention(model, x[idx : idx + 1], dm.mean, dm.std, HERE / f"digit{k}_{int(y[idx])}")
        names = ", ".join(str(f.relative_to(HERE)) for f in files.values())
        print(f"\ndigit {int(y[idx])} (predicted {int(pred[idx])}): {names}")


if __name__ == "__main__":
    main(sys.argv[1])
