"""Sweeps that survive and learn (issue 42), as typed: an Optuna search and a grid stopped by a signal and run again
into their directory go on where they stopped (finished jobs kept, the interrupted one resumed from its checkpoint);
a trial the median pruner gives up on stops before its last epoch; a bad trial is FAILED and the search goes on;
a run resumed from its checkpoint logs to the same W&B run, its steps continued. tests/end_to_end/test_slurm.py has
the same under the Slurm launcher with two processes a job."""

import json
import re
import shlex
import signal
from pathlib import Path

import optuna
import pytest
import yaml

from tests.helpers.commands import run_cli
from tests.helpers.configs import extra_callback
from tests.helpers.runs import resume, wandb_steps

SHORT = ["debug=limit", "progress_bar=none"]
OPTUNA = ["-m", "hparams_search=digits_optuna", *SHORT]


def _trials(sweep):
    study = optuna.load_study(study_name="digits", storage=f"sqlite:///{sweep}/optuna.db")
    return {t.number: t for t in study.get_trials()}


def _wandb_run(job):
    (run,) = (job / "wandb").glob("offline-run-*")
    return run.name.rsplit("-", 1)[1], run


def test_an_optuna_search_killed_in_its_third_trial_goes_on_as_typed_and_keeps_its_w_and_b_run(tmp_path):
    sweep = tmp_path / "sweep"
    kill = extra_callback("kill", "SignalAtStep", step=2, job=2)  # SIGTERM in trial 2's second epoch
    wandb = ["logger=wandb", "logger.wandb.offline=true", "trainer.log_every_n_steps=1"]
    command = [*OPTUNA, "hydra.sweeper.n_trials=4", *wandb, *kill, f"hydra.sweep.dir={sweep}"]
    r = run_cli("train", *command, own_group=True)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    said = re.search(r"continue this sweep with: (.*)", r.stdout)[1]
    assert shlex.split(said) == ["python", "-m", "vitlab.train", *command]
    trials = _trials(sweep)
    assert [trials[n].state.name for n in range(3)] == ["COMPLETE", "COMPLETE", "RUNNING"]
    finished = {n: (sweep / str(n) / "metrics.json").read_bytes() for n in (0, 1)}
    # What the stopped search kept: the ended trials' results, in the summary and as the study's best so far.
    rows = json.loads((sweep / "summary.json").read_text())
    assert [row["status"] for row in rows] == ["done", "done", "interrupted"]
    ended = [json.loads(finished[n])["val/acc_best"] for n in (0, 1)]
    assert [row["val/acc_best"] for row in rows[:2]] == ended
    best = ended.index(max(ended))
    chosen = yaml.safe_load((sweep / str(best) / ".hydra" / "config.yaml").read_text())
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text()) == {
        "name": "optuna",
        "best_params": {
            "optim.lr": chosen["optim"]["lr"],
            "optim.weight_decay": chosen["optim"]["weight_decay"],
            "model.drop_path_rate": chosen["model"]["drop_path_rate"],
            "model.depth": chosen["model"]["depth"],
        },
        "best_value": max(ended),
        "best_trial": best,
        "trials": {"COMPLETE": 2},  # (written from the study as each trial ends: trial 2 had not ended)
    }
    # the interrupted trial alone resumes as a single run, not as a new search
    alone = r.stderr.strip().splitlines()[-1].split("resume with: ")[1]
    assert shlex.split(alone)[-2:] == [
        "hydra.mode=RUN",
        f"ckpt_path={sweep / '2' / 'checkpoints' / 'interrupted.ckpt'}",
    ]
    first_id, first_run = _wandb_run(sweep / "2")

    r = run_cli("train", *command)  # the same command, as the line said
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 of 4 trials ended in an earlier run, 1 to run again (interrupted), 1 new" in r.stderr + r.stdout
    assert f"resuming from {sweep / '2' / 'checkpoints' / 'interrupted.ckpt'}" in r.stderr + r.stdout
    trials = _trials(sweep)
    assert sorted(trials) == [0, 1, 2, 3] and {t.state.name for t in trials.values()} == {"COMPLETE"}
    assert {n: (sweep / str(n) / "metrics.json").read_bytes() for n in (0, 1)} == finished  # not run again
    assert len({tuple(sorted(t.params.items())) for t in trials.values()}) == 4  # the new trial drew new values
    values = {n: json.loads((sweep / str(n) / "metrics.json").read_text())["val/acc_best"] for n in trials}
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == max(values.values()) and result["trials"] == {"COMPLETE": 4}
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["done"] * 4
    assert (sweep / "optimization_history.png").stat().st_size and (sweep / "param_importances.png").stat().st_size
    # Trial 2's W&B run goes on: one id, the resumed steps after the stopped ones.
    runs = sorted((sweep / "2" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {run.name.rsplit("-", 1)[1] for run in runs} == {first_id}
    before, after = wandb_steps(first_run), wandb_steps(next(run for run in runs if run != first_run))
    assert before and after and max(before) < min(after)


def test_a_grid_sweep_killed_in_its_second_job_runs_only_the_others_again(tmp_path):
    sweep = tmp_path / "sweep"
    kill = extra_callback("kill", "SignalAtStep", step=2, job=1)
    command = ["-m", "optim.lr=1e-3,2e-3,3e-3", *SHORT, *kill, f"hydra.sweep.dir={sweep}"]
    r = run_cli("train", *command, own_group=True)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    done = (sweep / "0" / "metrics.json").read_bytes()
    r = run_cli("train", *command)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stderr + r.stdout
    assert "sweep job 0 ended in an earlier run of this sweep (done): not run again" in out
    assert f"resuming from {sweep / '1' / 'checkpoints' / 'interrupted.ckpt'}" in out
    assert (sweep / "0" / "metrics.json").read_bytes() == done
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["done"] * 3 and (sweep / "sweep.png").stat().st_size
    # The table is sorted by the metric, best first.
    shown = [int(m) for m in re.findall(r"^│ (\d) ", r.stdout, re.M)]
    assert shown == sorted(range(3), key=lambda j: -rows[j]["val/acc_best"])
    # Another sweep into the same directory is refused (test_another_sweep_into_a_sweeps_directory_...: every file).
    r = run_cli("train", "-m", "optim.lr=5e-3,2e-3", *SHORT, f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2 and f"hydra.sweep.dir {str(sweep)!r} holds another sweep" in r.stderr
    assert (sweep / "0" / "metrics.json").read_bytes() == done


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _results(sweep):
    """The files of every job's results (metrics.json, csv/, checkpoints/) with their bytes."""
    return {k: v for k, v in _files(sweep).items() if k.parts[0].isdigit() and k.parts[1] in RESULTS}


RESULTS = ("metrics.json", "csv", "checkpoints")


def test_another_sweep_into_a_sweeps_directory_is_refused_up_front_and_the_sweep_still_goes_on(tmp_path):
    """Issue 53: `-m optim.lr=5e-3 trainer.max_epochs=2` into the directory of `-m optim.lr=1e-3,3e-3` is one line,
    exit 2, before any job starts, every file there as it was (each job refused itself into its error.json, Hydra
    rewrote multirun.yaml, and the first sweep's own command then resumed its finished job 0 from last.ckpt). The
    first sweep's command still goes on, its finished jobs skipped; a job directory found holding another job's run
    (the sweep's record gone) stops the sweep in one line, writing nothing there."""
    sweep = tmp_path / "sweep"
    command = ["-m", "optim.lr=1e-3,3e-3", *SHORT, "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"]
    other = ["-m", "optim.lr=5e-3", "trainer.max_epochs=2", f"hydra.sweep.dir={sweep}"]  # (as the issue typed it)
    r = run_cli("train", *command)
    assert r.returncode == 0, r.stderr[-3000:]
    before, results = _files(sweep), _results(sweep)
    assert Path("0/metrics.json") in results and Path("1/checkpoints/last.ckpt") in results

    r = run_cli("train", *other)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    said = re.fullmatch(rf"error: hydra.sweep.dir {re.escape(repr(str(sweep)))} holds another sweep, which goes on "
                        r"with: (.*); give this one a new hydra.sweep.dir", lines[0])  # fmt: skip
    assert said and shlex.split(said[1]) == ["python", "-m", "vitlab.train", *command]
    assert _files(sweep) == before

    r = run_cli("train", *command)  # the first sweep's own command
    assert r.returncode == 0, r.stderr[-3000:]
    for job in (0, 1):
        assert f"sweep job {job} ended in an earlier run of this sweep (done): not run again" in r.stderr + r.stdout
    assert _results(sweep) == results
    rows = json.loads((sweep / "summary.json").read_text())
    assert rows == json.loads(before[Path("summary.json")]) and [row["status"] for row in rows] == ["done", "done"]

    (sweep / "multirun.yaml").unlink()  # no record of the sweep: job 0 finds another job's run in its directory
    summary = (sweep / "summary.json").read_bytes()
    r = run_cli("train", *other)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {sweep / '0'} holds a run of other overrides (")
    assert _results(sweep) == results and (sweep / "summary.json").read_bytes() == summary
    assert not list(sweep.glob("*/error.json"))


def test_a_trial_at_lr_10_is_pruned_by_the_median_pruner_before_its_last_epoch(tmp_path):
    sweep = tmp_path / "sweep"
    pruner = ["hydra.sweeper.pruner=median", "hydra.sweeper.pruner_args={n_startup_trials: 2}"]
    r = run_cli(
        "train", *OPTUNA, "hydra.sweeper.n_trials=3", "optim.lr=choice(0.001,10)", "trainer.max_epochs=4", *pruner,
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    trials = _trials(sweep)
    late = [t for n, t in trials.items() if n >= 2 and t.params["optim.lr"] == 10]
    assert late and all(t.state.name == "PRUNED" for t in late)  # (trials 0 and 1 are the pruner's warm-up)
    for t in late:
        job = sweep / str(t.number)
        epoch = json.loads((job / "metrics.json").read_text())["pruned"]["epoch"]
        assert 1 <= epoch < 4 and max(t.intermediate_values) == epoch - 1
        assert (job / "checkpoints" / "last.ckpt").is_file()  # its directory and last checkpoint are kept
        row = next(row for row in json.loads((sweep / "summary.json").read_text()) if row["job"] == t.number)
        assert row["status"] == f"pruned (epoch {epoch})"


def test_a_bad_trial_is_failed_in_the_study_and_the_search_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli(
        "train", *OPTUNA, "hydra.sweeper.n_trials=4", "model.drop_rate=choice(0.0,1.5)", f"hydra.sweep.dir={sweep}"
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    trials = _trials(sweep)
    assert len(trials) == 4
    for t in trials.values():
        assert t.state.name == ("FAIL" if t.params["model.drop_rate"] == 1.5 else "COMPLETE")
    assert {t.state.name for t in trials.values()} == {"FAIL", "COMPLETE"}
    last = r.stderr.splitlines()[-1]
    assert re.fullmatch(r"error: \d of 4 sweep jobs failed .*drop_rate 1.5 must be in \[0, 1\).*", last), last
    assert "sweep summary" in r.stdout


@pytest.mark.parametrize("n", ["0", "-2"])
def test_a_search_of_no_trials_is_refused_in_one_line_and_leaves_nothing(tmp_path, n):
    sweep = tmp_path / "sweep"
    r = run_cli("train", *OPTUNA, f"hydra.sweeper.n_trials={n}", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: hydra.sweeper.n_trials {n} must be an integer >= 1: the number of trials of the study"
    ]
    assert not sweep.exists()


def test_a_search_whose_every_trial_failed_draws_no_empty_plot(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("train", *OPTUNA, "hydra.sweeper.n_trials=1", "model.drop_rate=1.5", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert [t.state.name for t in _trials(sweep).values()] == ["FAIL"]
    assert (sweep / "optimization_results.yaml").is_file() and not list(sweep.glob("*.png"))
    assert "no trial finished with a value: no plots of the study" in r.stdout + r.stderr


def test_a_run_resumed_from_its_checkpoint_logs_to_the_same_w_and_b_run(tmp_path):
    from tests.helpers.runs import interrupt

    args = ["trainer.max_epochs=1", "data.batch_size=256", "progress_bar=none", "logger=wandb",
            "logger.wandb.offline=true", "trainer.log_every_n_steps=1"]  # fmt: skip
    command = interrupt(args, tmp_path, "SIGTERM", 2, group=False)
    first_id, first_run = _wandb_run(tmp_path / "killed")
    resumed = resume(command, tmp_path)
    second_id, second_run = _wandb_run(resumed)
    assert second_id == first_id
    before, after = wandb_steps(first_run), wandb_steps(second_run)
    assert before and after and max(before) < min(after)


@pytest.mark.parametrize("pruner, args, said", [
    ("hyperbolic", "null", "hydra.sweeper.pruner='hyperbolic' is not one of ['hyperband', 'median', 'succ"),
    ("median", "{n_startup: 2}", "hydra.sweeper.pruner_args={'n_startup': 2}: MedianPruner says"),
])  # fmt: skip
def test_a_bad_pruner_is_one_line(tmp_path, pruner, args, said):
    r = run_cli(
        "train", *OPTUNA, "hydra.sweeper.n_trials=1", f"hydra.sweeper.pruner={pruner}",
        f"hydra.sweeper.pruner_args={args}", f"hydra.sweep.dir={tmp_path / 's'}",
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: {said}"), r.stderr[-2000:]
