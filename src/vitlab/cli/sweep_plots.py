"""A sweep's pictures, written beside its summary.json at the end: for an Optuna search the study's optimization
history and parameter importances (Optuna's matplotlib backend), for a grid the optimised metric over the swept
values. A picture that cannot be drawn (too few finished trials, nothing swept) is said in one log line. Ctrl-C or
SIGTERM while they are drawn leaves no half-written picture and stops only the drawing: the sweep's table is still
shown, then its command says in one line what is kept (`stopped`, read by vitlab.cli.entry)."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

# A stop (Ctrl-C, SIGTERM) while a sweep's plots were drawn, and the sweep's directory.
stopped: tuple[KeyboardInterrupt, Path] | None = None

Draw = TypeVar("Draw", bound=Callable[..., Any])


def _or_stopped(draw: Draw) -> Draw:
    """`draw(..., sweep_dir)`, or None where Ctrl-C or SIGTERM stopped it (recorded in `stopped`)."""

    @functools.wraps(draw)
    def drawn(*args: Any) -> Any:
        global stopped
        try:
            return draw(*args)
        except KeyboardInterrupt as e:
            stopped = (e, args[-1])
            return None

    return drawn  # type: ignore[return-value]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@_or_stopped
def plot_study(study: Any, sweep_dir: Path) -> list[Path]:
    """optimization_history.png (Optuna's matplotlib plot) and param_importances.png of `study` in `sweep_dir`, the
    ones that can be drawn. The importances are Optuna's (get_param_importances, the mean decrease in impurity of a
    seeded random forest: fANOVA, its default, fails on this numpy), drawn here: Optuna 2's own plot calls a
    matplotlib function that matplotlib 3.9 removed."""
    from optuna.exceptions import ExperimentalWarning
    from optuna.visualization import matplotlib as vis

    plt = _pyplot()
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        ax = vis.plot_optimization_history(study)
    _save(ax.figure, sweep_dir / "optimization_history.png", written)
    importances = _importances(study)
    if importances:
        fig, ax = plt.subplots(figsize=(7, 0.6 * len(importances) + 1.5))
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names], color="tab:blue")
        ax.set_xlabel("importance (mean decrease in impurity)")
        ax.set_title(f"hyperparameter importances over {_complete(study)} finished trials")
        _save(fig, sweep_dir / "param_importances.png", written)
    log.info("the study's plots: %s", ", ".join(str(p) for p in written))
    return written


def _complete(study: Any) -> int:
    from optuna.trial import TrialState

    return sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))


def _importances(study: Any) -> dict[str, float]:
    """Optuna's parameter importances, or {} (said in one line) where they cannot be computed."""
    import optuna
    from optuna.importance import MeanDecreaseImpurityImportanceEvaluator

    try:
        evaluator = MeanDecreaseImpurityImportanceEvaluator(seed=0)
        return dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
    except (ValueError, RuntimeError) as e:  # fewer than two finished trials, or nothing that varies
        log.info("no param_importances.png: %s", e)
        return {}


def _save(fig: Any, path: Path, written: list[Path]) -> None:
    plt = _pyplot()
    fig.set_size_inches(max(fig.get_figwidth(), 7), max(fig.get_figheight(), 3))
    fig.tight_layout()
    _write(fig, path)
    plt.close(fig)
    written.append(path)


def _write(fig: Any, path: Path) -> None:
    from vitlab.utils.atomic import atomic_write

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), what="sweep plot")


def _swept(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The keys whose values differ between jobs, each job's value as typed."""
    values = [dict(o.split("=", 1) for o in row["overrides"] if "=" in o) for row in rows]
    keys = dict.fromkeys(k for v in values for k in v)
    return {k: [v.get(k, "") for v in values] for k in keys if len({v.get(k) for v in values}) > 1}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@_or_stopped
def plot_grid(rows: list[dict[str, Any]], metric: str | None, sweep_dir: Path) -> Path | None:
    """sweep.png: `metric` of each finished job over the first swept key's values (a log axis for values spread
    over decades), one line for each combination of the other swept keys."""
    swept = _swept(rows)
    ended = [i for i, r in enumerate(rows) if isinstance(r.get(metric), (int, float)) and r[metric] == r[metric]]
    if not swept or not ended:
        return None
    first, *others = swept
    lines: dict[str, list[tuple[str, float]]] = {}
    for i in ended:
        label = " ".join(f"{k}={swept[k][i]}" for k in others) or metric
        lines.setdefault(label, []).append((swept[first][i], rows[i][metric]))
    numeric = all(_number(x) is not None for pts in lines.values() for x, _ in pts)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in lines.items():
        pts.sort(key=lambda p: _number(p[0]) if numeric else 0)
        xs = [_number(x) for x, _ in pts] if numeric else [x for x, _ in pts]
        ax.plot(xs, [y for _, y in pts], marker="o", label=label)
    if numeric:
        xs = [_number(x) for pts in lines.values() for x, _ in pts]
        if min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")
    ax.set_xlabel(first)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} over {first} ({len(ended)} of {len(rows)} jobs ended)")
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _write(fig, sweep_dir / "sweep.png")
    plt.close(fig)
    log.info("the sweep's plot: %s", sweep_dir / "sweep.png")
    return sweep_dir / "sweep.png"
