"""python -m vitlab.visualize run_dir=<training run>: figures as PNG files (matplotlib, no display).

Implemented: the learning curves of a run (loss, accuracy and learning rate from its CSV log).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig

from vitlab.cli import entry_point


def read_csv_log(run_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """Every logged series of a run's CSVLogger file as (epoch or step, value) pairs."""
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"run_dir {str(run_dir)!r} has no csv/metrics.csv (train with logger=csv or many)")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key in ("epoch", "step") or value in ("", None):
                    continue
                x = row["step"] if key.startswith("lr-") or key.endswith("_step") else row["epoch"]
                if x not in ("", None):
                    series[key].append((float(x), float(value)))
    return series


def plot_learning_curves(run_dir: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = read_csv_log(Path(run_dir))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("train/loss", "train"), ("val/loss", "val")):
        if s.get(key):
            axes[0].plot(*zip(*s[key], strict=True), label=label)
    axes[0].set(title="loss", xlabel="epoch")
    for key, label in (("train/acc", "train"), ("val/acc", "val")):
        if s.get(key):
            axes[1].plot(*zip(*s[key], strict=True), label=label)
    if s.get("test/acc"):
        axes[1].axhline(s["test/acc"][-1][1], color="k", ls="--", lw=1, label=f"test {s['test/acc'][-1][1]:.4f}")
    axes[1].set(title="accuracy", xlabel="epoch")
    lr = next((k for k in sorted(s) if k.startswith("lr-")), None)
    if lr:
        axes[2].plot(*zip(*s[lr], strict=True))
    axes[2].set(title="learning rate", xlabel="step")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@entry_point("visualize")
def main(cfg: DictConfig) -> None:
    if not cfg.run_dir:
        raise ValueError("give run_dir=<a training run directory>")
    out = plot_learning_curves(cfg.run_dir, Path(cfg.paths.output_dir) / "learning_curves.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
