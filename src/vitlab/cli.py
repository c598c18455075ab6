"""What every `python -m vitlab.<task>` entry point shares: where the configs are, the resolvers,
the run directory guard, one-line errors for bad input, and the model group read into a ViTConfig.
This is the only library module besides the entry points that knows Hydra.

It imports no torch, Lightning or timm at module level: `--help` and config errors answer at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import HydraException, InstantiationException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from vitlab.errors import MissingFileError, UserError

# What becomes a one-line exit 2: our own checks of the user's input, and Hydra's and OmegaConf's
# reports of a bad config or override. Anything else is a bug and keeps its traceback (exit 1).
CONFIG_ERRORS = (UserError, OmegaConfBaseException, HydraException)
# Keys of the model group that are not ViTConfig fields.
MODEL_EXTRA_KEYS = ("arch", "variant", "timm_name", "pretrained")

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
)


def config_dir() -> Path:
    """conf/ at the repository root (editable installs and checkouts), whatever the working
    directory; VITLAB_CONFIG_DIR points elsewhere."""
    if os.environ.get("VITLAB_CONFIG_DIR"):
        return Path(os.environ["VITLAB_CONFIG_DIR"]).resolve()
    here = Path(__file__).resolve().parents[2] / "conf"
    if not (here / "train.yaml").is_file() and not (here / "parity.yaml").is_file():
        raise MissingFileError(
            f"vitlab configs not found at {here}; install vitlab editable from its "
            "repository (make install) or set VITLAB_CONFIG_DIR to its conf/ folder"
        )
    return here


def _new_run_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def register_resolvers() -> None:
    """`${run_id:}`: process id + random hex, cached per config (a sweep's jobs share it, as `now`).
    `${cwd:}`: the directory the command was started in. Hydra's `${hydra:runtime.cwd}` says the same
    but only inside a job: a sweep resolves hydra.sweep.dir before any job exists."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", _new_run_id, use_cache=True)
    if not OmegaConf.has_resolver("cwd"):
        OmegaConf.register_new_resolver("cwd", os.getcwd)
    if not OmegaConf.has_resolver("class_folders"):
        OmegaConf.register_new_resolver("class_folders", class_folders)
    for name, resolver in (("slurm_gpus", slurm_gpus), ("slurm_cpus", slurm_cpus), ("shard_classes", shard_classes)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def shard_classes(data_dir: str) -> int:
    """`${shard_classes:<data_dir>}`: the number of classes of the shards `python -m vitlab.pack` wrote there."""
    from vitlab.data.streaming import shard_classes as count

    return count(data_dir)


def class_folders(data_dir: str) -> int:
    """`${class_folders:<data_dir>}`: the number of class folders in data_dir/train, as torchvision's
    ImageFolder will find them, so the model's head is sized from the data without a count to type."""
    train = Path(data_dir) / "train"
    if not Path(data_dir).is_dir():
        raise MissingFileError(f"data.data_dir {str(data_dir)!r} does not exist")
    if not train.is_dir():
        raise MissingFileError(
            f"image folder split {str(train)!r} does not exist (expected {data_dir}/train/<class>/... "
            f"and {data_dir}/val/<class>/...)"
        )
    return sum(1 for entry in os.scandir(train) if entry.is_dir())


# ---- the resources of a Slurm job (conf/hydra/launcher/slurm.yaml) ----


def _gpus_in_cluster() -> bool:
    """Whether any node of the cluster has GPUs (sinfo's generic resources), asked from the submitting machine."""
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=30).stdout
    return "gpu" in out


def slurm_gpus(accelerator: str, devices: Any) -> int | None:
    """`${slurm_gpus:<accelerator>,<devices>}`: the GPUs a job asks for per node. The trainer's devices when it
    trains on GPUs, none on the CPU (a gres request for GPUs fails on a cluster without them); with `auto`, GPUs
    when the cluster has any."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and _gpus_in_cluster())
    return devices if on_gpu and isinstance(devices, int) and devices > 0 else None


def slurm_cpus(num_workers: int | None) -> int:
    """`${slurm_cpus:<data.num_workers>}`: a task's CPUs, its loader workers and itself. Workers left to vitlab
    (null) take the CPUs the task gets, less one: 8 CPUs then, a usual share of a GPU node per GPU."""
    return 8 if num_workers is None else int(num_workers) + 1


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def user_error(e: BaseException) -> BaseException | None:
    """The user's mistake behind `e`, or None for a bug. Hydra wraps what a config's constructor raised,
    OmegaConf what a resolver raised: our own UserError inside either is the message to show."""
    cause, formatted = e, None
    # OmegaConf re-raises a resolver's error without `from`: follow the implicit context as well
    while isinstance(cause, (InstantiationException, OmegaConfBaseException)):
        if isinstance(cause, OmegaConfBaseException) and formatted is None:
            formatted = cause  # the outermost: OmegaConf fills in the key's name there, not in the ones inside
        inner = cause.__cause__ or cause.__context__
        if not isinstance(inner, (InstantiationException, OmegaConfBaseException, UserError)):
            break
        cause = inner
    if isinstance(e, InstantiationException) and cause is e:
        return None  # a constructor failed on something that is not the user's input: a bug
    if isinstance(cause, OmegaConfBaseException):
        return formatted
    return cause if isinstance(cause, CONFIG_ERRORS) else None


class _NoTips(logging.Filter):
    """Lightning's advertisement for its cloud products, printed on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


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
    logging.captureWarnings(True)


def route_lightning_logs() -> None:
    """Lightning gives its loggers a stderr handler of their own on import (every line would show twice,
    once unformatted); send them through the root logger instead. Called again once Lightning is
    imported (vitlab.run), since commands import it only when their task runs."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())


def entry_point(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Turn `task(cfg)` into a Hydra command line: configs from config_dir(), resolvers, a new run
    directory, and input errors reported as one line (the traceback only with HYDRA_FULL_ERROR=1).
    In a -m sweep a job with bad input is reported and recorded, and the sweep goes on (SweepSummary
    lists it and makes the sweep exit 2)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> Any:
            from vitlab.launch import discard_if_unused, task_started

            quiet()
            task_started()
            try:
                return task(cfg)
            except SystemExit:  # stopped on a signal: the sweep ends here, its summary lists the jobs so far
                _summarize_sweep(cfg)
                raise
            except (*CONFIG_ERRORS, InstantiationException) as e:
                cause = user_error(e)
                if os.environ.get("HYDRA_FULL_ERROR") == "1" or cause is None:
                    raise
                job = _sweep_job_dir()
                if job is None:
                    discard_if_unused(OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False))
                    fail(one_line(cause))
                return _record_failed_job(job, one_line(cause))

        def main() -> Any:
            from vitlab.launch import prepare

            quiet()
            register_resolvers()
            sys.argv[1:] = prepare(config_name, sys.argv[1:])
            return hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)(guarded)()

        return main

    return decorate


def _sweep_job_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def _summarize_sweep(cfg: DictConfig) -> None:
    """In a -m sweep, what the configured SweepSummary callbacks write as each job ends (Hydra calls them only
    for a job that returned or raised an Exception, not for one that exits)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class

    if _sweep_job_dir() is None:
        return
    hydra_cfg = HydraConfig.get()
    for node in (hydra_cfg.get("callbacks") or {}).values():
        if issubclass(get_class(node._target_), SweepSummary):
            hydra.utils.instantiate(node).write(hydra_cfg, cfg.get("optimized_metric"))


def _record_failed_job(job: Path, message: str) -> float:
    """A sweep job's bad input: said on stderr, kept in the job's error.json for the summary; NaN goes to
    the sweeper (Optuna records a failed trial) so the other jobs still run."""
    print(f"error: sweep job {job.name}: {message}", file=sys.stderr, flush=True)
    (job / "error.json").write_text(json.dumps({"error": message}))
    return float("nan")


def one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if "Original Traceback" in text:  # re-raised from a DataLoader worker: its last line is the error
        text = text.splitlines()[-1].split(": ", 1)[-1]
    if isinstance(e, OmegaConfBaseException):  # its message ends with full_key/object_type lines
        text = text.splitlines()[0]
    if isinstance(e, MissingMandatoryValue) and getattr(e, "full_key", None):  # a `???` in the config
        text = f"{e.full_key} must be given: {e.full_key}=..."
    text = text.split("\nConfig search path")[0]  # Hydra's missing-option message ends with its search path
    return " ".join(text.split())


def vit_config(model: DictConfig):
    """The model group -> the config of its architecture (`model.arch`, ViTConfig by default): sizes
    from `variant`, then the explicit fields."""
    from vitlab.model import config_class

    d = OmegaConf.to_container(model, resolve=True)
    arch, variant = d.get("arch") or "vit", d.get("variant")
    for key in MODEL_EXTRA_KEYS:
        d.pop(key, None)
    return config_class(arch).from_variant(variant, **d)


def save_config(cfg: DictConfig, path: Path, show: bool = False) -> None:
    """The resolved config as YAML in the run directory; with `show`, also as a tree on the terminal
    (the full tree is ~170 lines: the log says where the file is instead)."""
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if not show:
        return
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key), style="bold")
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)


# What a finished job of each entry point writes in its directory: train, parity, benchmark.
RESULT_FILES = ("metrics.json", "parity.json", "benchmark.json")


class SweepSummary(Callback):
    """Hydra callback: one row per job of a -m sweep (its overrides, status and final metrics) in summary.json
    in the sweep directory, rewritten as each job ends so that a sweep stopped part-way (SIGTERM, a time limit)
    still has it for the jobs that finished; under the Optuna sweeper also the best trial so far in
    optimization_results.yaml (the sweeper writes its own at the end). After the sweep the rows are printed as
    a table. Configured in conf/hydra/default.yaml."""

    def __init__(self, filenames: tuple[str, ...] = RESULT_FILES, columns: list[str] | None = None):
        self.filenames = filenames
        self.columns = columns or ["val/acc_best", "test/acc", "test/loss", "wall_time_s"]

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:  # Hydra calls this after a single run too
            self.write(config.hydra, config.get("optimized_metric"))

    def write(self, hydra_cfg: DictConfig, metric: str | None) -> list[dict[str, Any]]:
        """summary.json (and optimization_results.yaml under Optuna) from the job directories as they are now."""
        from vitlab.atomic import atomic_write

        sweep_dir = Path(hydra_cfg.sweep.dir)
        rows = [self._row(job) for job in _job_dirs(sweep_dir)]
        text = json.dumps(rows, indent=2).encode()
        atomic_write(sweep_dir / "summary.json", lambda f: f.write(text), what="sweep summary")
        sweeper = hydra_cfg.sweeper
        if "optuna" in str(sweeper.get("_target_", "")).lower() and isinstance(sweeper.get("direction"), str):
            best = _best_trial(sweep_dir, metric, sweeper)
            if best is not None:
                text = OmegaConf.to_yaml(OmegaConf.create(best)).encode()
                atomic_write(sweep_dir / "optimization_results.yaml", lambda f: f.write(text), what="sweep results")
        return rows

    def _row(self, job: Path) -> dict[str, Any]:
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
        found = [job / name for name in self.filenames if (job / name).is_file()]
        metrics = json.loads(found[0].read_text()) if found else {}
        error = json.loads((job / "error.json").read_text())["error"] if (job / "error.json").is_file() else None
        if metrics and not error:
            status = "done"
        elif error:
            status = "failed"
        else:  # still running, stopped on a signal (its checkpoint resumes it) or killed
            status = "interrupted" if (job / "checkpoints" / "interrupted.ckpt").is_file() else "unfinished"
        return {
            "job": int(job.name),
            "overrides": overrides,
            "status": status,
            **{c: metrics.get(c) for c in self.columns},
            **({"error": error} if error else {}),
        }

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.console import Console
        from rich.table import Table

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = self.write(config.hydra, config.get("optimized_metric"))
        table = Table(title=f"sweep summary ({sweep_dir})")
        for col in ["job", "overrides", "status", *self.columns]:
            table.add_column(col)
        for r in rows:
            table.add_row(
                str(r["job"]),
                " ".join(r["overrides"]),
                r["status"],
                *[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in self.columns],
            )
        Console(width=None if sys.stdout.isatty() else 160).print(table)
        failed = [r for r in rows if r["status"] != "done"]
        if failed:
            first = failed[0]
            fail(
                f"{len(failed)} of {len(rows)} sweep jobs failed (job {first['job']}: "
                f"{first.get('error') or 'no result file'}); every job is listed in {sweep_dir / 'summary.json'}"
            )
        print(f"sweep results: {sweep_dir / 'summary.json'}", flush=True)


def _job_dirs(sweep_dir: Path) -> list[Path]:
    if not sweep_dir.is_dir():
        return []
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def _best_trial(sweep_dir: Path, metric: str | None, sweeper: DictConfig) -> dict[str, Any] | None:
    """The finished trial with the best `metric` so far, as the Optuna sweeper writes it at the end: name,
    best_params (the values it chose, from the trial's config), best_value; and how many trials ended."""
    params = list((sweeper.get("params") or {}).keys())
    trials = []
    for job in _job_dirs(sweep_dir):
        cfg_file, result = job / ".hydra" / "config.yaml", job / "metrics.json"
        if metric is None or not (cfg_file.is_file() and result.is_file()):
            continue
        value = json.loads(result.read_text()).get(metric)
        if isinstance(value, (int, float)) and value == value:
            job_cfg = OmegaConf.load(cfg_file)
            trials.append((value, {k: OmegaConf.select(job_cfg, k) for k in params}))
    if not trials:
        return None
    pick = max if sweeper.direction == "maximize" else min
    value, best = pick(trials, key=lambda t: t[0])
    return {"name": "optuna", "best_params": best, "best_value": value, "trials_ended": len(trials)}
