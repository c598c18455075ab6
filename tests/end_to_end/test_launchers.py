"""Launchers as users start them: torchrun on two nodes gives one run directory, submitit_local refuses several
devices."""

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import assert_same_run, run_cli

SHORT = ["trainer.max_epochs=2", "data.batch_size=128", "progress_bar=none", "trainer.deterministic=true"]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp_cpu", "fsdp_cpu"])
def test_torchrun_on_two_nodes_gives_one_run_directory_and_the_metrics_of_one_node(tmp_path, strategy):
    """FSDP's mesh follows the launch: data-parallel over nodes x devices, the shards as on one node of two."""
    # The same threads per process in both (torchrun sets none for one process a node, Lightning one for two).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"),
                *("--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"),
                *("-m", "vitlab.train", f"trainer={strategy}", "trainer.devices=1", "trainer.num_nodes=2", *SHORT),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    (run_dir,) = (tmp_path / "outputs" / "train" / "runs").iterdir()  # one, not one per node
    assert (run_dir / "train_rank1.log").is_file() and not (run_dir / ".hydra" / "train_rank1.log").exists()

    one_node = tmp_path / "one_node"
    r = run_cli("train", f"trainer={strategy}", "trainer.devices=2", *SHORT, f"hydra.run.dir={one_node}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(one_node, run_dir)


def test_submitit_local_with_several_devices_is_refused_in_one_line(tmp_path):
    r = run_cli(
        "train", "-m", "hydra/launcher=submitit_local", "trainer=ddp_cpu", "optim.lr=1e-3", *SHORT, cwd=tmp_path
    )
    assert r.returncode == 2
    (line,) = [line for line in r.stderr.splitlines() if line.strip()]
    assert line.startswith("error: 1 of 1 sweep jobs failed (job 0: -m sweeps run each job as one process")
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))
