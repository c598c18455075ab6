"""The study's table and plot: the 4-process run's loss curve and the stopped-and-resumed run's, overlaid.
Usage: python experiments/elastic_resume/plot.py <OUT of run.sh>"""

import csv
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss_step"]) for r in csv.DictReader(f) if r.get("train/loss_step")}


def main(out: Path) -> None:
    four, stopped, resumed = (losses(out / name) for name in ("four", "stopped", "resumed_on_2"))
    after = {**stopped, **resumed}
    shared = sorted(set(four) & set(after))
    diff = max(abs(four[s] - after[s]) for s in shared)
    diff_after = max(abs(four[s] - resumed[s]) for s in resumed if s in four)
    first = min(resumed)
    weights = [torch.load(out / n / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
               for n in ("four", "resumed_on_2")]  # fmt: skip
    gaps = {k: (weights[0][k] - weights[1][k]).abs() for k in weights[0] if weights[0][k].is_floating_point()}
    key_bias = max(float(g.chunk(3)[1].max()) for k, g in gaps.items() if k.endswith("attn.qkv.bias"))
    for k, g in gaps.items():  # a key bias changes no output: its gradient is rounding (docs, Reliability)
        gaps[k] = torch.cat([g.chunk(3)[0], g.chunk(3)[2]]) if k.endswith("attn.qkv.bias") else g
    wdiff = max(float(g.max()) for g in gaps.values())
    metrics = [json.loads((out / n / "metrics.json").read_text()) for n in ("four", "resumed_on_2")]
    print(
        f"steps compared: {len(shared)} (the resumed run logs from step {first}); largest |loss gap|: {diff:.2e} "
        f"(after the resume: {diff_after:.2e}); largest |weight difference|: {wdiff:.2e} "
        f"(attention key biases: {key_bias:.2e})"
    )
    for key in ("val/acc", "val/loss", "test/acc"):
        print(f"{key}: four {metrics[0][key]:.6f}, stopped and resumed on 2 {metrics[1][key]:.6f}")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(four), [four[s] for s in sorted(four)], label="4 processes, uninterrupted", lw=3, alpha=0.5)
    ax.plot(sorted(stopped), [stopped[s] for s in sorted(stopped)], "--", label="4 processes, stopped (SIGTERM)")
    ax.plot(sorted(resumed), [resumed[s] for s in sorted(resumed)], ":", label="resumed on 2 processes", lw=2)
    ax.axvline(first - 1, color="grey", lw=0.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train/loss_step (global batch of 96)")
    ax.set_title(f"largest loss difference {diff:.1e}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(__file__).parent / "loss.png", dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
