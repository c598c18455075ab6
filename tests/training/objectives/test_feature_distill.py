"""vitlab.training.objectives.feature_distill (objective=distill objective.kind=feature|tokens): feature distillation
held to timm's FeatureDistillationTask (loss and gradients), AM-RADIO's token distillation with the teacher's grid
resampled to the student's, the refusals, and a label-free run from two teachers on digits end to end (issue 76)."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.configs import tiny
from vitlab.model import ViT
from vitlab.training.module import build_objective
from vitlab.training.objectives.distillation import Teacher, open_teacher
from vitlab.utils.errors import UserError


def _objective(student_cfg, teacher_model, input_hw, **options):
    """The objective with `teacher_model` as its teacher (as setup_fit and fit_start ready it), the student's
    normalisation its pretrained_cfg's."""
    objective = build_objective({"name": "distill", "teacher": "t.ckpt", "label_smoothing": 0.0, **options},
                                student_cfg, unlabeled=options.pop("unlabeled", False))  # fmt: skip
    objective.teachers["teacher"] = Teacher(teacher_model, input_hw)
    objective.setup_fit(student_cfg.num_classes)
    s = ViT(student_cfg).pretrained_cfg
    objective.fitted.student_norm = tuple(torch.tensor(s[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    return objective


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("weights", [{"task_weight": 0.3, "distill_weight": 2.0}, {"task_weight": 0.3}])
def test_feature_distillation_is_timms_task(weights):
    """kind=feature against timm's FeatureDistillationTask with the same student, teacher, projection and batch: the
    same loss (independent and complementary weights) and the same gradients of the student and projection."""
    from timm.task.distillation import FeatureDistillationTask

    torch.manual_seed(0)
    student = ViT(tiny(global_pool="avg")).train()
    teacher = ViT(tiny(embed_dim=48, num_heads=4, depth=1, num_classes=0))
    teacher.pretrained_cfg.update(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))  # renormalised from the student's
    objective = _objective(student.cfg, teacher, (32, 32), kind="feature", **weights)
    projection = objective.heads["teacher"]
    assert (projection.in_features, projection.out_features) == (32, 48)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    grad_mode = []
    teacher.blocks[0].register_forward_hook(lambda *_: grad_mode.append(torch.is_grad_enabled()))
    ours, logits = objective.training_loss(student, x, y, epoch=0)
    assert grad_mode == [False]  # the teacher's forward under torch.no_grad
    ours.backward()
    ours_grads = _grads(student) | {f"projection.{n}": g for n, g in _grads(projection).items()}
    student.zero_grad()
    task = FeatureDistillationTask(student, teacher, criterion=torch.nn.CrossEntropyLoss(), verbose=False, **{
        {"task_weight": "task_loss_weight", "distill_weight": "distill_loss_weight"}[k]: v for k, v in weights.items()
    })  # fmt: skip
    task.trainable_module.projection.load_state_dict(projection.state_dict())
    theirs = task(x, y)
    theirs["loss"].backward()
    torch.testing.assert_close(ours, theirs["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, theirs["output"], atol=1e-6, rtol=0)
    theirs_grads = _grads(student) | {f"projection.{n}": g for n, g in _grads(task.trainable_module.projection).items()}
    assert ours_grads.keys() == theirs_grads.keys() and len(ours_grads) > 20
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-6, rtol=0, msg=name)
    assert all(p.grad is None for p in teacher.parameters())
    assert objective.terms["teacher"] == pytest.approx(theirs["kd_loss"].item(), abs=1e-6)


def test_token_distillation_resamples_the_teachers_grid_bilinearly():
    """kind=tokens: AM-RADIO's terms, the class token's cosine distance and the patch tokens' cosine distance and
    smooth-L1, each through its own head; the teacher's 2x3 grid (32x48 px, patch 16) resampled bilinearly to the
    student's 4x4 (32 px, patch 8) after its input was resized to its 32x48."""
    torch.manual_seed(0)
    student = ViT(tiny()).train()
    teacher = ViT(tiny(img_size=(32, 48), patch_size=16, embed_dim=48, depth=1, num_classes=0, reg_tokens=2))
    w = dict(cls_weight=0.7, patch_weight=1.3, cos_weight=0.6, smooth_l1_weight=0.4)
    objective = _objective(student.cfg, teacher, (32, 48), kind="tokens", task_weight=0.25, distill_weight=2.0, **w)
    assert objective.shapes["teacher"].grid == (2, 3) and objective.shapes["teacher"].prefix == 3
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 7, (2,))
    torch.manual_seed(1)
    loss, _ = objective.training_loss(student, x, y, epoch=0)

    seen = F.interpolate(x, size=(32, 48), mode="bicubic", align_corners=False, antialias=True)  # same mean and std
    with torch.no_grad():
        t = teacher.eval().forward_features(seen)
        grid = t[:, 3:].reshape(2, 2, 3, 48).permute(0, 3, 1, 2)  # (B, D, h, w), rows first
        t_patch = F.interpolate(grid, size=(4, 4), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
    torch.manual_seed(1)
    s = student.forward_features(x)
    s_cls, s_patch = objective.heads["teacher_cls"](s[:, 0]), objective.heads["teacher_patch"](s[:, 1:])
    kd = w["cls_weight"] * (1 - F.cosine_similarity(s_cls, t[:, 0], dim=-1).mean()) + w["patch_weight"] * (
        w["cos_weight"] * (1 - F.cosine_similarity(s_patch, t_patch, dim=-1).mean())
        + w["smooth_l1_weight"] * F.smooth_l1_loss(s_patch, t_patch)
    )
    label = F.cross_entropy(student.forward_head(s), y)
    torch.testing.assert_close(loss, 0.25 * label + 2.0 * kd, atol=1e-6, rtol=0)
    assert set(objective.heads) == {"teacher_cls", "teacher_patch"}


def test_the_refusals_in_one_line(monkeypatch):
    import timm

    cnn = timm.create_model("resnet10t", pretrained=False, num_classes=0)
    with pytest.raises(UserError, match=r"^objective.kind=tokens distils patch tokens, and objective.teacher 't.ckpt' "
                                        r"has none .*: use objective.kind=feature with it$"):  # fmt: skip
        _objective(tiny(), cnn, (32, 32), kind="tokens")
    _objective(tiny(), cnn, (32, 32), kind="feature")  # its pooled features: fine
    odd = ViT(tiny(num_classes=0))
    odd.patch_embed.patch_size = (5, 5)  # 16 patch tokens that are no grid of 5 px patches at 32 px
    with pytest.raises(UserError, match=r"^objective.teacher 't.ckpt': its 16 patch tokens at 32x32 px are no grid .* "
                                        r"cannot be resampled to the student's"):  # fmt: skip
        _objective(tiny(), odd, (32, 32), kind="tokens")
    with pytest.raises(UserError, match=r"^objective.kind=logits \(DeiT's\) learns from the labels .* data.labels"):
        build_objective({"name": "distill", "teacher": "t.ckpt"}, tiny(), unlabeled=True)
    with pytest.raises(UserError, match=r"^model.num_classes 0: objective.kind=feature with labels trains a"):
        build_objective({"name": "distill", "teacher": "t.ckpt", "kind": "feature"}, tiny(num_classes=0)).check(
            tiny(num_classes=0), None
        )
    with pytest.raises(UserError, match=r"^objective.teachers \(several teachers\) distil features: give"):
        build_objective({"name": "distill", "teachers": ["a.ckpt", "b.ckpt"]}, tiny())
    with pytest.raises(UserError, match=r"^objective.kind 'patches' is not one of \['logits', 'feature', 'tokens'\]"):
        build_objective({"name": "distill", "teacher": "a.ckpt", "kind": "patches"}, tiny())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match=r"^cannot fetch timm weights 'vit_small_patch14_dinov2.lvd142m': no net"):
        open_teacher("vit_small_patch14_dinov2.lvd142m", True, 0)


def test_a_label_free_run_from_two_teachers_on_digits(compose_cfg, tmp_path, tmp_path_factory):
    """The acceptance command: objective=distill objective.kind=tokens data.labels=false from a digits checkpoint,
    here two teachers (the same file, weights 1 and 0.5): each one's term logged (train/loss_<name>), no accuracy, the
    best checkpoint the lowest val/loss; the heads in its distill_heads.*, not the teachers; the checkpoint loads
    without them (vitlab.eval's way) and exports to timm as a plain ViT; the classifier head never moved."""
    from tests.helpers.runs import digits_checkpoint
    from vitlab.convert.weights import read_state_dict
    from vitlab.train import train
    from vitlab.training.run.inference import load_for_inference

    teacher = digits_checkpoint(tmp_path_factory)
    teachers = f"[{teacher},{{teacher:{teacher},weight:0.5,name:half}}]"
    args = ["debug=limit", "progress_bar=none", "objective=distill", "objective.kind=tokens", "data.labels=false",
            f"objective.teachers={teachers}", "model.depth=2"]  # fmt: skip
    train(compose_cfg("train", args, output_dir=tmp_path / "run"))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {"train/loss_last", "train/loss_half", "val/loss_best", "test/loss"} <= set(metrics)
    assert not any("acc" in k for k in metrics)
    assert metrics["train/loss"] > 0 and metrics["train/loss_half"] > 0
    ckpt = torch.load(metrics["tested_checkpoint"], weights_only=True)
    heads = {k.split(".")[1] for k in ckpt["state_dict"] if k.startswith("distill_heads.")}
    assert heads == {"last_cls", "last_patch", "half_cls", "half_patch"}
    assert all(k.startswith(("model.", "distill_heads.", "train_metrics.", "val_")) for k in ckpt["state_dict"])
    assert any("'monitor': 'val/loss', 'mode': 'min'" in k for k in ckpt["callbacks"])
    module = load_for_inference(metrics["tested_checkpoint"])  # no teacher read: the heads from their shapes
    assert not module.objective.uses_labels and not module.objective.teachers and set(module.objective.heads) == heads
    state = read_state_dict(metrics["tested_checkpoint"])  # what model.pretrained=<ckpt> and vitlab.export read
    assert not any("distill" in k for k in state)
    ViT(module.model.cfg).load_state_dict(state)  # a plain ViT
    assert not module.model.head.weight.requires_grad  # no labels: out of the optimizer's and DDP's way
