"""Issue 34's catalog, train's launch as a user types it: Lightning Trainer values that pass its constructor and
crash later, processes started before the config is checked, sweeps that must always end with their table, and a
Slurm launcher on a machine without Slurm's tools. Each bad input is one line and exit 2 with nothing left behind;
a sweep lists every job with its right status and names the failed ones; a bug still shows its traceback."""

import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers.commands import assert_refused, run_cli
from tests.helpers.images import image_tree
from tests.helpers.runs import earlier_run


@pytest.mark.parametrize(
    "override, said",
    [
        # Lightning's Trainer takes these, then divides by them once the run directory and processes exist
        ("trainer.accumulate_grad_batches=0", "error: trainer.accumulate_grad_batches 0 must be an integer >= 1"),
        ("trainer.log_every_n_steps=0", "error: trainer.log_every_n_steps 0 must be an integer >= 1 or null"),
        ("trainer.check_val_every_n_epoch=0", "error: trainer.check_val_every_n_epoch 0 must be an integer >= 1 or"),
        ("trainer.limit_train_batches=1.5", "error: trainer.limit_train_batches 1.5 must be an integer >= 0 or a "),
        ("trainer.gradient_clip_val=-1", "error: trainer.gradient_clip_val -1 must be a number >= 0 or null"),
    ],
)
def test_trainer_values_are_held_to_lightnings_ranges_before_the_run_directory(tmp_path, override, said):
    before = earlier_run(tmp_path)
    assert_refused(run_cli("train", override, cwd=tmp_path), said, before, tmp_path / "outputs")


def test_the_data_is_checked_in_the_launching_process_before_any_other_starts(tmp_path):
    """The recipe asks for 4 devices; trainer=cpu makes them 4 CPU processes. Two class folders where it expects 1000
    are said once, by the launching process, not by each of four after a minute."""
    image_tree(tmp_path / "photos")
    before = earlier_run(tmp_path)
    r = run_cli("train", "experiment=deit_s16_in1k", "data=imagefolder", "data.data_dir=photos", "trainer=cpu",
                cwd=tmp_path)  # fmt: skip
    said = "error: data.num_classes 1000 does not match the 2 class folders in photos/train"
    assert_refused(r, said, before, tmp_path / "outputs")


def test_a_run_the_machine_cannot_hold_is_refused_before_it_starts(tmp_path):
    """ViT-B/16 at 4,096 images a step needs ~450 GB per process (the start line's estimate): refused in one line
    naming the estimate, the memory there is and the keys that bring it down, not trained until the machine swaps
    (issue 41). (`memory_check=false` starts it anyway: tests/training/devices/test_memory.py.)"""
    before = earlier_run(tmp_path)
    r = run_cli("train", "model=vit_b16", "data.batch_size=4096", cwd=tmp_path)
    said = "error: the run needs about 4"
    assert_refused(r, said, before, tmp_path / "outputs")
    assert re.search(
        r"GB per process \(activations 4\d\d\.\d GB for 4096 images, one process\), more than this host's \d+\.\d GB: "
        r"bring it down with data.batch_size, model.grad_checkpointing=true, trainer=fsdp \(over several devices\), "
        r"trainer.precision=bf16-mixed; or start anyway with memory_check=false$",
        r.stderr.strip(),
    ), r.stderr


def test_the_start_line_names_cpu_processes_and_their_strategy(tmp_path):
    r = run_cli("train", "trainer=cpu", "trainer.devices=2", "train=false", "test=false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trainer: CPU, 2 processes (ddp), precision 32-true (auto: no GPU in use)" in r.stdout


def _summary(sweep: Path) -> list[dict]:
    return json.loads((sweep / "summary.json").read_text())


def test_a_sweep_ends_with_its_table_the_right_statuses_and_the_failed_jobs_named(tmp_path):
    """A bad value in one job: that job failed (one line), the others ran; two 2-step jobs that logged no
    val/acc_best are done, as a single run is (a warning); the table, then exit 2 naming the job."""
    sweep = tmp_path / "sweep"
    r = run_cli("train", "-m", "trainer.log_every_n_steps=5,0,10", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "sweep summary" in r.stdout
    assert r.stderr.strip().splitlines() == [
        "error: sweep job 1: trainer.log_every_n_steps 0 must be an integer >= 1 or null",
        "error: 1 of 3 sweep jobs failed (job 1: trainer.log_every_n_steps 0 must be an integer >= 1 or null); "
        f"every job is listed in {sweep / 'summary.json'}",
    ]
    rows = _summary(sweep)
    assert [row["status"] for row in rows] == ["done", "failed", "done"]
    assert rows[0]["val/acc_best"] is None and rows[0]["test/acc"] is not None


def test_a_sweep_job_that_fails_on_a_bug_keeps_its_traceback_and_the_sweep_its_table(tmp_path):
    sweep = tmp_path / "sweep"
    bug = "+callbacks.bug._target_=tests.helpers.callbacks.BugInForward"
    r = run_cli("train", "-m", "debug=fdr", bug, "optim.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 1  # our code's failure, not the user's input
    assert r.stderr.count("Traceback") == 2 and "sweep summary" in r.stdout
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("error: 2 of 2 sweep jobs failed (jobs 0, 1; job 0: ValueError: planted bug in forward)")
    )
    assert [row["status"] for row in _summary(sweep)] == ["failed", "failed"]


def _path_with(tmp_path: Path, tools: dict[str, str]) -> dict:
    """PATH holding only `tools` (name -> shell script): a machine without Slurm, or with a broken one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": str(bin_dir)}


def test_the_slurm_launcher_without_slurm_is_one_line_and_no_sweep_directory(tmp_path):
    before = earlier_run(tmp_path)
    r = run_cli("train", "-m", "hydra/launcher=slurm", "optim.lr=1e-3,3e-4", cwd=tmp_path, env=_path_with(tmp_path, {}))
    said = (
        "error: hydra/launcher=slurm needs Slurm's sbatch and srun on this machine and PATH has neither: run the "
        "sweep on the cluster's login node, or leave hydra/launcher=slurm out"
    )
    assert_refused(r, said, before, tmp_path / "outputs")


def test_a_refused_submission_leaves_no_orphan_sweep_directory(tmp_path):
    refuse = "echo 'sbatch: error: Batch job submission failed: Unable to contact slurm controller' >&2; exit 1"
    env = _path_with(tmp_path, {"sbatch": refuse, "srun": "exit 0"})
    before = earlier_run(tmp_path)
    r = run_cli("train", "-m", "hydra/launcher=slurm", "optim.lr=1e-3,3e-4", cwd=tmp_path, env=env)
    said = "error: sbatch refused the job: Batch job submission failed: Unable to contact slurm controller"
    assert_refused(r, said, before, tmp_path / "outputs")
    assert os.listdir(tmp_path / "outputs") == ["train"]  # no debug/ or multiruns/ folder either


def test_a_misspelt_key_in_a_sweep_is_one_line_before_any_job(tmp_path):
    """Every job would refuse it alike: said once, as a single run says it (Hydra's own report is 7 lines, exit 1)."""
    before = earlier_run(tmp_path)
    r = run_cli("train", "-m", "model.depht=3,4", "optim.lr=1e-3,3e-4", cwd=tmp_path)
    assert_refused(r, "error: model.depht is not a key of model; its keys: ['act_layer',", before, tmp_path / "outputs")
