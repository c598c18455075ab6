"""benchmark.task=strategies: memory and step time of the same training under each strategy (DDP against FSDP), as
users run it: `python -m vitlab.train <train_overrides> trainer=<strategy>` in a subprocess per strategy, with a probe
callback that times a window of steady-state steps (the device synchronised at its two ends only, epoch ends left
out, as end2end's) and reads each process's memory when the window closes:

- `state_mb`: the weights, gradients and optimizer state this process holds, counted from its tensors (a DTensor's
  local shard);
- `peak_mb`: CUDA's max_memory_allocated on a GPU; on a CPU the process's peak resident set (ru_maxrss: the Python
  process, libraries and all, so compare it between strategies, not with the state);
- `estimate_mb`: training.devices.memory's estimate for the run (what vitlab.train logs at start).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from vitlab.benchmark.end2end import Window
from vitlab.utils.errors import UserError

MB = 1e6


class Probe(Window):
    """end2end's window, then this process's memory, written to probe_rank<r>.json in `out`."""

    def __init__(self, start: int, steps: int, out: str):
        super().__init__(start, steps)
        self.out = Path(out)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if self.t1 is not None and not (self.out / f"probe_rank{trainer.global_rank}.json").exists():
            self._write(trainer, module)

    def _write(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from vitlab.training.devices import memory
        from vitlab.training.devices.hardware import Devices

        local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731  (a DTensor's shard)
        nbytes = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
        params = list(module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
        cfg = trainer.datamodule
        estimate = memory.for_run(module, Devices.of_trainer(trainer), module.optim.name, cfg.batch_size)
        cuda = module.device.type == "cuda"
        if cuda:
            peak = torch.cuda.max_memory_allocated(module.device)
        else:  # kilobytes on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report = {
            "rank": trainer.global_rank,
            "seconds": self.seconds,
            "steps": self.steps,
            "images": self.images,
            "state_mb": sum(nbytes(t) for t in [*params, *grads, *states]) / MB,
            "peak_mb": peak / MB,
            "peak_kind": "cuda max_memory_allocated" if cuda else "peak resident set (ru_maxrss)",
            "estimate_mb": estimate.total / MB,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(report))


def bench_strategies(b, out_dir: Path) -> dict[str, Any]:
    """Each strategy of `b.strategies.names` trained as vitlab.train trains it, one after the other."""
    s = b.strategies
    results = {}
    for name in s.names:
        probes = out_dir / name
        steps = s.warmup_steps + s.steps
        own = [
            f"trainer={name}", f"trainer.devices={s.devices}", f"trainer.max_steps={steps}", "trainer.max_epochs=-1",
            "test=false", "trainer.num_sanity_val_steps=0",
            "+callbacks.strategy_probe._target_=vitlab.benchmark.strategies.Probe",
            f"+callbacks.strategy_probe.start={s.warmup_steps}", f"+callbacks.strategy_probe.steps={s.steps}",
            f"+callbacks.strategy_probe.out={probes}", f"hydra.run.dir={out_dir / f'run_{name}'}",
        ]  # fmt: skip
        keys = {o.split("=", 1)[0].lstrip("+~") for o in own}  # (a key given twice is refused: these values win)
        given = [o for o in b.train_overrides if o.split("=", 1)[0].lstrip("+~") not in keys]
        command = [sys.executable, "-m", "vitlab.train", *given, *own]
        r = subprocess.run(command, capture_output=True, text=True)
        if r.returncode != 0:
            raise UserError(f"benchmark.task=strategies: trainer={name} failed: {r.stderr.strip().splitlines()[-1]}")
        ranks = [json.loads(p.read_text()) for p in sorted(probes.glob("probe_rank*.json"))]
        if len(ranks) != s.devices:
            raise RuntimeError(f"trainer={name}: {len(ranks)} of {s.devices} processes reported")
        seconds = max(r["seconds"] for r in ranks)
        results[name] = {
            "step_ms": 1000 * seconds / ranks[0]["steps"],
            "images_per_s": sum(r["images"] for r in ranks) / seconds,
            "state_mb_per_process": max(r["state_mb"] for r in ranks),
            "peak_mb_per_process": max(r["peak_mb"] for r in ranks),
            "peak_kind": ranks[0]["peak_kind"],
            "estimate_mb_per_process": ranks[0]["estimate_mb"],
            "ranks": ranks,
        }
    return {"processes": s.devices, "results": results}


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    results = report["results"]
    table = Table(title=f"strategies, {report['processes']} processes: {' '.join(report['train_overrides'])}")
    for column in ("strategy", "step ms", "images/s", "state MB/process", "estimate MB/process", "peak MB/process"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(
            name, f"{r['step_ms']:.1f}", f"{r['images_per_s']:.1f}", f"{r['state_mb_per_process']:.1f}",
            f"{r['estimate_mb_per_process']:.1f}", f"{r['peak_mb_per_process']:.1f}",
        )  # fmt: skip
    Console(width=140).print(table)
    kinds = {r["peak_kind"] for r in results.values()}
    print(f"peak: {', '.join(sorted(kinds))}")
