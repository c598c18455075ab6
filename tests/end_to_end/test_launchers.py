"""Launchers as users start them: torchrun on two nodes gives one run directory, submitit_local refuses several
devices."""

import concurrent.futures
import json
import shlex
import socket
from pathlib import Path

import pytest

from tests.helpers.commands import python_m, run_cli
from tests.helpers.runs import assert_same_run, trained

REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.max_epochs=2", "data.batch_size=128", "progress_bar=none", "trainer.deterministic=true"]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp_cpu", "fsdp_cpu"])
def test_torchrun_on_two_nodes_gives_one_run_directory_and_the_metrics_of_one_node(
    tmp_path, tmp_path_factory, strategy
):
    """FSDP's mesh follows the launch: data-parallel over nodes x devices, the shards as on one node of two."""
    # The same threads per process in both (torchrun sets none for one process a node, Lightning one for two).
    port = _free_port()

    def node(rank: int):
        return python_m(
            "torch.distributed.run",
            *("--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=127.0.0.1"),
            *(f"--master-port={port}", "-m", "vitlab.train", f"trainer={strategy}", "trainer.devices=1"),
            *("trainer.num_nodes=2", *SHORT),
            cwd=tmp_path, env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two nodes side by side, as two hosts start them
        nodes = list(pool.map(node, (0, 1)))
    assert [r.returncode for r in nodes] == [0, 0], "".join(r.stdout[-1500:] + r.stderr[-1500:] for r in nodes)
    (run_dir,) = (tmp_path / "outputs" / "train" / "runs").iterdir()  # one, not one per node
    assert (run_dir / "train_rank1.log").is_file() and not (run_dir / ".hydra" / "train_rank1.log").exists()

    # The same run on one node of two processes, trained once (test_slurm.py compares its jobs with it too), in the
    # suite's environment: one thread a process (tests/conftest.py) and PYTHONUNBUFFERED (run_cli), as `env` has.
    one_node = trained(tmp_path_factory, f"{strategy.removesuffix('_cpu')}-two-short", f"trainer={strategy}",
                       "trainer.devices=2", *SHORT)  # fmt: skip
    assert_same_run(one_node, run_dir)


def test_submitit_local_with_several_devices_is_refused_in_one_line(tmp_path):
    r = run_cli(
        "train", "-m", "hydra/launcher=submitit_local", "trainer=ddp_cpu", "optim.lr=1e-3", *SHORT, cwd=tmp_path
    )
    assert r.returncode == 2
    (line,) = [line for line in r.stderr.splitlines() if line.strip()]
    assert line.startswith("error: 1 of 1 sweep jobs failed (job 0: -m sweeps run each job as one process")
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))


def test_torchrun_with_a_run_directory_trains_one_run_in_it(tmp_path):
    """The README's advice for several processes, with torchrun: every process is given the same hydra.run.dir, and
    rank 1 may write its log there before rank 0 claims it (issue 53: "already holds files", exit 1)."""
    run_dir = tmp_path / "runs" / "a"
    r = python_m(
        "torch.distributed.run",
        *("--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_free_port()}"),
        *("-m", "vitlab.train", "trainer=ddp_cpu", "trainer.devices=2", *SHORT, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (run_dir / "train_rank1.log").is_file() and json.loads((run_dir / "metrics.json").read_text())["test/acc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing beside it


def test_torchrun_stopped_by_the_group_s_sigterm_saves_once_and_its_resume_line_is_torchrun_s(tmp_path):
    """SIGTERM to torchrun's process group (a scheduler, a terminal): the workers get it, and again from torchrun's
    agent, which forwards it (issue 53: one stop, not a second); the checkpoint is saved, and the resume line starts
    the run as it was started, with torchrun, and trains on from it."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    kill = [
        "+callbacks.kill._target_=tests.helpers.callbacks.SignalAtStep",
        "+callbacks.kill.step=6",
        "+callbacks.kill.group=true",
    ]
    run_dir = tmp_path / "runs" / "a"
    train = ["-m", "vitlab.train", "trainer=ddp_cpu", "trainer.devices=2", *SHORT, *kill, f"hydra.run.dir={run_dir}"]
    torchrun = ["--standalone", "--nproc-per-node=2"]
    r = python_m("torch.distributed.run", *torchrun, *train, cwd=tmp_path, env=env, own_group=True)
    saved = run_dir / "checkpoints" / "interrupted.ckpt"
    assert saved.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("interrupted by SIGTERM")]
    command = line.split("resume with: ")[1]
    assert command.startswith("torchrun --standalone --nproc-per-node=2 -m vitlab.train trainer=ddp_cpu")
    assert command.endswith(f"ckpt_path={saved}")
    again = python_m("torch.distributed.run", *torchrun, *shlex.split(command)[3:], cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
