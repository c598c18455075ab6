"""k-NN, linear probe and few-shot on one checkpoint: `python -m vitlab.eval task=...` beside each reference's own
code (reference.py) run on the very features our command cached, printed side by side.

    python experiments/eval_protocols/study.py [OUT] [--augment]   # OUT: outputs/eval_protocols (not committed)

Trains the digits default for 3 epochs (seed 0) unless OUT/run/metrics.json exists, runs the three tasks, then the
references; writes OUT/results.json and experiments/eval_protocols/protocols.png.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference import big_vision_fewshot, dino_knn, dinov2_linear  # noqa: E402

HERE = Path(__file__).parent
KS = (10, 20, 100, 200)


def vitlab(command: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", f"vitlab.{command}", *args, "progress_bar=none"], check=True)


def ours(out: Path) -> tuple[dict, Path]:
    run = out / "run"
    if not (run / "metrics.json").is_file():
        vitlab("train", "trainer.max_epochs=3", "seed=0", f"hydra.run.dir={run}")
    ckpt = json.loads((run / "metrics.json").read_text())["best_checkpoint"]
    found = {}
    runs = {"knn": ["task=knn"], "linear": ["task=linear"], "fewshot": ["task=fewshot"]}
    if "--augment" in sys.argv:  # DINOv2's own training data: features of augmented images, 12,500 model passes
        runs["linear_augment"] = ["task=linear", "linear.augment=true"]
    for name, args in runs.items():
        started = time.time()
        if not (out / name / "metrics.json").is_file():
            vitlab("eval", f"ckpt_path={ckpt}", *args, f"hydra.run.dir={out / name}")
        found[name] = json.loads((out / name / "metrics.json").read_text()) | {"wall_s": round(time.time() - started)}
    return found, run / "features" / Path(ckpt).stem


def load(cache: Path, split: str, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    stem = f"{split}.{name}" if name else split
    return torch.from_numpy(np.load(cache / f"{stem}.npy")), torch.from_numpy(np.load(cache / f"{stem}.labels.npy"))


def references(cache: Path, out: Path, num_classes: int = 10) -> dict:
    (train, train_y), (test, test_y) = load(cache, "train"), load(cache, "test")
    nt, ntest = torch.nn.functional.normalize(train, dim=1), torch.nn.functional.normalize(test, dim=1)
    found = {}
    for k in KS:
        top1, top5 = dino_knn(nt, train_y, ntest, test_y, k, 0.07, num_classes)
        found[f"knn/top1_k{k}"], found[f"knn/top5_k{k}"] = top1 / 100, top5 / 100
    fewshot = big_vision_fewshot(train.numpy(), train_y.numpy(), test.numpy(), test_y.numpy(), num_classes)
    found |= {f"fewshot/{key}": v for key, v in fewshot.items()}
    # DINOv2's grid: the class tokens of the last 1 or 4 blocks, with or without the last block's mean patch token.
    name = next(p.name for p in cache.glob("train.blocks*+avgpool.npy")).removeprefix("train.").removesuffix(".npy")
    splits = {s: load(cache, s, name) for s in ("train", "val", "test")}
    width = splits["train"][0].shape[1] // 5
    views = {f"last{n}" + ("+avgpool" if a else ""): tuple(splits[s][0][:, (4 - n) * width : (4 + a) * width]
             for s in ("train", "val", "test")) for n in (1, 4) for a in (False, True)}  # fmt: skip
    labels = splits["train"][1], splits["val"][1], splits["test"][1]
    saved = out / "reference_linear.json"  # 12,500 steps of 52 heads: computed once
    if not saved.is_file():
        started = time.time()
        linear = dinov2_linear(views, *labels, num_classes)
        saved.write_text(json.dumps(linear | {"wall_s": round(time.time() - started)}))
    linear = json.loads(saved.read_text())
    found |= {"linear/top1": linear["test_top1"], "linear/val_top1": linear["val_top1"],
              "linear/classifier": linear["classifier"], "linear/wall_s": linear["wall_s"]}  # fmt: skip
    # vitlab's probe before issue 39, for contrast: epochs 10 x floor(1257 / 256) = 40 steps of 256, lr x 256 / 256
    old = dinov2_linear(views, *labels, num_classes, epochs=10, epoch_length=len(labels[0]) // 256, batch_size=256)
    found |= {"linear_old/top1": old["test_top1"], "linear_old/val_top1": old["val_top1"]}
    return found


def table(mine: dict, theirs: dict) -> list[tuple[str, str, str]]:
    rows = []
    for k in KS:
        for top in ("top1", "top5"):
            key = f"knn/{top}_k{k}"
            rows.append((f"k-NN {top} k={k}", mine["knn"].get(key), theirs[key]))
    rows.append(("linear top-1 (test)", mine["linear"].get("linear/top1"), theirs["linear/top1"]))
    rows.append(("linear top-1 (val, chose)", mine["linear"].get("linear/val_top1"), theirs["linear/val_top1"]))
    rows.append(("linear top-1, 40 steps (before)", None, theirs["linear_old/top1"]))
    if "linear_augment" in mine:
        rows.append(("linear top-1, augment=true", mine["linear_augment"].get("linear/top1"), None))
    for key in sorted(k for k in theirs if k.startswith("fewshot/")):
        shots, seed = key.removeprefix("fewshot/").split("-seed-")
        rows.append((f"few-shot {shots} seed {seed}", mine["fewshot"].get(f"fewshot/{shots}-seed-{seed}"), theirs[key]))
    return [(name, _pct(a), _pct(b)) for name, a, b in rows]


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "top5" not in r[0]]
    x = np.arange(len(shown))
    fig, ax = plt.subplots(figsize=(12, 4))
    for i, (label, col) in enumerate((("vitlab.eval", 1), ("reference code", 2))):
        ax.bar(x + (i - 0.5) * 0.4, [float(r[col]) if r[col] != "-" else 0 for r in shown], 0.4, label=label)
    ax.set_xticks(x, [r[0] for r in shown], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_title("one digits checkpoint (3 epochs, seed 0): ours vs the references' code on the same features")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else "outputs/eval_protocols")
    mine, cache = ours(out)
    theirs = references(cache, out)
    rows = table(mine, theirs)
    print(f"{'metric':<28} {'vitlab.eval':>12} {'reference':>10}")
    for name, a, b in rows:
        print(f"{name:<28} {a:>12} {b:>10}")
    (out / "results.json").write_text(json.dumps({"vitlab": mine, "reference": theirs}, indent=2))
    plot(rows, HERE / "protocols.png")


if __name__ == "__main__":
    main()
