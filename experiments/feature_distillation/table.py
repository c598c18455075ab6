"""The study's table from run.sh's folders: each student's k-NN (k 20) and linear-probe test top-1 over the seeds
(mean and std), its teacher's (probed beside it by vitlab.eval) and the retention, the student's over the teacher's;
the students' own test accuracy where they trained a head on labels."""

import json
import statistics
import sys
from pathlib import Path

ROWS = [  # (folder, teacher, labels)
    ("scratch", "-", "yes"),
    ("logits", "supervised", "yes"),
    ("feature", "DINO", "yes"),
    ("feature_nolabels", "DINO", "no"),
    ("tokens", "DINO", "yes"),
    ("tokens_nolabels", "DINO", "no"),
]
KNN, LINEAR = "knn/top1_k20", "linear/top1"


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _cell(values: list[float], percent: bool = True) -> str:
    if not values:
        return "-"
    scale = 100 if percent else 1
    spread = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{statistics.mean(values) * scale:.1f} ({spread:.1f})"


def row(out: Path, name: str, teacher: str, labels: str) -> str:
    seeds = sorted(d for d in (out / name).glob("seed*") if d.is_dir())
    knn = [_read(d / "knn" / "metrics.json") for d in seeds]
    linear = [_read(d / "linear" / "metrics.json") for d in seeds]
    own = [_read(d / "metrics.json").get("test/acc") for d in seeds]
    cells = [
        _cell([m[KNN] for m in knn if KNN in m]),
        _cell([m[LINEAR] for m in linear if LINEAR in m]),
        _cell([m[f"retention/{KNN}"] for m in knn if f"retention/{KNN}" in m]),
        _cell([m[f"retention/{LINEAR}"] for m in linear if f"retention/{LINEAR}" in m]),
        _cell([a for a in own if a is not None]),
    ]
    return f"| {name} | {teacher} | {labels} | {len(seeds)} | " + " | ".join(cells) + " |"


def teachers(out: Path) -> list[str]:
    """The teachers' own probes, as each student's evaluation recorded them beside it (the first seed's)."""
    lines = []
    for name, teacher in (("logits", "supervised"), ("feature", "DINO")):
        knn = _read(out / name / "seed1" / "knn" / "metrics.json")
        linear = _read(out / name / "seed1" / "linear" / "metrics.json")
        k, lin = knn.get(f"teacher/{KNN}"), linear.get(f"teacher/{LINEAR}")
        if k is not None and lin is not None:
            lines.append(f"| teacher: {teacher} | - | - | - | {100 * k:.1f} | {100 * lin:.1f} | 100% | 100% | - |")
    return lines


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/feature_distillation")
    print(
        "| student | teacher | labels | seeds | k-NN top-1 (k 20), % | linear probe top-1, % | k-NN retention | "
        "linear retention | its own head's test acc, % |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(teachers(out)))
    for name, teacher, labels in ROWS:
        if (out / name).is_dir():
            print(row(out, name, teacher, labels))
