"""Table and plot for experiments/digits_sweep from the sweep's summary.json.

python experiments/digits_sweep/report.py outputs/digits_sweep
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(sweep: Path) -> None:
    rows = json.loads((sweep / "summary.json").read_text())
    for r in rows:
        r.update(dict(o.split("=", 1) for o in r["overrides"] if o.startswith("model.")))
    rows.sort(key=lambda r: (int(r["model.patch_size"]), int(r["model.depth"]), float(r["model.drop_path_rate"])))
    print("| patch (tokens) | depth | drop-path | val/acc_best | test/acc | test/loss | time (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p = int(r["model.patch_size"])
        print(
            f"| {p} ({(8 // p) ** 2}) | {r['model.depth']} | {r['model.drop_path_rate']} | {r['val/acc_best']:.4f} | "
            f"{r['test/acc']:.4f} | {r['test/loss']:.3f} | {r['wall_time_s']:.0f} |"
        )
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"p{r['model.patch_size']} d{r['model.depth']} dp{r['model.drop_path_rate']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["val/acc_best"] for r in rows], width=0.4, label="val/acc_best")
    ax.bar([x + 0.2 for x in xs], [r["test/acc"] for r in rows], width=0.4, label="test/acc")
    ax.set(xticks=list(xs), ylim=(0.8, 1.0), ylabel="accuracy", title="digits, 100 epochs, seed 42")
    ax.set_xticklabels(labels, rotation=30, fontsize=8)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("sweep.png"), dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
