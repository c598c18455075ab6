"""vitlab's Optuna sweeper (conf/hydra/sweeper/vitlab_optuna.yaml, `hparams_search=...`): Hydra's Optuna sweeper
with a study that outlives the command, pruning, and a bad trial recorded as FAILED.

- **The study persists**: `hydra.sweeper.storage` is the sweep directory's optuna.db by default. The same command
  with the same `hydra.sweep.dir` continues it: `n_trials` counts every trial of the study, finished ones are kept,
  and a trial that a kill left RUNNING runs again in its own directory, where the job resumes from its
  checkpoint (training/run/resume.py: earlier_start) or starts over, and says which.
- **Trial N runs in job directory N**, so that a job finds its trial (training/callbacks/trial.py) and a re-run finds
its
  directory.
- **Pruning**: `hydra.sweeper.pruner=median|hyperband|successive_halving` with `hydra.sweeper.pruner_args`; a
  pruned job writes `pruned` into its metrics.json and is told to the study as PRUNED.
- **A failed trial is FAILED** in the study (a NaN, a bad config, a bug) and the search goes on; Hydra's sweeper
  passed values with that state and stopped with Optuna's traceback. `max_failure_rate` stops it early.
- At the end: optimization_results.yaml over every trial of the study, and optimization_history.png and
  param_importances.png beside it (cli/sweep_plots.py).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    """Hydra's OptunaSweeper's arguments, and `pruner`, `pruner_args` (training.callbacks.pruners.PRUNERS)."""

    def __init__(self, *args: Any, pruner: str | None = None, pruner_args: Any = None, **kwargs: Any) -> None:
        self.sweeper = _impl_class()(*args, **kwargs)
        self.sweeper.pruner_name, self.sweeper.pruner_args = pruner, dict(pruner_args or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from vitlab.training.callbacks.pruners import make_pruner
        from vitlab.utils.errors import UserError, fail, one_line

        try:  # a bad pruner, before any trial
            make_pruner(self.sweeper.pruner_name, self.sweeper.pruner_args)
        except UserError as e:
            fail(one_line(e))
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        return self.sweeper.sweep(arguments)


def _impl_class():
    """Hydra's implementation (imports optuna: not at Hydra's plugin scan) with vitlab's sweep loop."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    class Impl(OptunaSweeperImpl):
        pruner_name: str | None = None
        pruner_args: dict[str, Any] = {}

        def sweep(self, arguments: list[str]) -> None:
            _sweep(self, arguments)

    return Impl


def _search_space(impl: Any, arguments: list[str]) -> tuple[dict, dict]:
    """The distributions to sample and the fixed values, as Hydra's sweeper reads them (its params, then the
    command line); a grid sampler gets its grid and `n_trials` at most its size."""
    import functools

    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    impl._process_searchspace_config()
    distributions, fixed = create_params_from_overrides([*impl._parse_sweeper_params_config(), *arguments])
    distributions = {**(impl.search_space_distributions or {}), **distributions}
    if isinstance(impl.sampler, functools.partial) and impl.sampler.func == optuna.samplers.GridSampler:
        grid = {name: impl._to_grid_sampler_choices(d) for name, d in distributions.items()}
        impl.sampler = impl.sampler(grid)
        impl.n_trials = min(impl.n_trials, math.prod(len(v) for v in grid.values()))
    return {k: v for k, v in distributions.items() if k not in fixed}, fixed


def _study(impl: Any):
    import optuna

    from vitlab.training.callbacks.pruners import make_pruner

    if impl.storage and str(impl.storage).startswith("sqlite:///"):
        Path(str(impl.storage)[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    elif impl.storage is None and impl.pruner_name is not None:
        from vitlab.utils.errors import fail

        fail(
            "hydra.sweeper.storage=null keeps the study in this process, where a job cannot report to it: "
            "leave hydra.sweeper.storage at its default (the sweep directory's optuna.db) to prune"
        )
    optuna.logging.disable_default_handler()  # its lines in the sweep's log, as Hydra's are (not in colour)
    optuna.logging.enable_propagation()
    return optuna.create_study(
        study_name=impl.study_name,
        storage=impl.storage,
        sampler=impl.sampler,
        directions=impl._get_directions(),
        load_if_exists=True,
        pruner=make_pruner(impl.pruner_name, impl.pruner_args),
    )


def _sweep(impl: Any, arguments: list[str]) -> None:
    import optuna

    if not isinstance(impl.n_trials, int) or impl.n_trials < 1:  # before the study or a job is made
        from vitlab.utils.errors import fail

        fail(f"hydra.sweeper.n_trials {impl.n_trials!r} must be an integer >= 1: the number of trials of the study")
    distributions, fixed = _search_space(impl, arguments)
    study = _study(impl)
    Path(impl.sweep_dir).mkdir(parents=True, exist_ok=True)  # (the study may be kept elsewhere)
    # The sweep's config, as Hydra's grid sweeper saves it: a later sweep into this directory is held to its overrides.
    OmegaConf.save(impl.config, Path(impl.sweep_dir) / "multirun.yaml")
    state = optuna.trial.TrialState
    earlier = study.get_trials(deepcopy=False)
    _reseed(impl, study, len(earlier))
    ended = [t for t in earlier if t.state.is_finished()]
    again = [t for t in earlier if t.state in (state.RUNNING, state.WAITING)]
    if earlier:
        log.info(
            "study %r in %s: %d of %d trials ended in an earlier run, %d to run again (interrupted), %d new",
            study.study_name, impl.storage, len(ended), impl.n_trials, len(again),
            max(0, impl.n_trials - len(ended) - len(again)),
        )  # fmt: skip
    else:
        where = impl.storage or "memory (gone at the end)"
        log.info("study %r in %s: %d trials", study.study_name, where, impl.n_trials)
    to_go, failures, told = impl.n_trials - len(ended), 0, 0
    while to_go > 0:
        if again:
            trials = [optuna.trial.Trial(study, again.pop(0)._trial_id)]
            overrides = [_earlier_overrides(study, trials[0])]
        else:
            trials = [study.ask() for _ in range(min(to_go, impl.n_jobs))]
            overrides = impl._configure_trials(trials, distributions, fixed)
        _own_directories(impl, trials, overrides)
        returns = impl.launcher.launch(overrides, initial_job_idx=trials[0].number)
        for trial, ret in zip(trials, returns, strict=True):
            outcome, values = _outcome(ret, Path(impl.sweep_dir) / str(trial.number))
            study.tell(trial, values=values, state=outcome)
            failures += outcome == state.FAIL
        told, to_go = told + len(trials), to_go - len(trials)
        _results(impl, study, plots=False)  # so far: a search stopped part-way still has it
        if to_go > 0 and failures / told > impl.max_failure_rate:
            log.error(
                "%d of %d trials failed, more than hydra.sweeper.max_failure_rate=%s: the search stops here",
                failures, told, impl.max_failure_rate,
            )  # fmt: skip
            break
    _results(impl, study)


def _own_directories(impl: Any, trials: list, overrides: list) -> None:
    """Refuse in one line, before Hydra writes into them (.hydra/), trial directories that hold another trial's run:
    a study begun again (another study_name, its optuna.db removed) numbers its trials from 0 again."""
    from vitlab.cli.sweep import refuse_other_job
    from vitlab.utils.errors import UserError, fail, one_line

    try:
        for trial, job in zip(trials, overrides, strict=True):
            refuse_other_job(Path(impl.sweep_dir) / str(trial.number), sorted(job))
    except UserError as e:
        fail(one_line(e))


def _reseed(impl: Any, study: Any, earlier: int) -> None:
    """A study continued with a seeded sampler draws on from seed + the trials it has: the seed alone would draw
    its first values again, and a TPE search would re-run its first trials."""
    from hydra.utils import instantiate

    node = impl.config.hydra.sweeper.get("sampler")
    if not earlier or node is None or node.get("seed") is None or not hasattr(study.sampler, "reseed_rng"):
        return
    study.sampler = instantiate(node, seed=int(node.seed) + earlier)
    log.info("sampler seed %d + %d earlier trials", node.seed, earlier)


def _earlier_overrides(study: Any, trial: Any) -> tuple[str, ...]:
    """The overrides of a trial that ran before (its sampled values, then the fixed ones)."""
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    log.info("trial %d was interrupted in an earlier run: it runs again in its own directory", trial.number)
    return tuple(f"{name}={value}" for name, value in {**frozen.params, **frozen.user_attrs}.items())


def _outcome(ret: Any, job: Path) -> tuple[Any, list[float] | None]:
    """How a job ended, for its trial: COMPLETE with its value, PRUNED (its metrics.json says so) or FAIL (NaN: a
    bad config or a bug, recorded in its error.json; or no number at all)."""
    from optuna.trial import TrialState

    metrics = json.loads((job / "metrics.json").read_text()) if (job / "metrics.json").is_file() else {}
    if metrics.get("pruned"):
        return TrialState.PRUNED, None
    try:
        value = float(ret.return_value)
    except Exception as e:  # the job raised (Hydra's JobReturn re-raises it here), or returned no number
        log.warning("trial %s failed: %s", job.name, e)
        return TrialState.FAIL, None
    return (TrialState.FAIL, None) if math.isnan(value) else (TrialState.COMPLETE, [value])


def _results(impl: Any, study: Any, plots: bool = True) -> None:
    """optimization_results.yaml over every trial of the study (the best, and how many ended each way), and with
    `plots` the study's plots beside it."""
    from collections import Counter

    from optuna.trial import TrialState

    from vitlab.cli.sweep_plots import plot_study
    from vitlab.utils.atomic import atomic_write

    sweep_dir = Path(impl.config.hydra.sweep.dir)
    counts = Counter(t.state.name for t in study.get_trials(deepcopy=False))
    results: dict[str, Any] = {"name": "optuna", "trials": dict(counts)}
    if counts.get(TrialState.COMPLETE.name) and len(impl._get_directions()) == 1:
        best = study.best_trial
        results |= {"best_params": best.params, "best_value": best.value, "best_trial": best.number}
    text = OmegaConf.to_yaml(OmegaConf.create(results)).encode()
    atomic_write(sweep_dir / "optimization_results.yaml", lambda f: f.write(text), what="sweep results")
    if plots and not counts.get(TrialState.COMPLETE.name):
        log.info("no trial finished with a value: no plots of the study")
    elif plots:
        if "best_trial" in results:
            log.info("best of %d trials: trial %d, %s, value %s", sum(counts.values()), best.number, best.params,
                     best.value)  # fmt: skip
        plot_study(study, sweep_dir)
