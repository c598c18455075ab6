"""Table and plot for experiments/soups from what run.sh wrote.

python experiments/soups/report.py outputs/soups
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEEDS = (0, 1, 2)
METHODS = ("best single", "uniform soup", "greedy soup", "top-3 average")


def per_seed(out: Path, seed: int) -> dict[str, tuple[float, float, str]]:
    """method -> (val/acc, test/acc, what it is made of) for one seed's sweep."""
    sweep = out / f"seed{seed}"
    rows = json.loads((sweep / "summary.json").read_text())
    best = max(rows, key=lambda r: r["val/acc_best"])  # chosen on validation, as the soups are
    settings = " ".join(o for o in best["overrides"] if o.startswith(("optim.lr", "data.shift")))
    found = {"best single": (best["val/acc_best"], best["test/acc"], f"job {best['job']}: {settings}")}
    for method in ("uniform_soup", "greedy_soup"):
        soup = json.loads((out / f"seed{seed}-{method}" / "soup.json").read_text())
        made = f"{len(soup['soup']['jobs'])} of {len(soup['ingredients'])} (jobs {', '.join(soup['soup']['jobs'])})"
        found[method.replace("_", " ")] = (soup["soup"]["val/acc"], soup["soup"]["test/acc"], made)
    top3 = json.loads((out / f"seed{seed}-top3-eval" / "metrics.json").read_text())
    found["top-3 average"] = (float("nan"), top3["test/acc"], f"job {best['job']}'s 3 best epochs")
    return found


def main(out: Path) -> None:
    results = {s: per_seed(out, s) for s in SEEDS}
    print("| method | " + " | ".join(f"test/acc seed {s}" for s in SEEDS) + " | mean ± std | what (seed 0) |")
    print("|---|" + "---|" * (len(SEEDS) + 2))
    for m in METHODS:
        accs = [results[s][m][1] for s in SEEDS]
        cells = " | ".join(f"{a:.4f}" for a in accs)
        print(f"| {m} | {cells} | {statistics.mean(accs):.4f} ± {statistics.pstdev(accs):.4f} | {results[0][m][2]} |")
    print("\n| method | " + " | ".join(f"val/acc seed {s}" for s in SEEDS) + " |")
    print("|---|" + "---|" * len(SEEDS))
    for m in METHODS[:3]:
        print(f"| {m} | " + " | ".join(f"{results[s][m][0]:.4f}" for s in SEEDS) + " |")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, m in enumerate(METHODS):
        accs = [results[s][m][1] for s in SEEDS]
        ax.bar(i, statistics.mean(accs), color="#9bb8d3", width=0.6)
        ax.scatter([i] * len(accs), accs, color="#1f4e79", zorder=3, s=14)
    ax.set_xticks(range(len(METHODS)), METHODS)
    ax.set_ylim(0.9, 1.0)
    ax.set_ylabel("test accuracy (270 digits)")
    ax.set_title("Digits fine-tunes: one model vs soups vs a checkpoint average (3 seeds)")
    fig.tight_layout()
    fig.savefig(Path(__file__).parent / "soups.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/soups"))
