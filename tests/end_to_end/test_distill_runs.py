"""objective=distill objective.kind=tokens data.labels=false as typed (issue 76's acceptance command): stopped by
SIGTERM mid-epoch and resumed as the printed command says, it ends as the uninterrupted run (the student, its heads,
every logged value; the teacher loaded again from its checkpoint), in one process and in two (DDP); under FSDP2 the
teacher and heads are sharded as the student is and the run is the DDP one."""

import json
from pathlib import Path

import lightning as L

from tests.helpers.commands import replaced, run_cli
from tests.helpers.configs import RESUMABLE, extra_callback
from tests.helpers.runs import (
    assert_close_run,
    assert_resumes_exactly,
    assert_same_run,
    digits_checkpoint,
    interrupt,
    resume,
    trained,
)
from vitlab.convert.weights import read_checkpoint


def _tokens(teacher) -> list[str]:
    return [
        "objective=distill",
        "objective.kind=tokens",
        f"objective.teacher={teacher}",
        "data.labels=false",
        "callbacks.model_checkpoint.monitor=val/loss_ema",  # (callbacks=ema's val/acc_ema: no accuracy here)
        "callbacks.model_checkpoint.mode=min",
    ]


def test_a_label_free_token_distillation_resumes_exactly(tmp_path, tmp_path_factory):
    teacher = digits_checkpoint(tmp_path_factory)
    assert_resumes_exactly([*replaced(RESUMABLE, "trainer.max_epochs=2"), *_tokens(teacher)], tmp_path, "SIGTERM", 13)


def _two_processes(tmp_path_factory) -> tuple[list[str], Path]:
    """The label-free token distillation's arguments on two DDP processes, and its run (trained once)."""
    args = [*RESUMABLE, *_tokens(digits_checkpoint(tmp_path_factory)), "trainer=ddp_cpu", "trainer.devices=2"]
    return args, trained(tmp_path_factory, "distill-tokens-ddp", *args)


def test_a_label_free_token_distillation_on_two_processes_resumes_exactly(tmp_path, tmp_path_factory):
    """DDP, each process loading the teacher: the ranks agree to stop within two of their 8-step intervals
    (utils/signals.py), hence 27 steps, for the resumed run to go on after the stop."""
    args, full = _two_processes(tmp_path_factory)
    assert_same_run(full, resume(interrupt(args, tmp_path, "SIGTERM", 4), tmp_path))


class TeacherShards(L.Callback):
    """Writes, as training ends, the shape this process holds of each of the first teacher's parameters
    (teacher<rank>.json)."""

    def on_train_end(self, trainer, pl_module):
        teacher = pl_module.objective.networks_beside()[0]
        local = {n: list(getattr(p, "_local_tensor", p).shape) for n, p in teacher.named_parameters()}
        (Path(trainer.default_root_dir) / f"teacher{trainer.global_rank}.json").write_text(json.dumps(local))


def test_under_fsdp2_the_teacher_and_heads_are_sharded_and_the_run_is_the_ddp_one(tmp_path, tmp_path_factory):
    """trainer=fsdp_cpu (issue 76, point 4): the teacher split as the student is (each process holds half of each of
    its block tensors, gathered a block at a time for its forward), the projection heads too; every logged value
    within 1e-5 of the DDP run, the student and its heads within 1e-4."""
    args, ddp = _two_processes(tmp_path_factory)
    shards = extra_callback("teacher", "tests.end_to_end.test_distill_runs.TeacherShards")
    fsdp = tmp_path / "fsdp"
    r = run_cli("train", *replaced(args, "trainer=fsdp_cpu"), *shards, f"hydra.run.dir={fsdp}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close_run(ddp, fsdp)
    whole = read_checkpoint(digits_checkpoint(tmp_path_factory))["state_dict"]["model.blocks.0.mlp.fc1.weight"].shape
    for rank in (0, 1):
        local = json.loads((fsdp / f"teacher{rank}.json").read_text())
        assert local["blocks.0.mlp.fc1.weight"] == [whole[0] // 2, whole[1]]
