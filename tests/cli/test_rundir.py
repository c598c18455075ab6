"""Which process of a launch this is and where it writes: one run directory for every process, whoever started
them (Lightning's DDP launcher, torchrun on one or two nodes, Slurm's srun), and one-line refusals where the
processes could not agree on one."""

import pytest

from tests.helpers.commands import run_cli
from vitlab.cli import overrides, ranks, rundir, startup
from vitlab.utils.errors import UserError

SHORT = ["trainer.max_epochs=2", "data.batch_size=128", "progress_bar=none", "trainer.deterministic=true"]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, 0),
        ({"LOCAL_RANK": "1"}, 1),  # Lightning's DDP child
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, 1),  # Lightning's process on a second node
        ({"RANK": "0", "LOCAL_RANK": "0"}, 0),  # torchrun, rank 0
        ({"RANK": "1", "LOCAL_RANK": "0", "GROUP_RANK": "1"}, 1),  # torchrun, second node: LOCAL_RANK 0, RANK 1
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, 1),  # task 1 of two that srun started
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, 0),
        ({"SLURM_PROCID": "0"}, 0),  # a batch script's own process
    ],
)
def test_process_rank_is_read_from_every_launcher(monkeypatch, env, rank):
    for key in LAUNCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ranks.process_rank() == rank


def test_a_secondary_process_joins_the_given_run_directory_without_claiming_it(monkeypatch, tmp_path):
    for key in LAUNCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    run_dir = tmp_path / "rank0"
    argv = startup.prepare("train", ["trainer=ddp_cpu", f"hydra.run.dir={run_dir}"])
    assert argv == [
        "trainer=ddp_cpu",
        f"hydra.run.dir={run_dir}",
        "hydra.job.name=train_rank1",
        "hydra.output_subdir=null",
    ]
    assert not run_dir.exists()  # rank 0 claims it; a secondary never refuses it for holding files
    # Lightning's children come with all three already: the run directory kept, the log named by rank as the README
    # says (Lightning's train_ddp_process_1.log was the name before issue 41)
    given = ["hydra.run.dir=/r", "hydra.job.name=train_ddp_process_1", "hydra.output_subdir=null"]
    assert startup.prepare("train", given) == [
        "hydra.run.dir=/r",
        "hydra.output_subdir=null",
        "hydra.job.name=train_rank1",
    ]


def test_a_run_directory_from_torchrun_keeps_any_character_through_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for odd in ("/data/it's (a, b) [c] {d}=e \\f", "/x\\'y\\", "/plain"):
        (override,) = OverridesParser.create().parse_overrides([f"hydra.run.dir={startup._hydra_quoted(odd)}"])
        assert override.value() == odd


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("/data/phötos", "/data/phötos"),
        ("[/tmp/phötos/x.jpg]", ["/tmp/phötos/x.jpg"]),
        ("[a.jpg, /tmp/ö.jpg]", ["a.jpg", "/tmp/ö.jpg"]),  # (issue 41: the list quoted whole was one file name)
    ],
)
def test_the_quoting_advice_for_a_non_ascii_value_parses_to_what_was_meant(typed, meant):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([f"images={overrides.quoted_for_hydra(typed)}"])
    assert override.value() == meant


@pytest.mark.parametrize("procid", ["0", "1"])
def test_srun_tasks_without_a_shared_run_directory_are_refused_in_one_line(tmp_path, procid):
    env = {"SLURM_PROCID": procid, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}
    r = run_cli("train", "trainer=ddp_cpu", *SHORT, cwd=tmp_path, env=env)
    assert r.returncode == 2
    assert r.stderr.startswith("error: this is process") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "give them all the same hydra.run.dir" in r.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_directory_holding_only_the_other_processes_logs_is_claimed_and_anything_else_refused(tmp_path):
    """torchrun and srun start every process with the same hydra.run.dir: another rank's log may be there before
    rank 0 claims the directory (issue 53). That is this launch's, not an earlier run's; any other file is."""
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "train_rank1.log").write_text("rank 1 started\n")
    (ours / "eval_rank12.log").write_text("")
    rundir.claim_run_dir(ours)
    assert (ours / rundir.CLAIM_FILE).is_file()
    for name in ("train.log", "train_rank0.log", "config.yaml", "notes_rank1.txt"):
        earlier = tmp_path / name.replace(".", "_")
        earlier.mkdir()
        (earlier / "train_rank1.log").write_text("")
        (earlier / name).write_text("")
        with pytest.raises(UserError, match="already holds files; vitlab never reuses a run directory"):
            rundir.claim_run_dir(earlier)
        assert not (earlier / rundir.CLAIM_FILE).exists()
