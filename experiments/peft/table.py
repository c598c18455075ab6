"""The study's table from its run directories (run.sh's: <run>/seed<s>/): test accuracy over the seeds (mean, std,
each), trainable parameters (the module rebuilt from its last checkpoint, as vitlab.eval rebuilds it), the
checkpoint's size, the memory of a step the run estimated at its start, and the time of a training step (the
throughput a run logs, over its batch; the seeds' median)."""

import json
import re
import statistics
import sys
from pathlib import Path

from vitlab.training.run.inference import load_for_inference

RUNS = ["full", "lora_r4", "lora_r16", "dora", "bitfit", "last2", "probe"]


def row(run: Path) -> str:
    seeds = sorted(d for d in run.glob("seed*") if (d / "metrics.json").is_file())
    metrics = [json.loads((d / "metrics.json").read_text()) for d in seeds]
    acc = [100 * m["test/acc"] for m in metrics]
    ckpt = seeds[0] / "checkpoints" / "last.ckpt"
    module = load_for_inference(str(ckpt))
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    if not module.hparams.get("peft"):  # the full fine-tune: everything trains
        trainable = sum(p.numel() for p in module.model.parameters())
    batch = module.hparams["data"]["batch_size"]
    step_ms = statistics.median(1000 * batch / m["train/samples_per_sec"] for m in metrics)
    spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
    return (
        f"| {run.name} | {statistics.mean(acc):.1f} ({spread:.1f}) | {', '.join(f'{a:.1f}' for a in acc)} "
        f"| {trainable:,} | {ckpt.stat().st_size / 1e6:.2f} MB | {_memory(seeds[0])} | {step_ms:.0f} |"
    )


def _memory(run: Path) -> str:
    """The start-up estimate of a step's memory the run logged (weights, gradients and optimizer state of what
    trains, activations): its parts' line, as logged."""
    line = next(x for x in (run / "train.log").read_text().splitlines() if "memory per process, estimated" in x)
    parts = re.search(r"weights (\S+) MB, gradients (\S+) MB, optimizer state (\S+) MB, .*: (\S+) MB", line)
    return f"{parts[4]} MB (grad {parts[2]}, optim {parts[3]})"


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/peft-study")
    print(
        "| run | test acc (%), mean (std) | per seed | trainable parameters | checkpoint | memory a step, estimated "
        "| ms / step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in RUNS:
        if any(out.glob(f"{name}/seed*/metrics.json")):
            print(row(out / name))
