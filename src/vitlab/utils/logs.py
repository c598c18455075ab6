"""Where a command's messages go: Lightning's loggers through Hydra's logging (the terminal and the run's log
file), and the warnings nobody running vitlab can act on dropped. Imports neither torch nor Lightning."""

from __future__ import annotations

import contextlib
import logging
import re
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# progress_bar=: auto (rich on a terminal; otherwise a log line per epoch), rich, tqdm, none.
ProgressBar = typing.Literal["auto", "rich", "tqdm", "none"]
PROGRESS_BARS = typing.get_args(ProgressBar)

# Warnings nobody running vitlab can act on: deprecations inside torchdata and Lightning, the
# logging-interval notice (vitlab lowers the interval to the epoch length itself, see lit_module),
# Lightning's hint to start a run with srun wherever Slurm is installed (on Slurm vitlab's launcher starts
# the processes: hydra/launcher=slurm), DDP's note that the one-channel patch filters' gradient has another
# memory layout than its bucket (a copy of a few hundred numbers), and, for a run that resumes in its own
# directory (a requeued Slurm job), the notes that its checkpoint directory is not empty and the CSV logger's
# claim that it will delete the metrics there (it appends to them).
QUIET_WARNINGS = (
    r"'set_vital' is deprecated",
    r".*isinstance\(treespec, LeafSpec\)",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"The `srun` command is available on your system but is not used",
    r"Grad strides do not match bucket view strides",
    r"Experiment logs directory .* exists and is not empty",
    r"Checkpoint directory .* exists and is not empty",
    # Lightning's caution that an IterableDataset's __len__ may be wrong under several loader workers: vitlab's
    # streamed splits (data/streamed.py) give each worker its share and count it, so the length is exact.
    r"Your `IterableDataset` has `__len__` defined",
    # timm's deprecation of PlateauLRScheduler, which tells timm's users to pick a fixed schedule: scheduler.name=
    # plateau is the user's choice here. (Its note stands: a resumed run's patience and cooldown counters restart.)
    r"PlateauLRScheduler is deprecated",
    # FSDP2's caution that a sharded module returned a view (the class token, forward_head's pre-logits, under
    # trainer=fsdp): an in-place op on it would skip a gather; vitlab's steps modify no network's output in place.
    r"FSDP2-wrapped module \(\w+\) returned a view tensor",
)


# Log records nobody running vitlab can act on, by logger: torch's note under compile that a selectively
# checkpointed region must hold no in-place ops (vitlab's blocks hold none; model/recompute.py), that a
# CPU-only torch compiling on the CPU found no CUDA runtime, and torch's deprecation of how torchao (imported by
# peft, peft=lora|dora) registers its enums.
QUIET_LOGS = {
    "torch._higher_order_ops.wrap": "context_fn is passed to torch.utils.checkpoint under torch.compile",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
    "torch.utils._pytree": "is an Enum subclass and is now natively supported by torch.compile",
}


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def dropped(logger: str, text: str) -> Iterator[None]:
    """Within the block, the records of `logger` whose message holds `text` are dropped (around one library call
    whose notes nobody can act on: the rest of that logger, and that logger after the block, are left as they are)."""
    drop, log = _Drop(text), logging.getLogger(logger)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


class _NoTips(logging.Filter):
    """What Lightning prints that nobody acts on: its advertisement for its cloud products, on every run; that a CPU
    run has no GPU or TPU; its note on a Ctrl-C, which vitlab's own line about the stop follows."""

    NOISE = re.compile(r"Tip:|(GPU|TPU|HPU) available: False|Detected KeyboardInterrupt, attempting graceful shutdown")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.NOISE.search(str(record.msg))


def quiet() -> None:
    """Warnings nobody can act on are dropped; the rest, and Lightning's logs, go through Hydra's
    logging (terminal and the run's log file)."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    route_lightning_logs()
    logging.getLogger("alembic").setLevel(logging.WARNING)  # Optuna's storage layer lists its plugins at INFO
    logging.getLogger("litdata").setLevel(logging.WARNING)  # how it maps each split's chunks, at INFO
    for name in ("onnx_ir", "onnxscript"):  # the ONNX exporter logs each graph rewrite at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, text in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(text))
    logging.captureWarnings(True)


def route_lightning_logs() -> None:
    """Lightning gives its loggers a stderr handler of their own on import (every line would show twice,
    once unformatted); send them through the root logger instead. Called again once Lightning is
    imported (vitlab.training.run.build), since commands import it only when their task runs."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())


def save_config(config: Mapping[str, Any], path: Path, show: bool = False) -> None:
    """A run's resolved config (plain data) as YAML in its run directory; with `show`, also as a tree on the terminal
    (the full tree is ~170 lines: the log says where the file is instead)."""
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(OmegaConf.create(dict(config))))
    if not show:
        return
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in config.items():
        branch = tree.add(str(key), style="bold")
        text = OmegaConf.to_yaml(OmegaConf.create(value)) if isinstance(value, Mapping) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)


def describe_run(module: Any, data: Mapping[str, Any], trainer: Mapping[str, Any]) -> str:
    """One line on what is about to train: the module's ViT on the data settings `data` with the trainer settings
    `trainer` (the whole config is in the run directory)."""
    m = module.model.cfg
    params = sum(p.numel() for p in module.model.parameters())
    name = str(data.get("_target_", "")).rsplit(".", 1)[-1].removesuffix("DataModule").lower()
    return (
        f"training ViT (dim {m.embed_dim}, depth {m.depth}, heads {m.num_heads}, patch {m.patch_size}, "
        f"img {m.img_size}, {params / 1e6:.2f}M params) on {name}, batch {data['batch_size']}, "
        f"up to {trainer['max_epochs']} epochs"
    )


# The results a run's last line shows: a classifier's accuracies, or (pretraining: objective=mae, dino) its losses and
# the tested weights' k-NN accuracy where callbacks=representation measured it.
RESULTS = (
    (("val/acc_best", "val"), ("test/acc", "test")),
    (("val/loss_best", "val"), ("test/loss", "test"), ("knn/top1", "val"), ("test/knn_top1", "test")),
    (("val/map_best", "val"), ("test/map", "test"), ("test/map_micro", "test"), ("test/f1", "test")),  # multilabel
)


def summarize(metrics: dict, best_checkpoint: str, run_dir) -> None:
    """The last lines of a run: its results and where they are."""
    splits = metrics.get("splits") or {}
    results = ", ".join(
        f"{k} {shown(metrics[k])}" + (f" on {splits[split]}" if split in splits else "")
        for k, split in RESULTS[result_row(metrics)]
        if k in metrics
    )
    logging.getLogger("vitlab.train").info(
        "done in %.1f s%s", metrics["wall_time_s"], f": {results}" if results else ""
    )
    print(f"run directory: {run_dir}", flush=True)
    if best_checkpoint:
        print(f"best checkpoint: {best_checkpoint}", flush=True)


def result_row(metrics: dict) -> int:
    """Which RESULTS row a run's metrics give: a multi-label classifier's, a classifier's, a pretraining's."""
    if "val/map_best" in metrics:
        return 2
    return int("val/acc_best" not in metrics and "val/loss_best" in metrics)


def shown(value: float) -> str:
    """A metric as the console shows it: 4 decimals, or 3 significant digits where those would show 0.0000 (a
    learning rate of 2e-05)."""
    return f"{value:.3g}" if value and abs(value) < 5e-4 else f"{value:.4f}"
