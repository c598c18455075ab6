"""The study's plot (feature_distillation.png): each student's k-NN and linear-probe test top-1 per seed and mean,
the teachers' as lines, from run.sh's folders: `python experiments/feature_distillation/plot.py <OUT>`."""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from table import KNN, LINEAR, ROWS  # noqa: E402  (this folder, on the path as the script runs)


def _scores(out: Path, name: str, task: str, key: str) -> list[float]:
    files = sorted((out / name).glob(f"seed*/{task}/metrics.json"))
    return [100 * json.loads(f.read_text())[key] for f in files]


def main(out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = [name for name, _, _ in ROWS if (out / name).is_dir()]
    probes = [("knn", KNN, "k-NN top-1 (k 20)"), ("linear", LINEAR, "linear probe")]
    for ax, (task, key, title) in zip(axes, probes, strict=True):
        for i, name in enumerate(names):
            scores = _scores(out, name, task, key)
            ax.bar(i, statistics.mean(scores), width=0.6, alpha=0.5)
            ax.scatter([i] * len(scores), scores, color="k", s=12, zorder=3)
        for teacher, student, style in (("DINO", "feature", "--"), ("supervised", "logits", ":")):
            first = out / student / "seed1" / task / "metrics.json"
            if first.is_file():
                ax.axhline(100 * json.loads(first.read_text())[f"teacher/{key}"], ls=style, c="gray",
                           label=f"teacher: {teacher}")  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8, loc="lower left")
    axes[0].set_ylabel("test accuracy (%), 3 seeds")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("feature_distillation.png"), dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/feature_distillation"))
