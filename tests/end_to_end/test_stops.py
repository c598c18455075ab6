"""Stops outside the training steps (issue 53): Ctrl-C or SIGTERM while a run starts (two processes, before the first
epoch), while it tests its best checkpoint after fit, and while a search draws its plots. Each is one line, exit 128 +
the signal, saying what was kept and what to run next; the next command it names runs as typed. (Stops during the
training steps: test_signal_resume.py.)"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap

from tests.helpers.commands import ROOT, TESTS_ON_PATH, ctrl_c_as_in_a_terminal, run_cli
from tests.helpers.configs import extra_callback

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "progress_bar=none"]
TWO = ["trainer=ddp_cpu", "trainer.devices=2"]


def stop_when(args: list[str], said: str, signum: int, cwd) -> tuple[int, str]:
    """`timeout 600 python -m vitlab.train args` started as a terminal starts it (a process group of its own), and
    `signum` sent to that group as soon as a line matching `said` is printed: (exit status, everything printed)."""
    p = subprocess.Popen(
        ["timeout", "600", sys.executable, "-m", "vitlab.train", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    printed = []
    for line in p.stdout:
        printed.append(line)
        if re.search(said, line):
            os.killpg(p.pid, signum)  # (timeout forwards it once more)
            break
    printed.append(p.stdout.read())
    return p.wait(timeout=300), "".join(printed)


def as_in_a_terminal(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m vitlab.<args>` as a terminal starts it: a process group of its own, and SIGINT's default action
    whatever this test process inherited (an xdist worker ignores SIGINT, and so would the command)."""
    return subprocess.run(
        [sys.executable, "-m", f"vitlab.{args[0]}", *args[1:]],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )


def test_a_stop_while_two_processes_start_says_so_and_the_same_command_runs_again(tmp_path):
    """SIGTERM to the group after the memory line, before the first epoch (the second process is starting, or both
    wait in their rendezvous): one line, 143, and the run directory, which held only what a start writes, is gone, so
    that the same command with the same hydra.run.dir is not refused: it starts, and stopped again says the same."""
    command = [*TWO, "trainer.max_epochs=1", "hydra.run.dir=runs/a"]
    for _ in range(2):
        code, printed = stop_when(command, r"memory per process", signal.SIGTERM, tmp_path)
        assert code == 128 + signal.SIGTERM, printed[-3000:]
        assert printed.strip().splitlines()[-1] == (
            "error: train stopped by SIGTERM before training began: nothing was saved (its run directory held only "
            "what a start writes, and is removed); run the same command again"
        ), printed[-3000:]
        assert not (tmp_path / "runs").exists()
        assert "Traceback" not in printed and "GPU available: False" not in printed


def test_a_stop_while_testing_the_best_checkpoint_keeps_the_fits_metrics_and_names_the_eval_command(tmp_path):
    """Ctrl-C to the group while training tests its best checkpoint (after "`Trainer.fit` stopped"): the fit's metrics
    are in metrics.json, exit 130, and the line's vitlab.eval command, run as typed, tests that checkpoint."""
    kill = extra_callback("kill", "SignalAtStep", step=1, signum="SIGINT", group=True, hook="on_test_batch_start")
    run = tmp_path / "run"
    r = as_in_a_terminal(["train", *SHORT, "data.batch_size=64", *kill, f"hydra.run.dir={run}"], TESTS_ON_PATH)
    assert r.returncode == 128 + signal.SIGINT, r.stderr[-3000:]
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    metrics = run / "metrics.json"
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: train stopped by Ctrl-C (SIGINT) while testing {best}: the fit's metrics are in {metrics}; test it "
        f"with: python -m vitlab.eval ckpt_path={best}"
    )
    fitted = json.loads(metrics.read_text())
    assert "val/acc_best" in fitted and not any(k.startswith("test/") for k in fitted)
    assert "Detected KeyboardInterrupt" not in r.stderr + r.stdout and "Traceback" not in r.stderr
    python, m, module, *args = shlex.split(r.stderr.strip().split("test it with: ")[1])
    tested = run_cli(module.removeprefix("vitlab."), *args, cwd=tmp_path, env=TESTS_ON_PATH)
    assert tested.returncode == 0, tested.stderr[-3000:]
    (out,) = (tmp_path / "outputs" / "eval" / "runs").iterdir()
    assert json.loads((out / "metrics.json").read_text())["test/acc"] >= 0


def test_a_stop_while_a_search_draws_its_plots_shows_its_table_and_says_what_is_kept(tmp_path):
    """Ctrl-C while an Optuna search draws the study's plots (here: as the first figure is saved): no traceback, no
    half-written picture, the table of trials and optimization_results.yaml as without the stop, one line, 130."""
    here = tmp_path / "site"
    here.mkdir()
    (here / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import os, signal
            import matplotlib.figure

            def savefig(self, *args, **kwargs):
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the picture is written

            matplotlib.figure.Figure.savefig = savefig
            """
        )
    )
    sweep = tmp_path / "sweep"
    env = {"PYTHONPATH": os.pathsep.join([str(here), TESTS_ON_PATH["PYTHONPATH"]])}
    command = ["-m", "hparams_search=digits_optuna", "debug=limit", "progress_bar=none", "hydra.sweeper.n_trials=2"]
    r = as_in_a_terminal(["train", *command, f"hydra.sweep.dir={sweep}"], env)  # (sitecustomize: read at start)
    assert r.returncode == 128 + signal.SIGINT, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: stopped by Ctrl-C (SIGINT) while drawing the sweep's plots: every job's result is kept in {sweep} "
        "(the table above: summary.json); the plots were not drawn"
    )
    assert "Traceback" not in r.stderr
    assert (r.stdout + r.stderr).count("[WARNING] - warmup of") == 1  # (said once, not for every trial)
    assert [row["status"] for row in json.loads((sweep / "summary.json").read_text())] == ["done", "done"]
    assert (sweep / "optimization_results.yaml").is_file()
    assert not list(sweep.glob("*.png")) and not list(sweep.glob(".*.tmp-*"))


# A Hydra plugin (found where Hydra looks for plugins: a `hydra_plugins` package on the path) that Hydra calls as it
# builds its config search path, the first step of composing a command's config: in Lightning's second process only
# (LOCAL_RANK=1), it sends the signal to the whole process group, as a terminal's Ctrl-C or a scheduler's SIGTERM
# would reach it, and waits there; the signal lands while rank 1 composes its config, every time.
STOP_IN_RANK_1_COMPOSE = """
import os, subprocess, time
from hydra.plugins.search_path_plugin import SearchPathPlugin

class StopWhileRank1Composes(SearchPathPlugin):
    def manipulate_search_path(self, search_path):
        if os.environ.get("LOCAL_RANK") == "1":
            subprocess.run(["kill", "-{signal}", "--", f"-{{os.getpgid(0)}}"], check=True, start_new_session=True)
            time.sleep(60)
"""


def test_a_stop_while_the_second_process_composes_its_config_says_so_and_the_same_command_runs_again(tmp_path):
    """SIGTERM, then Ctrl-C, to the group of a two-process run while its second process (started by Lightning) is
    composing its config in Hydra: one line from the first process, exit 143 (130), no traceback from either, and the
    run directory removed, so that the same command runs again (and stopped again says the same)."""
    command = [*TWO, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'runs' / 'a'}"]
    for name, signum in (("SIGTERM", signal.SIGTERM), ("Ctrl-C (SIGINT)", signal.SIGINT)):
        plugins = tmp_path / signum.name / "hydra_plugins"
        plugins.mkdir(parents=True)
        (plugins / "vitlab_test_stop.py").write_text(STOP_IN_RANK_1_COMPOSE.format(signal=signum.name[3:]))
        env = {"PYTHONPATH": os.pathsep.join([str(plugins.parent), TESTS_ON_PATH["PYTHONPATH"]])}
        r = run_cli("train", *command, env=env, own_group=True)
        assert r.returncode == 128 + signum, r.stderr[-3000:]
        assert r.stderr.strip().splitlines()[-1] == (
            f"error: train stopped by {name} before training began: nothing was saved (its run directory held only "
            "what a start writes, and is removed); run the same command again"
        ), r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "GPU available: False" not in r.stdout + r.stderr
        assert not (tmp_path / "runs").exists()
