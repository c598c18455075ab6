"""vitlab's Slurm launcher (`hydra/launcher=slurm`, conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's,
which submits one Slurm job per sweep point (one task per device, on trainer.num_nodes nodes), and says what
happens to them:

- sbatch's refusal of a request is one line (exit 2), not submitit's traceback;
- while the sweep waits, a line whenever a job's state changes (pending and why, running, requeued, done);
- a job that Slurm can never start (its request exceeds what the partition has or allows) is named in one line,
  the sweep's jobs are cancelled and the sweep exits 2, rather than waiting forever;
- a job that ends without a result (cancelled, killed) is named in one line with its log;
- a sweep run again into its directory submits no job for those that ended in an earlier run (their results are
  read here, as each job would read them: cli/sweep.py earlier_result).

A job that is pre-empted, requeued (`scontrol requeue`) or reaches its time limit (Slurm sends USR2
`signal_delay_s` before it) checkpoints (vitlab.utils.signals), comes back, and resumes from its own checkpoint: its
run directory is the same, and `vitlab.train` resumes a directory that already holds one. On its time-limit
signal submitit requeues the job (up to `max_num_timeout` times); Slurm itself requeues a pre-empted one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shutil
import subprocess
import time
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf, open_dict

from vitlab.cli.rundir import discard_unused_sweep
from vitlab.cli.sweep import JOB_FILE, ended_metrics, not_run_again, optimized_value
from vitlab.utils.errors import fail

log = logging.getLogger(__name__)

# Pending reasons that only a different request can clear (Slurm's squeue(1) "JOB REASON CODES").
NEVER = {
    "PartitionConfig": "it asks for more CPUs, memory or GPUs per node than the partition's nodes have",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit (hydra.launcher.timeout_min) exceeds the partition's",
    "BadConstraints": "no node satisfies its constraints",
    "InvalidAccount": "its account is not valid",
    "InvalidQOS": "its QOS is not valid",
}
PER_JOB_LIMIT = re.compile(r"(QOS|Assoc)Max\w*PerJob\w*")  # a request over a per-job limit of the QOS/association
POLL_S = 5.0  # squeue, for the jobs' states and pending reasons (Slurm's controller answers it)
CHECK_S = 1.0  # the jobs' result files (a file's existence: an ended job is noticed within a second)
# Slurm states in which a job that has written no result never will (its result file is not waited for).
NO_RESULT = ("CANCELLED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT")


class SlurmLauncher(SubmititSlurmLauncher):
    def setup(self, **kwargs) -> None:
        """Before the sweep makes its directory: Slurm's tools must be here (submitit needs srun, sbatch submits)."""
        missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
        if missing:
            fail(
                f"hydra/launcher=slurm needs Slurm's {' and '.join(missing)} on this machine and PATH has "
                f"{'neither' if len(missing) > 1 else 'no ' + missing[0]}: run the sweep on the cluster's login node, "
                "or leave hydra/launcher=slurm out to run its jobs here one after another"
            )
        super().setup(**kwargs)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        tasks = self.params.get("tasks_per_node")
        if not isinstance(tasks, int) or tasks < 1:
            fail(f"hydra/launcher=slurm starts one task per device: trainer.devices must be a number, not {tasks!r}")
        executor = self._executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params, ended = [], {}
        again = next(sweep_dir.rglob(JOB_FILE), None) is not None  # (a new sweep: no job's config composed here)
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            if again and (earlier := self._ended(list(overrides), idx)) is not None:
                ended[idx] = earlier
                continue
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = self._submit(executor, params) if params else []
        if jobs:
            folder = Path(str(self.params["submitit_folder"])).parent
            log.info("Slurm jobs %s submitted; their logs: %s", ", ".join(j.job_id for j in jobs), folder)
            self._wait(jobs)
        results = iter([self._result(job) for job in jobs])
        numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
        return [ended[i] if i in ended else next(results) for i in numbers]

    def _ended(self, overrides: list[str], idx: int) -> JobReturn | None:
        """Job `idx` of a sweep run again into its directory, where it ended in an earlier run: not submitted (a Slurm
        job would wait its turn in the queue only to say so), its result read here as the job reads it
        (cli/sweep.py: earlier_result), and said here and in the job's log."""
        from hydra.core.utils import JobStatus

        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = idx
        out = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        metrics = ended_metrics(out, sorted(config.hydra.overrides.task))
        if metrics is None:
            return None
        said = logging.FileHandler(out / f"{config.hydra.job.name}.log")  # (as the job's own logging writes it)
        shown = OmegaConf.select(config, "hydra.job_logging.formatters.simple.format", default=None)
        said.setFormatter(logging.Formatter(shown or "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        logging.getLogger("vitlab.train").addHandler(said)
        try:
            logging.getLogger("vitlab.train").info(not_run_again(out, metrics))
        finally:
            logging.getLogger("vitlab.train").removeHandler(said)
            said.close()
        task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        done = JobReturn(overrides=overrides, cfg=task, hydra_cfg=config, working_dir=str(out),
                         task_name=str(config.hydra.job.name), status=JobStatus.COMPLETED)  # fmt: skip
        done.return_value = optimized_value(config.get("optimized_metric"), metrics)
        return done

    def _executor(self):
        """submitit's executor with this launcher's parameters (as hydra-submitit-launcher builds it)."""
        import submitit

        init_keys = {"submitit_folder", "max_num_timeout"}
        executor = submitit.AutoExecutor(
            cluster="slurm",
            folder=self.params["submitit_folder"],
            slurm_max_num_timeout=self.params.get("max_num_timeout", 0),
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"slurm_{k}": v for k, v in self.params.items() if k not in init_keys}
        )
        return executor

    def _submit(self, executor, params: list) -> list:
        from submitit.core.utils import FailedJobError

        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # submitit prints sbatch's complaint before raising it
                return executor.map_array(self, *zip(*params, strict=True))
        except FailedJobError as e:
            reasons = [line.split("error:", 1)[-1].strip() for line in str(e).splitlines() if "error:" in line]
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            discard_unused_sweep(sweep_dir, OmegaConf.select(self.config, "paths.log_dir", default=None))
            fail(f"sbatch refused the job: {'; '.join(reasons) or str(e).strip()} ({self._request()})")
        raise AssertionError  # fail() has exited

    def _request(self) -> str:
        p = self.params
        shown = ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "mem_gb", "timeout_min", "partition")
        return "asked for " + ", ".join(f"hydra.launcher.{k}={p.get(k)}" for k in shown if p.get(k) is not None)

    def _wait(self, jobs: list) -> None:
        """Until every job is done: a line when a job's state changes; a job Slurm can never start stops the sweep.
        The result files are looked for every CHECK_S, the queue asked every POLL_S; a job that has left the queue
        without a result (cancelled, failed) is asked after at once (submitit's own check of a job's state comes
        less often the longer the job has run: up to ten minutes apart)."""
        seen: dict[str, str] = {}
        asked = 0.0
        while not all(job.done() for job in jobs):
            if time.monotonic() - asked < POLL_S:
                time.sleep(CHECK_S)
                continue
            asked = time.monotonic()
            queued = _queue([job.job_id for job in jobs])
            for job in jobs:
                if job.job_id not in queued:  # ended: done() at once, with or without a result
                    job.done(force_check=True)
            for job_id, (state, reason) in queued.items():
                if reason in NEVER or PER_JOB_LIMIT.fullmatch(reason):
                    subprocess.run(["scancel", *(job.job_id for job in jobs)], capture_output=True, timeout=60)
                    why = NEVER.get(reason, "it exceeds a per-job limit of its QOS or account")
                    fail(
                        f"Slurm can never start job {job_id} ({reason}: {why}; {self._request()}): the sweep's jobs "
                        "are cancelled; ask for less with hydra.launcher.<key>=... or in conf/local/default.yaml"
                    )
                shown = f"{state} ({reason})" if reason and reason != "None" else state
                if seen.get(job_id) != shown:
                    log.info("Slurm job %s: %s", job_id, shown)
                    seen[job_id] = shown

    def _result(self, job) -> JobReturn:
        from submitit.core.utils import UncompletedJobError

        try:
            if not job.paths.result_pickle.exists() and job.state.upper().startswith(NO_RESULT):
                raise UncompletedJobError(job.state)  # (submitit waits 15 s for a result file that will not come)
            return job.results()[0]
        except UncompletedJobError:
            fail(f"Slurm job {job.job_id} ended without a result ({job.state}); its log: {job.paths.stderr}")
            raise  # fail() has exited


def _queue(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job: (state, pending reason)} of the jobs still in Slurm's queue."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(job_ids)], capture_output=True, text=True, timeout=60
    ).stdout
    return {line.split("|")[0]: tuple(line.split("|")[1:3]) for line in out.splitlines() if line.count("|") == 2}
