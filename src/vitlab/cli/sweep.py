"""The summary of a -m sweep: one row per job (its overrides, status and final metrics), written as each job
ends, and the table printed when the sweep is over. A Hydra callback, configured in conf/hydra/default.yaml.

A sweep run again into its directory: another sweep refused before Hydra starts (`check_sweep_dir`), a job that
ended skipped, its results never rewritten (`earlier_result`), a directory of another job's run refused
(`refuse_other_job`)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from vitlab.utils.errors import UserError, fail

# What a finished job of each entry point writes in its directory: train, parity, benchmark.
RESULT_FILES = ("metrics.json", "parity.json", "benchmark.json")
# A column of the summary that no job logged, shown as what runs of several labels an image log in its place (the
# checkpoint and the sweeper follow val/map: cli/plans.py optimized_metric).
IN_PLACE_OF = {"val/acc_best": "val/map_best", "test/acc": "test/map"}


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
        from vitlab.utils.atomic import atomic_write

        sweep_dir = Path(hydra_cfg.sweep.dir)
        rows = [self._row(job) for job in _job_dirs(sweep_dir)]
        text = json.dumps(rows, indent=2).encode()
        atomic_write(sweep_dir / "summary.json", lambda f: f.write(text), what="sweep summary")
        sweeper, target = hydra_cfg.sweeper, str(hydra_cfg.sweeper.get("_target_", ""))
        ours = target.endswith("vitlab_optuna.OptunaSweeper")  # (which writes it from its study, trial by trial)
        if "optuna" in target.lower() and not ours and isinstance(sweeper.get("direction"), str):
            best = _best_trial(sweep_dir, _shown(metric, rows), sweeper)
            if best is not None:
                text = OmegaConf.to_yaml(OmegaConf.create(best)).encode()
                atomic_write(sweep_dir / "optimization_results.yaml", lambda f: f.write(text), what="sweep results")
        return rows

    def _row(self, job: Path) -> dict[str, Any]:
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
        found = [job / name for name in self.filenames if (job / name).is_file()]
        metrics = json.loads(found[0].read_text()) if found else {}
        failure = json.loads((job / "error.json").read_text()) if (job / "error.json").is_file() else {}
        error = failure.get("error")
        if metrics.get("pruned") and not error:
            status = f"pruned (epoch {metrics['pruned']['epoch']})"
        elif metrics and not error:
            status = "done"
        elif error:
            status = "failed"
        else:  # still running, stopped on a signal (its checkpoint resumes it) or killed
            status = "interrupted" if (job / "checkpoints" / "interrupted.ckpt").is_file() else "unfinished"
        stop = job / "interrupted.json"  # what training wrote when it stopped on a signal: the command that resumes it
        resume = json.loads(stop.read_text()).get("resume") if status == "interrupted" and stop.is_file() else None
        return {
            "job": int(job.name),
            "overrides": overrides,
            "status": status,
            **{_shown(c, [metrics]): metrics.get(_shown(c, [metrics])) for c in self.columns},
            **({"error": error} if error else {}),
            **({"bug": True} if failure.get("bug") else {}),
            **({"resume": resume} if resume else {}),
        }

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from vitlab.cli.sweep_plots import plot_grid

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = self.show(config.hydra, config.get("optimized_metric"))
        if "optuna" not in str(config.hydra.sweeper.get("_target_", "")).lower():  # (Optuna's: the study's plots)
            plot_grid(rows, _shown(config.get("optimized_metric"), rows), sweep_dir)
        failed = [r for r in rows if r["status"] != "done" and not r["status"].startswith("pruned")]
        if failed:
            first = failed[0]
            bug = any(r.get("bug") for r in failed)  # a failure of our code, its traceback shown above: exit 1
            which = f"jobs {', '.join(str(r['job']) for r in failed)}; " if len(failed) > 1 else ""
            fail(
                f"{len(failed)} of {len(rows)} sweep jobs failed ({which}job {first['job']}: "
                f"{first.get('error') or first['status']}); every job is listed in {sweep_dir / 'summary.json'}",
                1 if bug else 2,
            )
        print(f"sweep results: {sweep_dir / 'summary.json'}", flush=True)

    def show(self, hydra_cfg: DictConfig, metric: str | None) -> list[dict[str, Any]]:
        """summary.json written, and its rows printed as a table: at the sweep's end, or where a signal ends it."""
        from rich.console import Console
        from rich.table import Table

        from vitlab.utils.atomic import atomic_write

        sweep_dir = Path(hydra_cfg.sweep.dir)
        rows = self.write(hydra_cfg, metric)
        columns, metric = [_shown(c, rows) for c in self.columns], _shown(metric, rows)
        order = f", best {metric} first" if metric in columns else ""
        table = Table(title=f"sweep summary ({sweep_dir}){order}")
        for col in ["job", "overrides", "status", *columns]:
            table.add_column(col)
        for r in _by_metric(rows, metric, _direction(hydra_cfg, metric)):
            table.add_row(
                str(r["job"]),
                " ".join(r["overrides"]),
                r["status"],
                *[f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c)) for c in columns],
            )
        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(table)
        over_folds = fold_means(rows, self.columns)
        if over_folds:
            text = json.dumps(over_folds, indent=2).encode()
            atomic_write(sweep_dir / "folds.json", lambda f: f.write(text), what="sweep's fold means")
            console.print(_folds_table(over_folds, self.columns, sweep_dir))
        return rows


def fold_means(rows: list[dict[str, Any]], columns: list[str]) -> list[dict[str, Any]]:
    """A k-fold sweep's (`-m data.fold=range(K)`): for each setting (the overrides less data.fold) the mean and the
    standard deviation (numpy's, ddof 0) of each column over its finished folds. Empty when no job sets data.fold."""
    import numpy as np

    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        if not any(o.startswith("data.fold=") for o in row["overrides"]):
            continue
        setting = tuple(o for o in row["overrides"] if not o.startswith("data.fold="))
        groups.setdefault(setting, []).append(row)
    out = []
    for setting, members in groups.items():
        done = [r for r in members if r["status"] == "done"]
        entry: dict[str, Any] = {"overrides": list(setting), "folds": len(members), "done": len(done)}
        for c in columns:
            values = [r[c] for r in done if isinstance(r.get(c), (int, float)) and r[c] == r[c]]
            if values:
                entry[c] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "n": len(values)}
        out.append(entry)
    return out


def _folds_table(over_folds: list[dict[str, Any]], columns: list[str], sweep_dir: Path):
    from rich.table import Table

    table = Table(title=f"over the folds: mean ± std ({sweep_dir / 'folds.json'})")
    for col in ["overrides", "folds done", *columns]:
        table.add_column(col)
    for e in over_folds:
        cells = [f"{e[c]['mean']:.4g} ± {e[c]['std']:.2g}" if c in e else "-" for c in columns]
        table.add_row(" ".join(e["overrides"]) or "(all)", f"{e['done']}/{e['folds']}", *cells)
    return table


def _shown(column: str | None, rows: list[dict[str, Any]]) -> str | None:
    """`column`, or what several labels an image log in its place (IN_PLACE_OF) where no row has it and one has that."""
    instead = IN_PLACE_OF.get(column or "")
    if instead and not any(r.get(column) is not None for r in rows) and any(r.get(instead) is not None for r in rows):
        return instead
    return column


def _direction(hydra_cfg: DictConfig, metric: str | None) -> str:
    """Which way `metric` is better: the Optuna sweeper's direction, else up unless it is a loss or an error."""
    direction = hydra_cfg.sweeper.get("direction")
    if isinstance(direction, str):
        return direction
    return "minimize" if metric and any(w in metric for w in ("loss", "error", "time")) else "maximize"


def _by_metric(rows: list[dict[str, Any]], metric: str | None, direction: str) -> list[dict[str, Any]]:
    """The rows best `metric` first; rows without a number for it after them, in job order."""

    def key(row: dict[str, Any]) -> tuple[bool, float]:
        value = row.get(metric) if metric else None
        if not isinstance(value, (int, float)) or value != value:
            return True, 0.0
        return False, -value if direction == "maximize" else value

    return sorted(rows, key=key)


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
        ended = json.loads(result.read_text())
        value = ended.get(metric)
        if isinstance(value, (int, float)) and value == value and not ended.get("pruned"):  # as Optuna counts
            job_cfg = OmegaConf.load(cfg_file)
            trials.append((value, {k: OmegaConf.select(job_cfg, k) for k in params}))
    if not trials:
        return None
    pick = max if sweeper.direction == "maximize" else min
    value, best = pick(trials, key=lambda t: t[0])
    return {"name": "optuna", "best_params": best, "best_value": value, "trials_ended": len(trials)}


def check_sweep_dir(sweep_dir: str | None, argv: list[str], command: str) -> None:
    """Before Hydra starts the sweep of `argv` into `sweep_dir`: refuse in one line one that is not the sweep the
    directory holds, before anything in it is rewritten (Hydra rewrites multirun.yaml, and each job's .hydra/
    before the job runs). `command`: the module, for the line that goes on with the directory's own sweep.

    A sweep is the overrides that choose its jobs, as its multirun.yaml records them: the command's own
    (hydra.overrides.task) and the sweeper's params (hydra.sweeper.params.*), in their order, which numbers the
    jobs. The rest of hydra.* may change: the hydra.sweep.dir that the continue command adds (entry.py:
    _summarize_sweep), an Optuna search's n_trials, the launcher. A directory without multirun.yaml is left to each
    job's own check (`refuse_other_job`), as is a sweep directory with interpolations (the default: its time)."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if sweep_dir is None or "${" in sweep_dir:
        return
    record = Path(sweep_dir) / "multirun.yaml"
    try:
        node = OmegaConf.select(OmegaConf.load(record), "hydra.overrides") if record.is_file() else None
        ours = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except (yaml.YAMLError, HydraException):  # a record cut short by a kill; a malformed override (Hydra says so)
        return
    theirs = OmegaConf.to_container(node) if node is not None else None  # (as typed: interpolations unresolved)
    task = [o.input_line for o in ours if not o.is_hydra_override()]
    hydra = [o.input_line for o in ours if o.is_hydra_override()]
    if theirs is None or _jobs_chosen_by(theirs["task"], theirs["hydra"]) == _jobs_chosen_by(task, hydra):
        return
    again = [
        "python", "-m", command, "-m", *theirs["task"],
        *(o for o in theirs["hydra"] if not o.startswith(("hydra.sweep.dir=", "hydra.mode="))),  # (Hydra's for -m)
        f"hydra.sweep.dir={sweep_dir}",
    ]  # fmt: skip
    fail(f"hydra.sweep.dir {sweep_dir!r} holds another sweep, which goes on with: {shlex.join(again)}; give this one "
         "a new hydra.sweep.dir")  # fmt: skip


def _jobs_chosen_by(task: list[str], hydra: list[str]) -> list[str]:
    return [*task, *(o for o in hydra if o.lstrip("+~").startswith("hydra.sweeper.params."))]


class OtherJobsRun(UserError):
    """A sweep job's directory holds a run of another job: the whole sweep stops on this one line (cli/entry.py),
    and nothing of it is written there, not even the error.json of a failed job."""


def refuse_other_job(out: Path, overrides: list[str]) -> None:
    """Refuse job directory `out` for the job of `overrides` (sorted) where it holds another job's run (other
    overrides, as its JOB_FILE recorded them), or a finished run that recorded none: a finished job's results are
    never rewritten, nor resumed into."""
    record = out / JOB_FILE
    if record.is_file() and (before := json.loads(record.read_text())) != overrides:
        differ = [o for o in before if o not in overrides][:2] + [f"now {o}" for o in overrides if o not in before][:2]
        raise OtherJobsRun(
            f"{out} holds a run of other overrides ({', '.join(differ)}); continue a sweep with the command that "
            "started it, or give a new hydra.sweep.dir"
        )
    if not record.is_file() and any((out / name).is_file() for name in RESULT_FILES):
        raise OtherJobsRun(f"{out} holds a finished run of no recorded overrides; give a new hydra.sweep.dir")


def earlier_result(out: Path) -> dict[str, Any] | None:
    """In a -m sweep run again into the same sweep directory, this job's metrics.json where it ended in an earlier run
    (done or pruned; or failed after writing it): the job is skipped, its results never rewritten. A job directory
    that holds another job's run is refused (`refuse_other_job`), before anything of it is touched; an interrupted
    job of the same overrides goes on from its checkpoint (training/run/resume.py: earlier_start)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    now = sorted(HydraConfig.get().overrides.task)
    refuse_other_job(out, now)
    record, mine = out / JOB_FILE, out / f".{JOB_FILE}.{os.getpid()}"
    mine.write_text(json.dumps(now))
    try:  # the job's first start: published whole (every rank of a Slurm job writes the same; one link wins)
        os.link(mine, record)
        return None
    except FileExistsError:
        pass  # an earlier start's record (checked above), or another rank's of this start
    finally:
        mine.unlink()
    if not (out / "metrics.json").is_file():
        (out / "error.json").unlink(missing_ok=True)  # failed before: it runs again, its row says how it ends now
        return None
    metrics = json.loads((out / "metrics.json").read_text())
    logging.getLogger("vitlab.train").info(not_run_again(out, metrics))
    return metrics


def ended_metrics(out: Path, overrides: list[str]) -> dict[str, Any] | None:
    """What earlier_result finds as a job starts, read before it does (and writing nothing): the metrics of the job
    of these (sorted) overrides in `out` where it ended in an earlier run of this sweep, or None. The Slurm launcher
    submits no job for it (cli/slurm.py)."""
    record, metrics = out / JOB_FILE, out / "metrics.json"
    if not metrics.is_file() or not record.is_file() or json.loads(record.read_text()) != overrides:
        return None
    return json.loads(metrics.read_text())


def not_run_again(out: Path, metrics: dict[str, Any]) -> str:
    """The line a job that ended in an earlier run of its sweep logs instead of running."""
    how = f"pruned at epoch {metrics['pruned']['epoch']}" if metrics.get("pruned") else "done"
    result = out / "metrics.json"
    return f"sweep job {out.name} ended in an earlier run of this sweep ({how}): not run again; its result: {result}"


# A sweep job's overrides, sorted, written at its first start: a sweep run again into its directory finds them.
JOB_FILE = ".vitlab-job.json"


def optimized_value(key: str | None, metrics: dict[str, Any], warn: bool = True) -> float | None:
    """The value of `optimized_metric` a job returns to its sweeper. One the run did not log (stopped by max_steps
    before the first validation) is a warning (`warn`: from the first process only), in a sweep as in a single run:
    the job ran as asked, and is `done` in the summary with that column empty; a sweeper gets NaN (Optuna records a
    failed trial)."""
    if key is None:
        return None
    if key not in metrics:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if warn:
            logging.getLogger("vitlab.train").warning(
                "optimized_metric %r was not logged; logged: %s", key, sorted(metrics)
            )
        return float("nan") if HydraConfig.get().mode == RunMode.MULTIRUN else None
    return metrics[key]
