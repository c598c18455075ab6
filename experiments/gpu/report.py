"""The tables of a lease's results (experiments/gpu/points.py's results.json), for experiments/gpu/README.md and the
studies' READMEs.

    python experiments/gpu/report.py <files_at>/results.json [more results.json] [--image <files_at>/image.txt]

Merges the files (a later file's point replaces an earlier one's unless it was skipped), writes the merged results to
experiments/gpu/results_<gpu>_<date>.json, puts the tables between the `results` markers of experiments/gpu/README.md
(and prints them), and with --image replaces experiments/gpu/image.txt by the device's own package list.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- results: written by report.py -->", "<!-- /results -->"


def merge(paths: list[Path]) -> dict:
    merged: dict = {}
    for path in paths:
        report = json.loads(path.read_text())
        merged.setdefault("environment", report["environment"])
        points = merged.setdefault("points", {})
        listed = report["points"]  # a lease's results.json lists them; a merged results_<gpu>_<date>.json maps them
        for point in listed.values() if isinstance(listed, dict) else listed:
            if point["name"] not in points or not str(point.get("status", "")).startswith("skipped"):
                points[point["name"]] = point
    return merged


BF16_PEAK = 989e12  # an H100 SXM's (and H200's) dense bf16 FLOP/s, NVIDIA's figure: the MFU of vitlab.train's runs


def describe(point: dict) -> list[str]:
    """One line per command: what it measured."""
    lines = []
    for command in point["commands"]:
        r = command["result"]
        if command["rc"] != 0:
            tail = [x for x in command["log_tail"] if x.strip()]
            last = next(
                (x for x in reversed(tail) if re.match(r"\s*\w*(Error|Exception)\b", x)), tail[-1] if tail else ""
            )
            lines.append(f"exit {command['rc']} after {command['seconds']} s: `{last.strip()[:160]}`")
        elif isinstance(r, dict) and "bare_step" in r:  # task=end2end
            lines.append(
                f"compile={r['compile']}, batch {r['batch_size']} {r['precision']}: vitlab.train "
                f"{r['train']['images_per_s']:,.0f} img/s, bare step {r['bare_step']['images_per_s']:,.0f} img/s, "
                f"ratio {r['ratios']['train/bare_step']:.3f}"
            )
        elif isinstance(r, list) and r and "jpegs" in r[0]:  # jpeg_folder.py
            lines.append(f"{r[0]['jpegs']:,} JPEGs of {r[0]['size']} written in {command['seconds']} s")
        elif isinstance(r, dict) and "timm_train" in r:  # timm's train.py, its last epoch's average
            t = r["timm_train"]
            last = f", its last step {t['last_step_s'] * 1000:.0f} ms" if "last_step_s" in t else ""
            lines.append(f"timm's train.py: epoch {t['epoch']} ({t['steps']} steps) {t['step_s'] * 1000:.0f} ms/step "
                         f"on average, {t['images_per_s']:,.0f} img/s{last}")  # fmt: skip
        elif isinstance(r, dict) and r.get("task") == "strategies":
            parts = [
                f"{name} {row['step_ms']:.1f} ms/step, {row['images_per_s']:,.0f} img/s, "
                f"peak {row['peak_mb_per_process']:,.0f} MB"
                for name, row in r["results"].items()
            ]
            names = list(r["results"])
            ratio = r["results"][names[-1]]["step_ms"] / r["results"][names[0]]["step_ms"]
            lines.append("; ".join(parts) + f"; {names[-1]}/{names[0]} step {ratio:.2f}")
        elif isinstance(r, dict) and r.get("task") == "models":
            rows = r["results"]["train"]
            first = next(iter(rows))
            parts = [
                f"{name} {row['median_ms']:.1f} ms ({row['images_per_s']:,.0f} img/s, MFU {100 * row['mfu']:.1f}%, "
                f"peak {row['peak_memory_mb']:,.0f} MB)"
                for name, row in rows.items()
            ]
            ratios = [f"{k} {v['throughput']:.3f}" for k, v in r["ratios"]["train"].items()]
            compiled = f", compile={r['benchmark']['compile']}" if r["benchmark"]["compile"] else ""
            lines.append(f"{r['model']} batch {r['benchmark']['batch_size']} {r['benchmark']['precision']}{compiled}: "
                         f"{'; '.join(parts)}; throughput of {first} over: {', '.join(ratios)}")  # fmt: skip
        elif isinstance(r, dict) and "sweep" in r:  # vitlab.train -m: a line per job (the float8 point)
            for job in r["sweep"]:
                named = " ".join(o for o in job["overrides"] if o.startswith(("model=", "trainer.precision=")))
                flops = job.get("train/device/flops_per_sec", 0)
                lines.append(f"{named}: {job.get('train/samples_per_sec', 0):,.0f} img/s, {flops / 1e12:.0f} TFLOP/s "
                             f"(MFU {100 * flops / BF16_PEAK:.1f}% of 989), mean loss of the steps "
                             f"{job.get('train/loss', float('nan')):.4f}")  # fmt: skip
        elif isinstance(r, dict) and "wall_time_s" in r:  # vitlab.train's metrics.json
            auto = r.get("batch_size_auto")
            shown = f"batch_size=auto chose {auto['batch_size']} ({auto['limited_by']}), " if auto else ""
            lines.append(f"{shown}trained, {r.get('train/samples_per_sec', 0):,.0f} img/s at the end, "
                         f"{r['wall_time_s']:.1f} s")  # fmt: skip
        elif isinstance(r, list) and r and "naflex_tokens" in r[0]:  # naflex/study.py --tokens
            t, first = r[0]["naflex_tokens"], r[0]
            parts = [f"{way} {v['tokens_per_s']:,.0f} tokens/s ({v['valid_tokens_per_s']:,.0f} valid)"
                     for way, v in t.items()]  # fmt: skip
            lines.append(f"{first['model']} {first['seq']} patches, batch {first['batch']}: {'; '.join(parts)}; "
                         f"NaFlex's padding {100 * first['padding']:.1f}%, its tokens/s over the square images' "
                         f"{t['naflex']['tokens_per_s'] / t['square_images']['tokens_per_s']:.3f}")  # fmt: skip
        elif isinstance(r, dict) and "rows" in r:  # regional_compile/measure.py
            rows = [
                f"depth {x['depth']} {x['mode']}: compile {x['compile_s']:.1f} s, step {1000 * x['step_s']:.1f} ms, "
                f"{x['graphs']} graph(s)"
                for x in r["rows"]
            ]
            lines.append("; ".join(rows))
        else:
            outcome = next((x for x in reversed(command["log_tail"]) if re.search(r"passed|failed|error", x)), "")
            lines.append(f"exit 0 in {command['seconds']} s {outcome.strip()}")
    return lines


def tables(merged: dict, date: str) -> str:
    env = merged["environment"]
    head = f"Lease of {date}: {env.get('gpu', 'no GPU')}, {env['cpus']} CPUs, torch {env['torch']}, "
    head += f"Python {env['python']}."
    out = [head, "", "| point | study | status | seconds | measured |", "|---|---|---|---|---|"]
    for p in merged["points"].values():
        measured = "<br>".join(describe(p)) or "-"
        out.append(f"| {p['name']} | {p['study']} | {p['status']} | {p.get('seconds', '-')} | {measured} |")
    return "\n".join(out)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("results", nargs="+", type=Path)
    a.add_argument("--image", type=Path, help="the device's image.txt (its pip list) to keep as experiments/gpu/")
    a.add_argument("--date", default=datetime.date.today().isoformat())
    args = a.parse_args()
    merged = merge(args.results)
    gpu = re.sub(r"\W+", "_", merged["environment"].get("gpu", "cpu").lower()).strip("_")
    (HERE / f"results_{gpu}_{args.date}.json").write_text(json.dumps(merged, indent=1))
    text = tables(merged, args.date)
    readme = HERE / "README.md"
    body = readme.read_text()
    if BEGIN in body and END in body:
        body = body[: body.index(BEGIN) + len(BEGIN)] + "\n" + text + "\n" + body[body.index(END) :]
        readme.write_text(body)
    if args.image:
        header = [
            f"# The GPU image's Python packages, as `pip list --format=freeze` read them on the lease of {args.date}",
            "# (experiments/gpu/run.sh writes them; report.py --image keeps them here); wheels.py reads this.",
        ]
        listed = [
            line if "==" in line or line.startswith("#") else f"# {line}"
            for line in args.image.read_text().splitlines()
        ]
        (HERE / "image.txt").write_text("\n".join([*header, *listed]) + "\n")
    print(text)


if __name__ == "__main__":
    main()
