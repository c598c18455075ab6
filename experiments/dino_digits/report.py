"""Table and plot of the DINO study (experiments/dino_digits) from outputs/dino_digits/seed*/.

python experiments/dino_digits/report.py outputs/dino_digits
"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ENCODERS = {
    "dino": "DINO-pretrained",
    "mae": "MAE-pretrained",
    "random": "random weights",
    "supervised": "supervised",
}
PROBES = {"knn": ("knn/top1_k20", "k-NN (k 20)"), "linear": ("linear/top1", "linear probe")}
COLORS = ("tab:green", "tab:blue", "tab:gray", "tab:orange")


def read(path: Path) -> dict:
    return json.loads((path / "metrics.json").read_text())


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ({statistics.stdev(values):.4f})" if len(values) > 1 else f"{values[0]:.4f}"


def paired(a: list[float], b: list[float]) -> str:
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return f"{100 * statistics.mean(d):+.1f} points (SE {100 * se:.1f})"


def main(root: Path) -> None:
    seeds = sorted(root.glob("seed*"), key=lambda p: int(p.name[4:]))
    probes = {(e, t): [read(s / f"{e}_{t}")[PROBES[t][0]] for s in seeds] for e in ENCODERS for t in PROBES}
    print(
        f"{len(seeds)} seeds ({', '.join(s.name[4:] for s in seeds)}); test accuracy on the 270 test digits, "
        "mean (std)\n"
    )
    print("| frozen encoder | " + " | ".join(label for _, label in PROBES.values()) + " |")
    print("|---|" + "---|" * len(PROBES))
    for e, name in ENCODERS.items():
        print(f"| {name} | " + " | ".join(mean_sd(probes[e, t]) for t in PROBES) + " |")
    print()
    for t, (_, label) in PROBES.items():
        for other in ("random", "mae"):
            print(
                f"{label}, DINO minus {ENCODERS[other]}, paired by seed: {paired(probes['dino', t], probes[other, t])}"
            )
    knn_end = [read(s / "dino")["test/knn_top1"] for s in seeds]
    print(f"\nDINO runs' own last line, test/knn_top1 (its best checkpoint by val k-NN): {mean_sd(knn_end)}")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, t in enumerate(PROBES):
        for j, e in enumerate(ENCODERS):
            x, vals = i + (j - 1.5) * 0.2, probes[e, t]
            ax.bar(x, statistics.mean(vals), 0.2, color=COLORS[j], label=ENCODERS[e] if i == 0 else None)
            ax.scatter([x] * len(vals), vals, s=6, color="k", zorder=3)
    ax.set(xticks=range(len(PROBES)), ylabel="test accuracy", ylim=(0, 1), title=f"digits, {len(seeds)} seeds (dots)")
    ax.set_xticklabels([label for _, label in PROBES.values()])
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(__file__).with_name("dino_digits.png")
    fig.savefig(out, dpi=100)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    main(parser.parse_args().root)
