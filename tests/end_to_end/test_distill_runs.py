"""objective=distill objective.kind=tokens data.labels=false as typed (issue 76's acceptance command): stopped by
SIGTERM mid-epoch and resumed as the printed command says, it ends as the uninterrupted run (the student, its heads,
every logged value; the teacher loaded again from its checkpoint), in one process and in two (DDP)."""

from tests.helpers.commands import replaced
from tests.helpers.configs import RESUMABLE
from tests.helpers.runs import assert_resumes_exactly, digits_checkpoint


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


def test_a_label_free_token_distillation_on_two_processes_resumes_exactly(tmp_path, tmp_path_factory):
    """DDP, each process loading the teacher: the ranks agree to stop within two of their 8-step intervals
    (utils/signals.py), hence 27 steps, for the resumed run to go on after the stop."""
    teacher = digits_checkpoint(tmp_path_factory)
    assert_resumes_exactly([*RESUMABLE, *_tokens(teacher), "trainer=ddp_cpu", "trainer.devices=2"], tmp_path,
                           "SIGTERM", 4)  # fmt: skip
