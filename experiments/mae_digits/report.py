"""Tables and plot of the MAE study (experiments/mae_digits) from outputs/mae_digits/seed*/.

python experiments/mae_digits/report.py outputs/mae_digits
"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ENCODERS = {"mae": "MAE-pretrained", "random": "random weights", "scratch": "supervised from scratch"}
PROBES = {
    "knn": ("knn/top1_k20", "k-NN (k 20)"),
    "linear": ("linear/top1", "linear probe"),
    "fewshot": ("fewshot/10shot", "10-shot"),
}


def read(path: Path) -> dict:
    return json.loads((path / "metrics.json").read_text())


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ({statistics.stdev(values):.4f})" if len(values) > 1 else f"{values[0]:.4f}"


def curve(csv_path: Path, out: Path) -> None:
    """k-NN and 10-shot accuracy on the validation split (callbacks=representation) and the validation loss, by
    epoch of one pretraining run."""
    import csv

    rows = list(csv.DictReader(csv_path.open()))
    probes = [
        (int(r["epoch"]) + 1, float(r["knn/top1"]), float(r["fewshot/10shot"])) for r in rows if r.get("knn/top1")
    ]
    losses = [(int(r["epoch"]) + 1, float(r["val/loss"])) for r in rows if r.get("val/loss")]
    print("\n| epoch | val/loss | knn/top1 (k 20, val) | fewshot/10shot (val) |\n|---|---|---|---|")
    by_epoch = dict(losses)
    for epoch, knn, few in probes:
        print(f"| {epoch} | {by_epoch.get(epoch, float('nan')):.4f} | {knn:.4f} | {few:.4f} |")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([e for e, *_ in probes], [k for _, k, _ in probes], "o-", label="k-NN top-1 (val)")
    ax.plot([e for e, *_ in probes], [f for *_, f in probes], "s-", label="10-shot (val)")
    ax.set(xlabel="pretraining epoch", ylabel="accuracy", ylim=(0, 1), title="seed 1 while MAE pretrains")
    ax2 = ax.twinx()
    ax2.plot([e for e, _ in losses], [v for _, v in losses], color="tab:gray", lw=1, label="val/loss")
    ax2.set_ylabel("reconstruction loss (val)")
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main(root: Path) -> None:
    seeds = sorted(root.glob("seed*"), key=lambda p: int(p.name[4:]))
    probes = {(e, t): [read(s / f"{e}_{t}")[PROBES[t][0]] for s in seeds] for e in ENCODERS for t in PROBES}
    tuned = {k: [read(s / k)["test/acc"] for s in seeds] for k in ("finetune", "scratch")}
    pretrain = [read(s / "mae")["test/loss"] for s in seeds]
    print(
        f"{len(seeds)} seeds ({', '.join(s.name[4:] for s in seeds)}); test accuracy on the 270 test digits, "
        "mean (std)\n"
    )
    print("| frozen encoder | " + " | ".join(label for _, label in PROBES.values()) + " |")
    print("|---|" + "---|" * len(PROBES))
    for e, name in ENCODERS.items():
        print(f"| {name} | " + " | ".join(mean_sd(probes[e, t]) for t in PROBES) + " |")
    print("\n| fine-tuned (100 epochs, the scratch recipe) | test/acc |\n|---|---|")
    print(f"| from the MAE encoder | {mean_sd(tuned['finetune'])} |\n| from scratch | {mean_sd(tuned['scratch'])} |")
    diffs = [a - b for a, b in zip(tuned["finetune"], tuned["scratch"], strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    print(f"\nfine-tuned minus scratch, paired by seed: {statistics.mean(diffs):+.4f} (SE {se:.4f})")
    for t in PROBES:
        d = [a - b for a, b in zip(probes["mae", t], probes["random", t], strict=True)]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        print(f"{PROBES[t][1]}, MAE minus random weights: {statistics.mean(d):+.4f} (SE {se:.4f})")
    print(f"MAE pretraining test/loss (masked-patch MSE, normalised pixels): {mean_sd(pretrain)}")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    groups = [(PROBES[t][1], {ENCODERS[e]: probes[e, t] for e in ENCODERS}) for t in PROBES]
    groups.append(("fine-tuned", {"MAE-pretrained": tuned["finetune"], "supervised from scratch": tuned["scratch"]}))
    colors = dict(zip(ENCODERS.values(), ("tab:blue", "tab:gray", "tab:orange"), strict=True))
    for i, (_, bars) in enumerate(groups):
        for j, (name, vals) in enumerate(bars.items()):
            x = i + (j - (len(bars) - 1) / 2) * 0.25
            ax.bar(
                x,
                statistics.mean(vals),
                0.25,
                color=colors[name],
                label=name if i == 0 or name not in ENCODERS.values() else None,
            )
            ax.scatter([x] * len(vals), vals, s=6, color="k", zorder=3)
    ax.set(
        xticks=range(len(groups)),
        ylabel="test accuracy",
        ylim=(0, 1),
        title=f"digits, {len(seeds)} seeds (dots: seeds)",
    )
    ax.set_xticklabels([g for g, _ in groups])
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        dict(zip(labels, handles, strict=True)).values(),
        dict(zip(labels, handles, strict=True)).keys(),
        fontsize=8,
        loc="lower left",
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(__file__).with_name("mae_digits.png")
    fig.savefig(out, dpi=100)
    print(f"\nwrote {out}")
    if found := sorted(root.glob("curve/csv/metrics.csv")):
        curve(found[0], Path(__file__).with_name("representation.png"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    main(parser.parse_args().root)
