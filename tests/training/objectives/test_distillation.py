"""vitlab.training.objectives.distillation: DeiT's distillation. The losses against timm's TokenDistillationTask (hard:
equal; soft: DeiT divides by the logits' count, timm by the batch), the teacher's preprocessing, and distillation from a
vitlab teacher on digits end to end."""

import json

import pytest
import torch
from torch import nn

from tests.helpers.commands import replaced
from tests.helpers.configs import tiny
from vitlab.model import ViT
from vitlab.training.objectives.distillation import DistillConfig, Teacher, distillation_loss, load_teacher
from vitlab.utils.errors import UserError


def _pair(distilled=True):
    torch.manual_seed(0)
    student = ViT(tiny(distilled=distilled)).train()
    student.set_distilled_training(distilled)
    teacher = ViT(tiny(depth=1))
    teacher.pretrained_cfg.update(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))  # renormalised from the student's
    return student, teacher


@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_token_distillation_is_timms_task(kind):
    """The student's (class, distillation) heads against timm's TokenDistillationTask with the same teacher:
    hard distillation gives the same loss; soft is DeiT's, timm's over the class count (DeiT divides the summed KL by
    the logits' count, timm by the batch)."""
    from timm.task.token_distillation import TokenDistillationTask

    student, teacher_model = _pair()
    teacher = Teacher(teacher_model, (32, 32))
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    mean, std = (
        torch.tensor(v).view(1, -1, 1, 1) for v in (student.pretrained_cfg["mean"], student.pretrained_cfg["std"])
    )
    cfg = DistillConfig(type=kind, alpha=0.3, tau=2.0, teacher="teacher.ckpt")
    torch.manual_seed(1)
    cls_logits, dist_logits = student(x)
    label = nn.functional.cross_entropy(cls_logits, y)
    ours = distillation_loss(label, dist_logits, teacher(x, mean, std), cfg)
    task = TokenDistillationTask(student, teacher.kd, criterion=nn.CrossEntropyLoss(), distill_type=kind,
                                 task_loss_weight=0.7, temperature=2.0, verbose=False)  # fmt: skip
    torch.manual_seed(1)
    theirs = task(x, y)
    if kind == "hard":
        torch.testing.assert_close(ours, theirs["loss"], atol=1e-6, rtol=0)
    else:
        kd = (ours - 0.7 * label) / 0.3
        torch.testing.assert_close(kd * 7, theirs["distill_loss"], atol=1e-6, rtol=1e-5)


def test_the_teacher_sees_its_own_normalisation_and_size_without_gradients():
    """Renormalised from the student's mean/std to the teacher's, resized to its input, in eval mode, no grad."""
    _, teacher_model = _pair()
    teacher = Teacher(teacher_model, (32, 32)).train()
    assert not teacher.training and not teacher.kd.model.training
    img = torch.rand(2, 3, 32, 32)
    s_mean, s_std = torch.full((1, 3, 1, 1), 0.45), torch.full((1, 3, 1, 1), 0.22)
    t_mean, t_std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    out = teacher((img - s_mean) / s_std, s_mean, s_std)
    torch.testing.assert_close(out, teacher_model.eval()((img - t_mean) / t_std), atol=1e-5, rtol=0)
    assert not out.requires_grad
    small = Teacher(ViT(tiny(img_size=16)), (16, 16))
    assert small(torch.randn(2, 3, 32, 32), s_mean, s_std).shape == (2, 7)  # 32 px resized to its 16
    with pytest.raises(UserError, match=r"objective.teacher takes 3-channel images, and the data has 1 channels"):
        small(torch.randn(2, 1, 32, 32), s_mean[:, :1], s_std[:, :1])


def test_under_bf16_mixed_the_teacher_computes_in_bf16_and_hands_back_float32():
    """trainer.precision=bf16-mixed (issue 76, point 4): the step's autocast (Lightning's, on a GPU as here on the
    CPU) covers the teacher too, whose matmuls then run in bf16; the logits it hands the loss are float32, without
    gradients."""
    _, teacher_model = _pair()
    teacher = Teacher(teacher_model, (32, 32))
    seen = []
    teacher_model.blocks[0].mlp.fc1.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    mean, std = torch.full((1, 3, 1, 1), 0.45), torch.full((1, 3, 1, 1), 0.22)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = teacher(torch.randn(2, 3, 32, 32), mean, std)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32 and not out.requires_grad


def test_a_timm_teacher_by_name_and_the_settings_checks():
    cfg = DistillConfig(type="soft", teacher="vit_tiny_patch16_224", teacher_pretrained=False)
    teacher = load_teacher(cfg, num_classes=7)
    assert teacher.input_hw == (224, 224) and teacher.kd.model.num_classes == 7
    assert teacher(torch.randn(1, 3, 32, 32), torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)).shape == (1, 7)
    with pytest.raises(UserError, match=r"objective.type 'kd' is not one of \['soft', 'hard'\]"):
        DistillConfig(type="kd", teacher="t.ckpt")
    with pytest.raises(UserError, match=r"objective=distill needs objective.teacher: a vitlab checkpoint"):
        DistillConfig(type="hard")
    with pytest.raises(UserError, match=r"objective.alpha 1.5 must be in \[0, 1\]"):
        DistillConfig(alpha=1.5, teacher="t.ckpt")
    with pytest.raises(UserError, match=r"objective.label_smoothing 1.0 must be in \[0, 1\)"):
        DistillConfig(label_smoothing=1.0, teacher="t.ckpt")  # the label loss's options: objective=classify's


def _teacher(tmp_path_factory) -> str:
    """A vitlab teacher on digits: the tested checkpoint of the suite's `debug=limit` run (tests/evaluation's too),
    trained once per pytest run."""
    from tests.helpers.runs import trained

    run = trained(tmp_path_factory, "debug-limit", "debug=limit", "progress_bar=none")
    return json.loads((run / "metrics.json").read_text())["tested_checkpoint"]


def test_distillation_from_a_vitlab_teacher_trains_on_digits(compose_cfg, tmp_path, tmp_path_factory):
    """A teacher trained on digits, then a distilled student (token, hard) and a plain one (logits, soft, tau 2)
    learning from its checkpoint: each first step's loss is DeiT's, (1 - alpha) x the label loss + alpha x the
    distillation term against the teacher's logits on the same images (the teacher read back from its file here, and
    its top class not the label on most of them); the teacher is not part of the student's checkpoint. A teacher of
    other classes is refused."""
    import torch.nn.functional as F

    from tests.helpers.callbacks import FirstStep
    from tests.helpers.configs import extra_callback
    from vitlab.train import train
    from vitlab.training.run.inference import load_for_inference

    base = ["debug=limit", "progress_bar=none", "callbacks=default"]
    ckpt = _teacher(tmp_path_factory)
    teacher = load_for_inference(ckpt).model.eval()
    first = extra_callback("first", "FirstStep")
    for name, extra in (
        ("token", ["model.distilled=true", "objective.type=hard"]),
        ("logits", ["objective.type=soft", "objective.tau=2"]),
    ):
        out = tmp_path / name
        FirstStep.seen.clear()
        acc = train(
            compose_cfg(
                "train", [*base, "objective=distill", *extra, f"objective.teacher={ckpt}", *first], output_dir=out
            )
        )
        assert 0.0 <= acc <= 1.0
        seen = FirstStep.seen
        x, y = seen["x"], seen["y"]
        with torch.no_grad():
            t = teacher(x)
            torch.set_rng_state(seen["torch"])
            s = seen["model"].train()(x)
        assert (t.argmax(1) != y).float().mean() > 0.5  # the teacher says something the labels do not
        smoothing = 0.1  # conf/objective/classify.yaml's, the label loss's
        if name == "token":  # the class token's head learns the labels, the distillation token's the teacher's
            expected = 0.5 * F.cross_entropy(s[0], y, label_smoothing=smoothing) + 0.5 * F.cross_entropy(
                s[1], t.argmax(1)
            )
        else:
            kl = F.kl_div(F.log_softmax(s / 2, 1), F.log_softmax(t / 2, 1), reduction="sum", log_target=True)
            expected = 0.5 * F.cross_entropy(s, y, label_smoothing=smoothing) + 0.5 * kl * 4 / s.numel()
        assert seen["loss"].item() == pytest.approx(expected.item(), rel=1e-5)
        student = json.loads((out / "metrics.json").read_text())["tested_checkpoint"]
        keys = torch.load(student, weights_only=True)["state_dict"]
        assert not any("teacher" in k or k.startswith("kd.") for k in keys)
    cfg = DistillConfig(type="hard", teacher=ckpt)
    with pytest.raises(UserError, match=r"predicts 10 classes and the student 3: a teacher of the same classes"):
        load_teacher(cfg, num_classes=3)
    with pytest.raises(UserError, match=r"objective.teacher 'gone.ckpt' does not exist: a vitlab checkpoint"):
        load_teacher(DistillConfig(type="hard", teacher="gone.ckpt"), num_classes=10)


def test_a_distilled_run_with_ema_warmup_resumes_exactly(tmp_path, tmp_path_factory):
    """Token distillation (soft) from a vitlab teacher, EMA with warm-up, the raw weights chosen: stopped mid-epoch
    by SIGTERM and resumed as the printed command says, it ends as the uninterrupted run (weights, both EMA and raw,
    and every logged value). The teacher is loaded again from its checkpoint, not saved with the student."""
    from tests.helpers.configs import RESUMABLE
    from tests.helpers.runs import assert_resumes_exactly

    ckpt = _teacher(tmp_path_factory)
    args = [
        *replaced(RESUMABLE, "trainer.max_epochs=2"),
        "model.distilled=true",
        "objective=distill",
        "objective.type=soft",
        "objective.tau=2.0",
        f"objective.teacher={ckpt}",
        "callbacks.ema.warmup=true",
        "callbacks.model_checkpoint.monitor=val/acc",
    ]
    assert_resumes_exactly(args, tmp_path, "SIGTERM", 11)
