"""The study's plot (peft.png): each peft= choice's test accuracy per seed and mean, against its trainable
parameters (log scale), from run.sh's folders: `python experiments/peft/plot.py <OUT>`."""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from table import RUNS  # noqa: E402  (this folder, on the path as the script runs)

from vitlab.training.run.inference import load_for_inference  # noqa: E402


def main(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in RUNS:
        seeds = sorted(d for d in (out / name).glob("seed*") if (d / "metrics.json").is_file())
        if not seeds:
            continue
        acc = [100 * json.loads((d / "metrics.json").read_text())["test/acc"] for d in seeds]
        module = load_for_inference(str(seeds[0] / "checkpoints" / "last.ckpt"))
        params = module.model.parameters()
        trainable = sum(p.numel() for p in params if p.requires_grad or not module.hparams.get("peft"))
        ax.scatter([trainable] * len(acc), acc, color="k", s=12, zorder=3)
        ax.scatter([trainable], [statistics.mean(acc)], s=60, alpha=0.6, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("fine-tuning a DINO-pretrained digits ViT: 30 epochs, 3 seeds")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("peft.png"), dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/peft-study30"))
