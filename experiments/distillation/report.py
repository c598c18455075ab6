"""Table and plot for experiments/distillation from the runs of run.sh.

python experiments/distillation/report.py outputs/distillation
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

CONDITIONS = {
    "none": "no distillation",
    "token_hard": "distillation token, hard (DeiT)",
    "logits_soft": "logits, soft, tau 2 (Hinton)",
}


def params(ckpt: str) -> int:
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return sum(v.numel() for k, v in sd.items() if k.startswith("model."))


def main(out: Path) -> None:
    teacher = json.loads((out / "teacher" / "metrics.json").read_text())
    print(f"teacher: test/acc {teacher['test/acc']:.4f}, {params(teacher['tested_checkpoint']):,} parameters, "
          f"{teacher['wall_time_s']:.0f} s")  # fmt: skip
    print()
    print(
        "| student | params | seeds | test/acc per seed | test/acc mean (std) | val/acc_best mean | time per run (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, label in CONDITIONS.items():
        runs = [json.loads(p.read_text()) for p in sorted((out / name).glob("*/metrics.json"))]
        accs = [r["test/acc"] for r in runs]
        results[label] = accs
        mean, std = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(
            f"| {label} | {params(runs[0]['tested_checkpoint']):,} | {len(runs)} | "
            f"{', '.join(f'{a:.4f}' for a in accs)} | {mean:.4f} ({std:.4f}) | "
            f"{statistics.mean(r['val/acc_best'] for r in runs):.4f} | "
            f"{statistics.mean(r['wall_time_s'] for r in runs):.0f} |"
        )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (label, accs) in enumerate(results.items()):
        ax.bar(i, statistics.mean(accs), width=0.6, alpha=0.5)
        ax.scatter([i] * len(accs), accs, color="k", zorder=3, s=12)
    ax.axhline(teacher["test/acc"], color="C3", linestyle="--", label=f"teacher {teacher['test/acc']:.3f}")
    ax.set(xticks=range(len(results)), ylabel="test accuracy", ylim=(0.85, 1.0),
           title=f"digits: student (dim 32, depth 2), 100 epochs, {len(accs)} seeds")  # fmt: skip
    ax.set_xticklabels(list(results), fontsize=8)
    ax.legend(loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("distillation.png"), dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
