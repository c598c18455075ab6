"""What every `python -m vitlab.<task>` entry point shares: where the configs are, the run-id
resolver, one-line errors for bad input, the resolved config as a tree, and the model group read
into a ViTConfig. This is the only library module besides the entry points that knows Hydra."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vitlab.model import ViTConfig

# Input errors users can fix; anything else is a bug and keeps its traceback. Hydra wraps errors raised
# while instantiating a config node; those count when what they wrap does.
USER_ERRORS = (ValueError, FileNotFoundError, ConnectionError, OmegaConfBaseException)
# Keys of the model group that are not ViTConfig fields.
MODEL_EXTRA_KEYS = ("variant", "timm_name", "pretrained")


def config_dir() -> Path:
    """conf/ at the repository root (editable installs and checkouts), whatever the working
    directory; VITLAB_CONFIG_DIR points elsewhere."""
    if os.environ.get("VITLAB_CONFIG_DIR"):
        return Path(os.environ["VITLAB_CONFIG_DIR"]).resolve()
    here = Path(__file__).resolve().parents[2] / "conf"
    if not (here / "train.yaml").is_file() and not (here / "parity.yaml").is_file():
        raise FileNotFoundError(
            f"vitlab configs not found at {here}; install vitlab editable from its "
            "repository (make install) or set VITLAB_CONFIG_DIR to its conf/ folder"
        )
    return here


def _new_run_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def register_resolvers() -> None:
    """`${run_id:}`: process id + random hex, cached per config (a sweep's jobs share it, as `now`)."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", _new_run_id, use_cache=True)


def is_launcher_child() -> bool:
    """A process started by Lightning's DDP launcher for ranks > 0 (it sets LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0")) > 0


def refuse_reused_run_dir(argv: list[str]) -> None:
    """Hydra writes into hydra.run.dir before any task code runs; refuse a non-empty one up front
    so an earlier run's files are never overwritten."""
    if is_launcher_child():
        return
    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            path = Path(arg.split("=", 1)[1])
            if path.is_dir() and any(path.iterdir()):
                fail(
                    f"run directory {str(path)!r} already holds files; vitlab never reuses a run "
                    "directory: give a new hydra.run.dir or leave it to the default"
                )


def check_overrides(config_name: str, argv: list[str]) -> None:
    """Hydra reports an unknown key or option in several lines; compose once up front and say it in one
    (plain runs only: sweeps, Hydra's own flags and HYDRA_FULL_ERROR=1 are left to Hydra)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            compose(config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        fail(one_line(e))
    finally:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def entry_point(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """Turn `task(cfg)` into a Hydra command line: configs from config_dir(), run ids, and input
    errors reported as one line (the traceback only with HYDRA_FULL_ERROR=1)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> Any:
            # Lightning gives its loggers a stderr handler of their own when imported before Hydra set up
            # logging; send them, and Python's warnings, through Hydra's logging (terminal and the run's
            # log file) and keep stderr for errors.
            for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
                logger = logging.getLogger(name)
                logger.handlers.clear()
                logger.propagate = True
            logging.captureWarnings(True)  # Python warnings too
            try:
                return task(cfg)
            except (*USER_ERRORS, InstantiationException) as e:
                cause = e.__cause__ if isinstance(e, InstantiationException) else e
                if os.environ.get("HYDRA_FULL_ERROR") == "1" or not isinstance(cause, USER_ERRORS):
                    raise
                fail(one_line(cause))

        def main() -> Any:
            register_resolvers()
            check_overrides(config_name, sys.argv[1:])
            refuse_reused_run_dir(sys.argv[1:])
            return hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)(guarded)()

        return main

    return decorate


def one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if "Original Traceback" in text:  # re-raised from a DataLoader worker: its last line is the error
        text = text.splitlines()[-1].split(": ", 1)[-1]
    if isinstance(e, OmegaConfBaseException):  # its message ends with full_key/object_type lines
        text = text.splitlines()[0]
    text = text.split("\nConfig search path")[0]  # Hydra's missing-option message ends with its search path
    return " ".join(text.split())


def vit_config(model: DictConfig) -> ViTConfig:
    """The model group -> ViTConfig (sizes from `variant`, then the explicit fields)."""
    d = OmegaConf.to_container(model, resolve=True)
    variant = d.pop("variant", None)
    for key in MODEL_EXTRA_KEYS:
        d.pop(key, None)
    return ViTConfig.from_variant(variant, **d)


def print_config_tree(cfg: DictConfig, save_to: Path | None = None) -> None:
    """The resolved config as a rich tree on the terminal, and as YAML in the run directory."""
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key), style="bold")
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)
    if save_to is not None:
        save_to.write_text(OmegaConf.to_yaml(cfg, resolve=True))


# What a finished job of each entry point writes in its directory: train, parity, benchmark.
RESULT_FILES = ("metrics.json", "parity.json", "benchmark.json")


class SweepSummary(Callback):
    """Hydra callback: after a -m sweep, one row per job (its overrides and final metrics) printed as a
    table and written to summary.json in the sweep directory. Configured in conf/hydra/default.yaml."""

    def __init__(self, filenames: tuple[str, ...] = RESULT_FILES, columns: list[str] | None = None):
        self.filenames = filenames
        self.columns = columns or ["val/acc_best", "test/acc", "test/loss", "wall_time_s"]

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        import json

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
            rows.append(
                {
                    "job": int(job.name),
                    "overrides": overrides,
                    "status": "done" if metrics else "failed",
                    **{c: metrics.get(c) for c in self.columns},
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
        Console().print(table)
