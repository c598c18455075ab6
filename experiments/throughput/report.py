"""Tables and plots for experiments/throughput from the benchmark.json files of its runs.

python experiments/throughput/report.py outputs/throughput [--suffix _h100]

The plots (ratios, pipeline or streaming, end2end) are written beside this file, their names ending in the
suffix (runs on another machine keep their own plots); their titles name the machine the runs were on.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def machine(reports: list[dict]) -> str:
    gpus = sorted({r["environment"]["gpu"] for r in reports if r["environment"].get("gpu")})
    return " / ".join(gpus) or f"{reports[0]['environment']['threads']}-thread CPU"


def models_table(reports: list[dict]) -> None:
    cols = ["model", "batch", "mode", "contender", "median ms", "img/s", "GFLOP/s", "MFU", "peak MB", "step MB"]
    print("| " + " | ".join(cols) + " | ratio [per-round range] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rep in reports:
        for mode, rows in rep["results"].items():
            first = next(iter(rows))
            for name, r in rows.items():
                ratio = rep["ratios"][mode].get(f"{first}/{name}")
                shown = (
                    f"{ratio['throughput']:.3f} [{ratio['throughput_paired_min']:.3f}, "
                    f"{ratio['throughput_paired_max']:.3f}]"
                    if ratio
                    else ""
                )
                print(
                    f"| {rep['model']} | {rep['benchmark']['batch_size']} | {mode} | {name} | {r['median_ms']:.1f} | "
                    f"{r['images_per_s']:.1f} | {r['achieved_flops_per_s'] / 1e9:.1f} | {100 * r['mfu']:.1f}% | "
                    f"{r['peak_memory_mb']:.0f} | {r['step_memory_mb']:.0f} | {shown} |"
                )


def overhead_table(rep: dict) -> None:
    print("| loop | ms per training step (median) | CPU ms per step | s per epoch (val + ckpt) | steps per epoch |")
    print("|---|---|---|---|---|")
    for name, r in rep["results"].items():
        cpu = f"{r['step_cpu']['median_ms']:.2f}" if "step_cpu" in r else ""
        epoch, steps = r["epoch"]["median_ms"] / 1e3, r["steps_per_epoch"]
        print(f"| {name} | {r['step']['median_ms']:.2f} | {cpu} | {epoch:.3f} | {steps} |")
    for name, ratio in rep["ratios"].items():
        cpu = f" ({ratio['step_cpu_time']:.3f} in CPU time)" if "step_cpu_time" in ratio else ""
        print(f"\n{name}: {ratio['step_time']:.3f} per step{cpu}, {ratio['epoch_time']:.3f} per epoch")


def pipeline_table(reports: list[dict]) -> None:
    print("| run | loader | images/s (median) | per round | / ceiling |")
    print("|---|---|---|---|---|")
    for rep in reports:
        for name, r in rep["results"].items():
            ratio = rep["ratios"].get(f"{name}/ceiling")
            rounds = ", ".join(f"{x:.0f}" for x in r["images_per_s_rounds"])
            shown = f"{ratio:.3f}" if ratio else ""
            print(f"| {rep['run']} | {name} | {r['images_per_s']:.1f} | {rounds} | {shown} |")


def end2end_table(reports: list[dict]) -> None:
    print("| run | device | batch | precision | vitlab.train img/s | bare step img/s | train / bare step |")
    print("|---|---|---|---|---|---|---|")
    for rep in reports:
        print(
            f"| {rep['run']} | {rep['device']} | {rep['batch_size']} | {rep['precision']} | "
            f"{rep['train']['images_per_s']:.1f} | {rep['bare_step']['images_per_s']:.1f} | "
            f"{rep['ratios']['train/bare_step']:.3f} |"
        )


def pipeline_plot(reports: list[dict], out: Path) -> None:
    """Images/s of each loader per pipeline run, with the per-round range."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    loaders = ("ceiling", "vitlab", "float32_workers", "streaming")
    names = [n for n in loaders if all(n in r["results"] for r in reports)]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        rows = [rep["results"][name] for rep in reports]
        values = [r["images_per_s"] for r in rows]
        low = [v - min(r["images_per_s_rounds"]) for v, r in zip(values, rows, strict=True)]
        high = [max(r["images_per_s_rounds"]) - v for v, r in zip(values, rows, strict=True)]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(reports))]
        ax.bar(xs, values, width, yerr=[low, high], capsize=3, label=name)
    ax.set(
        xticks=list(range(len(reports))),
        ylabel="images/s",
        title=f"train loader, {machine(reports)} (median; bar: range)",
    )
    ax.set_xticklabels([rep["run"] for rep in reports], fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def end2end_plot(reports: list[dict], out: Path) -> None:
    """vitlab.train's images/s beside the bare step's, per end2end run, with their ratio written above."""
    fig, ax = plt.subplots(figsize=(11, 4))
    xs = range(len(reports))
    train = [rep["train"]["images_per_s"] for rep in reports]
    bare = [rep["bare_step"]["images_per_s"] for rep in reports]
    ax.bar([x - 0.2 for x in xs], bare, 0.4, label="bare step", color="tab:gray")
    ax.bar([x + 0.2 for x in xs], train, 0.4, label="vitlab.train", color="tab:blue")
    for x, t, b in zip(xs, train, bare, strict=True):
        ax.text(x, max(t, b), f"{t / b:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set(xticks=list(xs), ylabel="images/s", title=f"vitlab.train end to end, {machine(reports)}")
    labels = [f"{rep['run']}\n{rep['device']} b{rep['batch_size']} {rep['precision']}" for rep in reports]
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def plot(reports: list[dict], out: Path) -> None:
    """vitlab/timm throughput per model and mode, with the per-round range as an error bar."""
    bars = []
    for rep in reports:
        for mode, ratios in rep["ratios"].items():
            if "vitlab/timm" in ratios:
                r = ratios["vitlab/timm"]
                compiled = " compiled" if rep["benchmark"].get("compile") else ""
                bars.append((f"{rep['model']} b{rep['benchmark']['batch_size']}\n{mode}{compiled}", r))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    xs = range(len(bars))
    values = [r["throughput"] for _, r in bars]
    low = [v - r["throughput_paired_min"] for v, (_, r) in zip(values, bars, strict=True)]
    high = [r["throughput_paired_max"] - v for v, (_, r) in zip(values, bars, strict=True)]
    ax.bar(xs, values, yerr=[low, high], capsize=3, color="tab:blue")
    ax.axhline(1.0, color="k", lw=1)
    precisions = sorted({rep["benchmark"]["precision"] for rep in reports})
    title = f"{machine(reports)}, {'/'.join(precisions)} (median; bar: per-round range)"
    ax.set(xticks=list(xs), ylabel="vitlab / timm throughput", title=title)
    ax.set_xticklabels([label for label, _ in bars], fontsize=8)
    ax.set_ylim(0.8, max(v + h for v, h in zip(values, high, strict=True)) + 0.05)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(root: Path, suffix: str = "") -> None:
    here = Path(__file__).parent
    reports = [{**json.loads(p.read_text()), "run": p.parent.name} for p in sorted(root.glob("*/benchmark.json"))]
    models = [r for r in reports if r["task"] == "models"]
    order = {"vit_digits": 0, "vit_ti16": 1, "vit_s16": 2, "vit_b16": 3}
    models.sort(key=lambda r: order.get(r["model"], 9))
    models_table(models)
    for rep in models:
        peak = rep["peak"]
        print(
            f"\n{rep['model']}: {rep['flops']['forward_gflops_per_image']:.3f} GFLOPs/image forward; peak "
            f"{peak['flops_per_s'] / 1e9:.0f} GFLOP/s ({peak['dtype']} {peak['size']}^3 matmul)"
        )
    for rep in reports:
        if rep["task"] == "overhead":
            print()
            overhead_table(rep)
    pipelines = [r for r in reports if r["task"] == "pipeline"]
    if pipelines:
        print()
        pipeline_table(pipelines)
        streaming = all("streaming" in r["results"] for r in pipelines)  # with benchmark.pipeline.shards
        pipeline_plot(pipelines, here / f"{'streaming' if streaming else 'pipeline'}{suffix}.png")
    ends = [r for r in reports if r["task"] == "end2end"]
    if ends:
        print()
        end2end_table(ends)
        end2end_plot(ends, here / f"end2end{suffix}.png")
    if models:
        plot([r for r in models if "timm" in next(iter(r["results"].values()))], here / f"ratios{suffix}.png")
        print(f"\nwrote {here / f'ratios{suffix}.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder whose */benchmark.json are read")
    parser.add_argument("--suffix", default="", help="ends the plots' names, e.g. _h100")
    args = parser.parse_args()
    main(args.root, args.suffix)
