"""Table and plot of the Gram anchoring study (experiments/gram) from outputs/gram/ (run.sh's two sweeps).

python experiments/gram/report.py outputs/gram
"""

import argparse
import itertools
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SCORES = {"knn/top1_k20": "k-NN top-1 (k 20, class token)", "seg/mIoU": "segmentation probe mIoU (patch tokens)"}
RUNS = {"0": "DINO", "1": "DINO + Gram anchoring"}
COLORS = {"0": "tab:blue", "1": "tab:red"}


def scores(root: Path) -> dict[tuple[str, str, int, str], float]:
    """{(gram weight, seed, epochs done, score): value} from the evaluation sweeps' jobs; epoch 0 is the seed's
    initialisation (the run with learning rate 0), the start of both of its runs."""
    out = {}
    for path in sorted([*(root / "eval").glob("*/metrics.json"), *(root / "random_eval").glob("*/metrics.json")]):
        m = json.loads(path.read_text())
        found = re.search(r"seed(\d+)_gram(\d+)(?:\.\d+)?/epochs/e(\d+)\.ckpt$", m["ckpt_path"])
        init = re.search(r"random/seed(\d+)/checkpoints/last\.ckpt$", m["ckpt_path"])
        runs = [(found[1], found[2], int(found[3]) + 1)] if found else [(init[1], g, 0) for g in RUNS]  # 0-based
        for (seed, gram, epoch), key in itertools.product(runs, SCORES):
            if key in m:
                out[gram, seed, epoch, key] = m[key]
    return out


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ({statistics.stdev(values):.4f})" if len(values) > 1 else f"{values[0]:.4f}"


def main(root: Path) -> None:
    s = scores(root)
    seeds = sorted({k[1] for k in s}, key=int)
    epochs = sorted({k[2] for k in s})
    print(f"{len(seeds)} seeds ({', '.join(seeds)}); test split (256 canvases), mean (std) over seeds\n")
    head = " | ".join(f"{SCORES[k].split(' (')[0]}, {RUNS[g]}" for k in SCORES for g in RUNS)
    print(f"| epochs | {head} |\n|---|" + "---|" * (len(SCORES) * len(RUNS)))
    for e in epochs:
        cells = [mean_sd([s[g, seed, e, k] for seed in seeds]) for k in SCORES for g in RUNS]
        print(f"| {e} | " + " | ".join(cells) + " |")
    last = epochs[-1]
    for k in SCORES:
        d = [s["1", seed, last, k] - s["0", seed, last, k] for seed in seeds]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        print(f"\n{SCORES[k]} at epoch {last}, with minus without Gram, paired by seed: "
              f"{statistics.mean(d):+.4f} (SE {se:.4f}); per seed {', '.join(f'{x:+.4f}' for x in d)}")  # fmt: skip
    for k in SCORES:
        peak = {g: [max(epochs, key=lambda e, g=g, seed=seed: s[g, seed, e, k]) for seed in seeds] for g in RUNS}
        print(f"{SCORES[k]}: the epoch of each seed's best, " + "; ".join(f"{RUNS[g]} {peak[g]}" for g in RUNS))

    fig, axes = plt.subplots(1, len(SCORES), figsize=(10, 3.6))
    for ax, (k, label) in zip(axes, SCORES.items(), strict=True):
        for g, name in RUNS.items():
            for seed in seeds:
                ax.plot(epochs, [s[g, seed, e, k] for e in epochs], color=COLORS[g], alpha=0.25, lw=1)
            mean = [statistics.mean(s[g, seed, e, k] for seed in seeds) for e in epochs]
            ax.plot(epochs, mean, color=COLORS[g], marker="o", lw=2, label=f"{name} (mean of {len(seeds)})")
        ax.axvline(4, color="gray", ls=":", lw=1)  # the Gram loss begins after epoch 4
        ax.set_xlabel("pretraining epochs")
        ax.set_title(label, fontsize=10)
        ax.set_xticks(epochs)
    axes[0].legend(fontsize=8)
    title = "DINO on the embedded segmentation canvases, with and without Gram anchoring (from epoch 5)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(__file__).parent / "gram.png"
    fig.savefig(out, dpi=110)
    print(f"\nplot: {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path, nargs="?", default=Path("outputs/gram"))
    main(parser.parse_args().root)
