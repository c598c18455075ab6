"""DINOv3's Gram anchoring in objective=dino (training/objectives/gram.py): the loss against dinov3's
loss/gram_loss.py GramLoss (tests/reference/, vendored verbatim) value and gradient, every option; in a Lightning run,
the Gram teacher taken from the EMA teacher before `start` and again every `update_every` steps (dinov3 train.py's
update_gram after update_ema), the loss counting from `start` with its weight, the student's global-crop patch tokens
against the Gram teacher's, each term logged (their epoch means add up to train/loss), the checkpoint carrying the Gram
teacher; bad settings one line.
(Exact resume with the Gram teacher: tests/end_to_end/test_dino_runs.py.)"""

import itertools

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.references import reference
from tests.training.objectives.test_dino import dino_cfg, fit
from vitlab.model.config import vit_config
from vitlab.training.module import build_objective
from vitlab.training.objectives import dino_nets
from vitlab.training.objectives.gram import GramConfig, gram_loss
from vitlab.utils.errors import UserError

GramLoss = reference("dinov3", "dinov3.loss.gram_loss").GramLoss
REMOVALS = [(False, False), (True, False), (False, True)]  # dinov3's GramLoss allows one at most
# (normalized, img_level, remove_neg, remove_only_teacher_neg)
OPTIONS = [(n, i, *r) for n, i, r in itertools.product([True, False], [True, False], REMOVALS)]


@pytest.mark.parametrize("normalized, img_level, remove_neg, remove_only_teacher_neg", OPTIONS)
def test_the_loss_and_its_gradient_are_dinov3s_gram_loss(normalized, img_level, remove_neg, remove_only_teacher_neg):
    torch.manual_seed(0)
    student = torch.randn(3, 5, 8, dtype=torch.float64).float().requires_grad_()
    teacher = torch.randn(3, 5, 8)
    cfg = GramConfig(
        loss_weight=1.0, normalized=normalized, img_level=img_level, remove_neg=remove_neg,
        remove_only_teacher_neg=remove_only_teacher_neg,
    )  # fmt: skip
    ours = gram_loss(student, teacher, cfg)
    (grad,) = torch.autograd.grad(ours, student)
    theirs_in = student.detach().clone().requires_grad_()
    module = GramLoss(apply_norm=normalized, remove_neg=remove_neg, remove_only_teacher_neg=remove_only_teacher_neg)
    theirs = module(theirs_in, teacher.clone(), img_level=img_level)
    (their_grad,) = torch.autograd.grad(theirs, theirs_in)
    torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad, their_grad, atol=1e-9, rtol=1e-6)
    assert ours > 0


class Record(L.Callback):
    """Per step: the Gram teacher and the EMA teacher after it, the loss and the objective's terms."""

    def __init__(self):
        self.steps, self.initial = [], None

    def on_train_start(self, trainer, module):
        self.initial = [p.detach().clone() for p in module.objective.gram_teacher.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        o = module.objective
        self.steps.append({
            "gram": [p.detach().clone() for p in o.gram_teacher.parameters()],
            "teacher": [p.detach().clone() for p in module.model.parameters()],
            "loss": outputs["loss"].detach().clone(), "terms": dict(o.terms),
        })  # fmt: skip


def test_the_gram_teacher_is_taken_at_start_and_every_update_every_steps_and_the_loss_counts_from_start(
    compose_cfg, monkeypatch, tmp_path
):
    seen = []

    def recorded(student, teacher, cfg):  # what the step hands the loss
        seen.append((student.shape, teacher.shape, teacher.requires_grad, student.requires_grad))
        return gram_loss(student, teacher, cfg)

    monkeypatch.setattr(dino_nets, "gram_loss", recorded)
    cfg = dino_cfg(
        compose_cfg, "objective.gram.loss_weight=0.5", "objective.gram.start=2", "objective.gram.update_every=3",
        "objective.koleo_weight=0.1",
    )  # fmt: skip
    record = Record()
    module, trainer, _ = fit(cfg, [record])
    steps = record.steps
    assert len(steps) == 9
    taken = [i for i in range(9) if i + 1 == 2 or (i + 1 > 2 and (i + 1 - 2) % 3 == 0)]
    assert taken == [1, 4, 7]
    held = record.initial
    for i, step in enumerate(steps):
        if i in taken:
            held = step["teacher"]  # the EMA teacher after this step's update
        assert all(torch.equal(g, h) for g, h in zip(step["gram"], held, strict=True)), i
    assert not all(torch.equal(a, b) for a, b in zip(steps[1]["gram"], record.initial, strict=True))
    # the loss: DINO's term + 0.1 KoLeo + (from step 2) 0.5 Gram, each term kept for the log
    for i, step in enumerate(steps):
        t = step["terms"]
        assert set(t) == ({"dino", "koleo", "gram"} if i >= 2 else {"dino", "koleo"}), i
        expected = t["dino"] + 0.1 * t["koleo"] + (0.5 * t["gram"] if i >= 2 else 0)
        torch.testing.assert_close(step["loss"], expected, atol=1e-6, rtol=1e-6)
        assert i < 2 or t["gram"] > 0
    # 7 training steps and 3 validations (one batch each) from step 2 on: global crops' 16 patch tokens, 16 wide
    assert len(seen) == 10 and seen[0] == ((32, 16, 16), (32, 16, 16), False, True)
    # logged: each term's mean over the last epoch (steps 6-8), adding up to train/loss's
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    assert module.objective.term_names() == ("dino", "koleo", "gram")
    terms = logged["train/loss_dino"] + 0.1 * logged["train/loss_koleo"] + 0.5 * logged["train/loss_gram"]
    assert logged["train/loss"] == pytest.approx(terms, rel=1e-5)
    path = tmp_path / "gram.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    ours = module.objective.gram_teacher.state_dict()
    assert {k.removeprefix("gram_teacher.") for k in state if k.startswith("gram_teacher.")} == set(ours)
    assert all(torch.equal(state[f"gram_teacher.{k}"], v) for k, v in ours.items())


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["objective=mae", "+objective.gram.loss_weight=1"],
         "objective.gram (DINOv3's Gram anchoring of a DINO teacher's patch features) is objective=dino's; "
         "objective=mae has no Gram teacher: drop objective.gram or train with objective=dino"),
        (["objective.gram.remove_neg=true", "objective.gram.remove_only_teacher_neg=true"],
         "objective.gram.remove_neg and objective.gram.remove_only_teacher_neg exclude each other"),
        (["objective.gram.update_every=-1"], "objective.gram.update_every"),
        (["+objective.gram.ckpt=x"], "unknown objective.gram key(s) ['ckpt']"),
    ],
)  # fmt: skip
def test_bad_gram_settings_are_one_line(compose_cfg, overrides, said):
    dino = [] if "objective=mae" in overrides else ["experiment=dino_pretrain_digits"]
    cfg = compose_cfg("train", [*dino, *overrides])
    with pytest.raises(UserError) as e:
        build_objective(OmegaConf.to_container(cfg.objective, resolve=True), vit_config(cfg.model))
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
