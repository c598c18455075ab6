"""objective=distill objective.kind=tokens data.labels=false as typed (issue 76's acceptance command): stopped by
SIGTERM mid-epoch and resumed as the printed command says, it ends as the uninterrupted run (the student, its heads,
every logged value; the teacher loaded again from its checkpoint)."""

from tests.helpers.commands import replaced
from tests.helpers.configs import RESUMABLE
from tests.helpers.runs import assert_resumes_exactly, digits_checkpoint


def test_a_label_free_token_distillation_resumes_exactly(tmp_path, tmp_path_factory):
    teacher = digits_checkpoint(tmp_path_factory)
    args = [
        *replaced(RESUMABLE, "trainer.max_epochs=2"),
        "objective=distill",
        "objective.kind=tokens",
        f"objective.teacher={teacher}",
        "data.labels=false",
        "callbacks.model_checkpoint.monitor=val/loss_ema",  # (callbacks=ema's val/acc_ema: no accuracy here)
        "callbacks.model_checkpoint.mode=min",
    ]
    assert_resumes_exactly(args, tmp_path, "SIGTERM", 13)
