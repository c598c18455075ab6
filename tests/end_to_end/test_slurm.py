"""vitlab's Slurm launcher on a real Slurm cluster of one host: Debian's slurmctld, slurmd and munge, started by
tests/cluster/slurm-localhost.sh. The tests skip, saying why, where that cannot be done (not root, no packages).

The README's sweep runs as typed and each job equals the same command run locally; the request follows the run;
a job Slurm can never start, and sbatch's refusals, are one line; a job that is requeued or gets its time-limit
signal checkpoints, comes back and resumes by itself, and ends with the uninterrupted run's metrics."""

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import optuna
import pytest

from tests.helpers.commands import ROOT, TESTS_ON_PATH, replaced, run_cli
from tests.helpers.configs import extra_callback
from tests.helpers.docs import documented
from tests.helpers.runs import assert_close_run, assert_same_run, trained, wandb_steps

CLUSTER = ROOT / "tests" / "cluster" / "slurm-localhost.sh"
SHORT = ["trainer.max_epochs=2", "data.batch_size=128", "progress_bar=none", "trainer.deterministic=true"]
SWEEP = list(documented("train", "-m", "hydra/launcher=slurm", "trainer=ddp_cpu", "trainer.devices=2"))  # on CPUs


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("starting a Slurm cluster (tests/cluster/slurm-localhost.sh) needs root")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("no Slurm here and no apt-get to install Debian's slurmctld, slurmd and munge")
    # The node gets every CPU: `nproc` counts OMP_NUM_THREADS, which tests/conftest.py sets to one a process.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    r = subprocess.run(["bash", str(CLUSTER)], capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0 or "idle" not in r.stdout:
        pytest.skip(f"the Slurm cluster did not start: {(r.stderr or r.stdout).strip()[-400:]}")
    yield
    for pid_file in Path("/run/slurm").glob("*.pid"):
        subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)


def _sweep_dir(tmp_path: Path) -> Path:
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    return sweep


def _squeue(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def test_the_readmes_sweep_runs_as_typed_and_each_job_equals_the_local_run(cluster, tmp_path, tmp_path_factory):
    r = run_cli("train", *SWEEP, "optim.lr=1e-3,3e-4", *SHORT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = _sweep_dir(tmp_path)
    assert [row["status"] for row in json.loads((sweep / "summary.json").read_text())] == ["done", "done"]
    assert "RUNNING" in r.stderr + r.stdout  # the wait is not silent
    # The request follows the run: two tasks of one CPU each (digits loads in the main process), no GPU.
    (script,) = (sweep / ".submitit").glob("*/*_submission.sh")
    flags = {line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH")}
    assert {"--ntasks-per-node=2", "--cpus-per-task=1", "--nodes=1", "--signal=USR2@120", "--requeue"} <= flags
    assert not any("gpu" in flag or "gres" in flag or "mem" in flag for flag in flags), flags
    for job, lr in (("0", "1e-3"), ("1", "3e-4")):
        local = tmp_path / f"local{job}"
        if lr == "1e-3":  # optim.lr's default: the run test_launchers.py compares torchrun's with, trained once
            local = trained(tmp_path_factory, "ddp-two-short", "trainer=ddp_cpu", "trainer.devices=2", *SHORT)
        else:
            r = run_cli("train", "trainer=ddp_cpu", "trainer.devices=2", f"optim.lr={lr}", *SHORT,
                        f"hydra.run.dir={local}")  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
        assert_same_run(local, sweep / job)
        assert (sweep / job / "train_rank1.log").is_file()  # the second task logs on its own
    # The same sweep into its directory again (issue 42): both jobs had ended, neither trains again, nor is submitted
    # (a job would wait its turn in the queue only to say so).
    ended = {job: (sweep / job / "metrics.json").read_bytes() for job in ("0", "1")}
    submitted = sorted((sweep / ".submitit").iterdir())
    r = run_cli("train", *SWEEP, "optim.lr=1e-3,3e-4", *SHORT, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {job: (sweep / job / "metrics.json").read_bytes() for job in ("0", "1")} == ended
    assert sorted((sweep / ".submitit").iterdir()) == submitted and "submitted" not in r.stdout + r.stderr
    for job in ("0", "1"):
        assert "ended in an earlier run of this sweep (done): not run again" in (sweep / job / "train.log").read_text()
    assert [row["status"] for row in json.loads((sweep / "summary.json").read_text())] == ["done", "done"]


def test_a_sweep_of_sharded_runs_requests_one_task_per_device_and_each_job_trains(cluster, tmp_path, tmp_path_factory):
    """trainer=fsdp_cpu under hydra/launcher=slurm: the request follows the run as for DDP (two tasks, no GPU), the
    job shards over its two tasks, and ends with the metrics of the same command run locally (measured: the
    training's equal, validation losses within 3e-7: the Slurm tasks compute with one thread each). One job, at
    optim.lr's default (the DDP sweep above has two): the local run is test_launchers.py's, trained once."""
    sweep_args = ["-m", "hydra/launcher=slurm", "trainer=fsdp_cpu"]
    r = run_cli("train", *sweep_args, "optim.lr=1e-3", *SHORT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    sweep = _sweep_dir(tmp_path)
    assert [row["status"] for row in json.loads((sweep / "summary.json").read_text())] == ["done"]
    (script,) = (sweep / ".submitit").glob("*/*_submission.sh")
    assert "#SBATCH --ntasks-per-node=2" in script.read_text() and "gres" not in script.read_text()
    local = trained(tmp_path_factory, "fsdp-two-short", "trainer=fsdp_cpu", "trainer.devices=2", *SHORT)
    ours, theirs = (json.loads((d / "metrics.json").read_text()) for d in (local, sweep / "0"))
    keys = [k for k in ours if k.startswith(("train/", "val/", "test/")) and "per_sec" not in k]
    assert {k: theirs[k] for k in keys} == pytest.approx({k: ours[k] for k in keys}, rel=1e-6, abs=1e-6)


def test_a_job_slurm_can_never_start_is_named_and_the_sweep_exits_2(cluster, tmp_path):
    # 3 loader workers + 1: 4 CPUs a task, 8 for the job, on a node of 2
    r = run_cli("train", *SWEEP, "data=fake", "data.num_workers=3", "optim.lr=1e-3,3e-4", *SHORT, cwd=tmp_path)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: Slurm can never start job ") and "(PartitionConfig: " in line, r.stderr[-2000:]
    assert "hydra.launcher.cpus_per_task=4" in line
    job = line.split("job ")[1].split(" ")[0].split("_")[0]
    time.sleep(1)
    assert _squeue(job) in ("", "CANCELLED")  # cancelled, not left pending


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["hydra.launcher.mem_gb=64"], "Memory specification can not be satisfied"),
        (["trainer=gpu"], "Invalid generic resource (gres) specification"),  # no GPUs in this cluster
    ],
)
def test_sbatch_refusals_are_one_line(cluster, tmp_path, overrides, said):
    r = run_cli("train", "-m", "hydra/launcher=slurm", *overrides, "optim.lr=1e-3,3e-4", *SHORT, cwd=tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: sbatch refused the job: ") and said in line, r.stderr


class _Sweep(threading.Thread):
    """`python -m vitlab.train args` in tmp_path, as run_cli runs every command here (forked from the fork server,
    which has the libraries imported: the sweep submits its jobs at once, not after a new interpreter's ~10 s of
    imports), in a thread while the test acts on its jobs; the test callbacks on its command line are found on
    PYTHONPATH (the jobs inherit it). `result()` waits for its CompletedProcess."""

    def __init__(self, tmp_path: Path, *args: str, timeout: int):
        super().__init__(daemon=True)  # (a test that fails while waiting leaves it to the session's end)
        self.command, self.outcome = (args, tmp_path, timeout), None
        self.start()

    def run(self):
        args, cwd, timeout = self.command
        try:
            self.outcome = run_cli("train", *args, cwd=cwd, env=TESTS_ON_PATH, timeout=timeout)
        except BaseException as error:  # raised again by result()
            self.outcome = error

    def result(self) -> subprocess.CompletedProcess:
        self.join()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_a_job_cancelled_without_a_result_is_one_line(cluster, tmp_path):
    slow = extra_callback("slow", "SleepPerStep", seconds=0.2)
    one = replaced(SWEEP, "trainer.devices=1")  # (a job of one task: what is said does not depend on how many)
    sweep = _Sweep(tmp_path, *one, "optim.lr=1e-3", *replaced(SHORT, "trainer.max_epochs=20"), *slow, timeout=600)
    log = lambda: _sweep_dir(tmp_path) / "0" / "train.log"  # noqa: E731
    _wait(
        lambda: (tmp_path / "outputs").exists() and log().exists() and "- epoch 1/20 " in log().read_text(),
        "an epoch",
        sweep,
    )
    (job,) = [p.name for p in (_sweep_dir(tmp_path) / ".submitit").iterdir() if p.is_dir()]
    subprocess.run(["scancel", job], check=True)
    r = sweep.result()
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"error: Slurm job {job} ended without a result (") and "its log: " in line, r.stderr[-2000:]


def _wait(condition, what: str, sweep: _Sweep | None = None, timeout: float = 300):
    """Until `condition()`; an AssertionError past `timeout` seconds, or at once if the `sweep` waited on has ended."""
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return
        if sweep is not None and not sweep.is_alive():
            r = sweep.result()
            raise AssertionError(f"the sweep ended (exit {r.returncode}) before {what}: {r.stderr[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _requeued(job: str) -> None:
    """Wait for the job to be back in the queue and let it start at once: Slurm holds a requeued job a while, and
    sets that hold as the requeue completes, so the release is repeated until the job runs. Not within the second of
    the requeue: slurmd refuses a start whose credential is no newer (in whole seconds) than the one it revoked as the
    job was requeued ("Killing non-startable batch job: Job credential revoked", and the job ends FAILED)."""
    _wait(lambda: _squeue(job) == "PENDING", f"job {job} to be requeued")
    time.sleep(2)

    def started() -> bool:
        if _squeue(job) != "PENDING":
            return True
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        time.sleep(1.5)
        return False

    _wait(started, f"job {job} to start again")


def test_a_requeued_or_timed_out_job_resumes_by_itself_and_equals_the_uninterrupted_run(cluster, tmp_path):
    run = ["optim.lr=1e-3", "trainer.max_epochs=8", *SHORT[1:], *extra_callback("slow", "SleepPerStep", seconds=0.1)]
    run += ["logger=wandb", "logger.wandb.offline=true"]  # one W&B run over the requeues (issue 42)
    sweep = _Sweep(tmp_path, *SWEEP, *run, timeout=900)
    _wait(lambda: (tmp_path / "outputs").exists(), "the sweep directory", sweep)
    log = _sweep_dir(tmp_path) / "0" / "train.log"
    logged = lambda epoch: log.exists() and f"[INFO] - epoch {epoch}/8 " in log.read_text()  # noqa: E731
    _wait(lambda: logged(2), "two epochs", sweep)
    (job,) = [p.name for p in (_sweep_dir(tmp_path) / ".submitit").iterdir() if p.is_dir()]  # one job: no array
    # What Slurm sends signal_delay_s before the time limit: the run checkpoints, submitit requeues the job.
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    _requeued(job)
    _wait(lambda: logged(4), "the resumed run's fourth epoch", sweep)
    subprocess.run(["scontrol", "requeue", job], check=True)  # how a cluster pre-empts a job
    _requeued(job)
    r = sweep.result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    text = log.read_text()
    assert text.count("holds a checkpoint of an earlier start") == 2, text[-3000:]
    assert text.count("[vitlab.training.callbacks.standard][INFO] - epoch 1/8") == 1  # trained from the start once only
    assert text.count("[vitlab.training.callbacks.standard][INFO] - epoch 8/8") == 1
    runs = sorted((_sweep_dir(tmp_path) / "0" / "wandb").glob("offline-run-*"))  # one per start, named by time
    assert len(runs) == 3 and len({run.name.rsplit("-", 1)[1] for run in runs}) == 1
    # No step twice. (Slurm's requeue signals W&B's own process too: what that start had not written is lost, which
    # may be all of it; the run's last checkpoint, and the next start, are not.)
    steps = [s for s in map(wandb_steps, runs) if s]
    assert len(steps) >= 2 and all(max(a) < min(b) for a, b in zip(steps, steps[1:], strict=False)), steps
    local = tmp_path / "local"
    r = run_cli("train", "trainer=ddp_cpu", "trainer.devices=2", *run, f"hydra.run.dir={local}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(local, _sweep_dir(tmp_path) / "0")

    # Issue 78: the job's last stop resumed by a job of one task instead of two (a requeue that came back on fewer
    # nodes), as typed: it goes on as the two processes' run did.
    stopped = _sweep_dir(tmp_path) / "0" / "checkpoints" / "interrupted.ckpt"
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    r = _Sweep(fewer, *replaced(SWEEP, "trainer.devices=1"), *run, f"ckpt_path={stopped}", timeout=900).result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "written by 2 processes, resumed on 1: exact" in (_sweep_dir(fewer) / "0" / "train.log").read_text()
    assert_close_run(local, _sweep_dir(fewer) / "0")


def test_an_optuna_search_on_slurm_with_two_processes_a_trial_prunes_and_goes_on_as_typed(cluster, tmp_path):
    """Issue 42 under the Slurm launcher, DDP on two processes a job: each trial reports to the study in the sweep
    directory from its Slurm job (rank 0; the pruner's decision reaches both ranks); the same command with more
    trials goes on with the study, and the trials that ended do not run again."""
    sweep = tmp_path / "sweep"
    pruner = ["hydra.sweeper.pruner=median", "hydra.sweeper.pruner_args={n_startup_trials: 1}"]
    search = ["hparams_search=digits_optuna", "optim.lr=choice(0.001,10)", *pruner, "logger=wandb",
              "logger.wandb.offline=true", f"hydra.sweep.dir={sweep}", *SHORT]  # fmt: skip
    r = run_cli("train", *SWEEP, *search, "hydra.sweeper.n_trials=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ended = {n: (sweep / str(n) / "metrics.json").read_bytes() for n in range(3)}
    r = run_cli("train", *SWEEP, *search, "hydra.sweeper.n_trials=4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "3 of 4 trials ended in an earlier run, 0 to run again (interrupted), 1 new" in r.stderr + r.stdout
    assert {n: (sweep / str(n) / "metrics.json").read_bytes() for n in range(3)} == ended
    study = optuna.load_study(study_name="digits", storage=f"sqlite:///{sweep}/optuna.db")
    trials = study.get_trials()
    assert len(trials) == 4 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    late = [t for t in trials if t.number >= 2 and t.params["optim.lr"] == 10]  # (trial 2, as the seed draws)
    assert late and all(t.state.name == "PRUNED" for t in late)  # at chance after epoch 1: below the median
    for t in trials:
        metrics = json.loads((sweep / str(t.number) / "metrics.json").read_text())
        epochs = metrics["pruned"]["epoch"] if t.state.name == "PRUNED" else 2
        assert sorted(t.intermediate_values) == list(range(epochs))  # rank 0 reported each validation, once
        assert len(list((sweep / str(t.number) / "wandb").glob("offline-run-*"))) == 1
        assert (sweep / str(t.number) / "train_rank1.log").is_file()  # two processes a job
