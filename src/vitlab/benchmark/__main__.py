"""python -m vitlab.benchmark model=<name> [benchmark.*=...]: how fast, against what.

`benchmark.task=models` (default) times vitlab's ViT against timm's on one batch (benchmark/models.py);
`benchmark.task=overhead` times vitlab.train's loop against a bare LightningModule and a plain loop (overhead.py);
`benchmark.task=pipeline` times the train loader against a decode-and-crop ceiling (benchmark/pipeline.py);
`benchmark.task=end2end` divides vitlab.train's steady-state images/s by the bare step's (benchmark/end2end.py);
`benchmark.task=strategies` measures memory and step time per process under DDP and FSDP (benchmark/strategies.py).
Each prints a table and writes `benchmark.json` in its run directory. Speed goals are checked here,
never in timed tests (README: Benchmarks; experiments/throughput).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from vitlab.benchmark.config import check_benchmark
from vitlab.cli.entry import entry_point
from vitlab.model.config import vit_config
from vitlab.utils.errors import UserError

if TYPE_CHECKING:
    from vitlab.training.run.plan import TrainPlan


def train_plan(b, report: dict[str, Any]) -> TrainPlan:
    """vitlab.train's plan (vitlab.cli.plans), of its config composed with benchmark.train_overrides (tasks overhead,
    pipeline, end2end)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from vitlab.cli.plans import train_plan

    chosen = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].lstrip("+~") in ("model", "optim")]
    if chosen:
        raise UserError(
            f"benchmark.task={b.task} times vitlab.train's own config; {chosen[0]!r} does not reach it: put "
            "it in benchmark.train_overrides, e.g. 'benchmark.train_overrides=[model.depth=2]'"
        )
    report["train_overrides"] = list(b.train_overrides)
    return train_plan(compose("train", overrides=list(b.train_overrides)))


def overhead(cfg: DictConfig, b, report: dict[str, Any]) -> None:
    from vitlab.benchmark import overhead as task
    from vitlab.benchmark.measure import environment, pick_device

    plan = train_plan(b, report)
    report["environment"] = environment(pick_device("auto"))
    report.update(task.bench_overhead(plan, b))
    task.print_report(report)


def pipeline(cfg: DictConfig, b, report: dict[str, Any]) -> None:
    from vitlab.benchmark import pipeline as task
    from vitlab.benchmark.measure import environment, pick_device

    plan = train_plan(b, report)
    report["environment"] = environment(pick_device("cpu"))
    report.update(task.bench_pipeline(plan, b))
    task.print_report(report)


def end2end(cfg: DictConfig, b, report: dict[str, Any]) -> None:
    from vitlab.benchmark import end2end as task
    from vitlab.benchmark.measure import environment, pick_device

    plan = train_plan(b, report)
    on_cpu = plan.trainer.get("accelerator", "auto") == "cpu"
    device = pick_device("cpu" if on_cpu else b.device)
    report["environment"] = environment(device)
    report.update(task.bench_end2end(plan, b, device))
    task.print_report(report)


def strategies(cfg: DictConfig, b, report: dict[str, Any]) -> None:
    from vitlab.benchmark import strategies as task

    report["train_overrides"] = list(b.train_overrides)
    report.update(task.bench_strategies(b, Path(cfg.paths.output_dir)))
    task.print_report(report)


def models(cfg: DictConfig, b, report: dict[str, Any]) -> None:
    from hydra.core.hydra_config import HydraConfig

    from vitlab.benchmark import models as task
    from vitlab.benchmark.measure import environment, pick_device
    from vitlab.training.optim import OptimConfig

    device = pick_device(b.device)
    model_cfg = vit_config(cfg.model)
    report["model"] = HydraConfig.get().runtime.choices.get("model") or cfg.model.get("variant") or "custom"
    report["timm_name"] = cfg.model.get("timm_name")
    report["config"] = model_cfg.to_dict()
    report["environment"] = environment(device)
    optim = OptimConfig.from_dict(OmegaConf.to_container(cfg.optim, resolve=True))
    report.update(task.bench_models(model_cfg, b, optim, device))
    task.print_report(report)


@entry_point("benchmark", check=check_benchmark)
def main(cfg: DictConfig) -> dict[str, Any]:
    import torch

    from vitlab.benchmark.config import BenchmarkConfig

    torch.set_float32_matmul_precision("high")  # as vitlab.train: TF32 matmuls on GPUs that have them
    b = BenchmarkConfig.from_dict(OmegaConf.to_container(cfg.benchmark, resolve=True))
    report: dict[str, Any] = {"task": b.task, "benchmark": OmegaConf.to_container(cfg.benchmark, resolve=True)}
    tasks = {"models": models, "overhead": overhead, "pipeline": pipeline, "end2end": end2end, "strategies": strategies}
    tasks[b.task](cfg, b, report)
    out = Path(cfg.paths.output_dir) / "benchmark.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
