"""The study's table from its run directories (run.sh's): test accuracy, trainable parameters (the module rebuilt from
its last checkpoint, as vitlab.eval rebuilds it), the checkpoint's size, and the time of a training step (the
throughput a run logs, over its batch)."""

import json
import sys
from pathlib import Path

from vitlab.training.run.inference import load_for_inference

RUNS = ["full", "lora_r4", "lora_r16", "dora", "bitfit", "last2", "probe"]


def row(run: Path) -> str:
    metrics = json.loads((run / "metrics.json").read_text())
    ckpt = run / "checkpoints" / "last.ckpt"
    module = load_for_inference(str(ckpt))
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    if not module.hparams.get("peft"):  # the full fine-tune: everything trains
        trainable = sum(p.numel() for p in module.model.parameters())
    batch = module.hparams["data"]["batch_size"]
    step_ms = 1000 * batch / metrics["train/samples_per_sec"]
    return (
        f"| {run.name} | {100 * metrics['test/acc']:.1f} | {trainable:,} | {ckpt.stat().st_size / 1e6:.2f} MB "
        f"| {step_ms:.0f} |"
    )


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/peft-study")
    print("| run | test acc (%) | trainable parameters | checkpoint | ms / step |\n|---|---|---|---|---|")
    for name in RUNS:
        if (out / name / "metrics.json").is_file():
            print(row(out / name))
