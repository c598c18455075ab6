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
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import HydraException, InstantiationException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vitlab.errors import MissingFileError, UserError

# What becomes a one-line exit 2: our own checks of the user's input, and Hydra's and OmegaConf's
# reports of a bad config or override. Anything else is a bug and keeps its traceback (exit 1).
CONFIG_ERRORS = (UserError, OmegaConfBaseException, HydraException)
# Keys of the model group that are not ViTConfig fields.
MODEL_EXTRA_KEYS = ("arch", "variant", "timm_name", "pretrained")
# Written into every run directory the moment a command claims it (see claim_run_dir).
CLAIM_FILE = ".vitlab-run"

# Warnings nobody running vitlab can act on: deprecations inside torchdata and Lightning, and the
# logging-interval notice (vitlab lowers the interval to the epoch length itself, see lit_module).
QUIET_WARNINGS = (
    r"'set_vital' is deprecated",
    r".*isinstance\(treespec, LeafSpec\)",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
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


def is_launcher_child() -> bool:
    """A process started by Lightning's DDP launcher for ranks > 0 (it sets LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0")) > 0


def _override_value(argv: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as `key=`, `+key=` or `++key=`), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except HydraException:
        return None  # Hydra reports the malformed override itself
    found = [o for o in overrides if o.key_or_group == key and not o.is_delete()]
    return str(found[-1].value()) if found else None


def _unwritable(path: Path, what: str, err: OSError) -> UserError:
    return UserError(
        f"{what} {str(path)!r} cannot be written ({err.strerror or type(err).__name__}); "
        "choose a writable hydra.run.dir or paths.log_dir, or start the command in a writable directory"
    )


def claim_run_dir(path: Path) -> None:
    """Make `path` this run's directory, or refuse: Hydra writes into hydra.run.dir before any task code
    runs, so an earlier run's files are protected here. The claim is an exclusive create, so two
    commands started at once with the same new directory cannot both get it."""
    if path.exists() and not path.is_dir():
        raise UserError(f"hydra.run.dir {str(path)!r} is a file, not a directory; give a new directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / CLAIM_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        fd = None
    except OSError as e:
        raise _unwritable(path, "run directory", e) from e
    reused = UserError(
        f"run directory {str(path)!r} already holds files; vitlab never reuses a run directory: "
        "give a new hydra.run.dir or leave it to the default"
    )
    if fd is None:
        raise reused
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {' '.join(sys.argv)}\n")
    if any(p.name != CLAIM_FILE for p in path.iterdir()):  # an earlier run from before claim files
        (path / CLAIM_FILE).unlink()
        raise reused


def check_writable(directory: Path) -> None:
    """Create `directory` (where runs go) and a file in it, or say in one line why not."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise _unwritable(directory, "output directory", e) from e


def prepare(config_name: str, argv: list[str]) -> None:
    """Before Hydra starts: compose once to report a bad override in one line, then make sure the run
    directory is new and writable (plain runs; sweeps, Hydra's flags and HYDRA_FULL_ERROR=1 are left to
    Hydra, which reports them itself)."""
    if is_launcher_child():
        return  # Lightning's DDP launcher re-runs the command with rank 0's directory, on purpose
    run_dir = _override_value(argv, "hydra.run.dir")
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name, overrides=overrides)
        log_dir = OmegaConf.select(cfg, "paths.log_dir", throw_on_resolution_failure=False)
    except CONFIG_ERRORS as e:
        fail(one_line(user_error(e) or e))
    finally:
        GlobalHydra.instance().clear()
    try:
        if run_dir is not None and "${" not in run_dir:  # one with interpolations: unique by its own making
            claim_run_dir(Path(run_dir))
        elif log_dir:
            check_writable(Path(log_dir))
    except UserError as e:
        fail(one_line(e))


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def user_error(e: BaseException) -> BaseException | None:
    """The user's mistake behind `e`, or None for a bug. Hydra wraps what a config's constructor raised,
    OmegaConf what a resolver raised: our own UserError inside either is the message to show."""
    cause = e
    # OmegaConf re-raises a resolver's error without `from`: follow the implicit context as well
    while isinstance(cause, (InstantiationException, OmegaConfBaseException)):
        inner = cause.__cause__ or cause.__context__
        if not isinstance(inner, (InstantiationException, OmegaConfBaseException, UserError)):
            break
        cause = inner
    if isinstance(e, InstantiationException) and cause is e:
        return None  # a constructor failed on something that is not the user's input: a bug
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
            quiet()
            try:
                return task(cfg)
            except (*CONFIG_ERRORS, InstantiationException) as e:
                cause = user_error(e)
                if os.environ.get("HYDRA_FULL_ERROR") == "1" or cause is None:
                    raise
                job = _sweep_job_dir()
                if job is None:
                    fail(one_line(cause))
                return _record_failed_job(job, one_line(cause))

        def main() -> Any:
            quiet()
            register_resolvers()
            prepare(config_name, sys.argv[1:])
            return hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)(guarded)()

        return main

    return decorate


def _sweep_job_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir)


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
    """Hydra callback: after a -m sweep, one row per job (its overrides and final metrics) printed as a
    table and written to summary.json in the sweep directory. Configured in conf/hydra/default.yaml."""

    def __init__(self, filenames: tuple[str, ...] = RESULT_FILES, columns: list[str] | None = None):
        self.filenames = filenames
        self.columns = columns or ["val/acc_best", "test/acc", "test/loss", "wall_time_s"]

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.console import Console
        from rich.table import Table

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for job in sorted(
            (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        ):
            overrides_file = job / ".hydra" / "overrides.yaml"
            overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
            found = [job / name for name in self.filenames if (job / name).is_file()]
            metrics = json.loads(found[0].read_text()) if found else {}
            error = json.loads((job / "error.json").read_text())["error"] if (job / "error.json").is_file() else None
            rows.append(
                {
                    "job": int(job.name),
                    "overrides": overrides,
                    "status": "done" if metrics and not error else "failed",
                    **{c: metrics.get(c) for c in self.columns},
                    **({"error": error} if error else {}),
                }
            )
        (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
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
        failed = [r for r in rows if r["status"] == "failed"]
        if failed:
            first = failed[0]
            fail(
                f"{len(failed)} of {len(rows)} sweep jobs failed (job {first['job']}: "
                f"{first.get('error') or 'no result file'}); every job is listed in {sweep_dir / 'summary.json'}"
            )
        print(f"sweep results: {sweep_dir / 'summary.json'}", flush=True)
