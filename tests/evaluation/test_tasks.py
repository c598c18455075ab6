"""vitlab.eval's frozen-feature tasks on timm's pretrained weights, without a checkpoint (issue 23, point 2):
`model.pretrained=<timm name>` ported into our ViT, its features cached under the name; offline, one line."""

import json

import numpy as np
import pytest
import torch

from tests.helpers.commands import run_cli
from vitlab.utils.errors import UserError

NAME = "vit_tiny_patch16_224.augreg_in21k"
ARGS = ["task=knn", "knn.k=[5]", "model=vit_ti16", f"model.pretrained={NAME}", "data=digits", "model.img_size=16"]


def test_timm_pretrained_weights_are_evaluated_without_a_checkpoint(compose_cfg, tmp_path, monkeypatch, caplog):
    """timm's download replaced by random weights of the same model (no network in tests): the cached features
    are those timm's own model computes with them. The model has no head to speak of: k-NN never reads one."""
    import logging

    import timm

    import vitlab.convert.source as cw
    from vitlab.cli.eval_plans import eval_plan
    from vitlab.eval import evaluate
    from vitlab.training.run import build

    reference = timm.create_model(NAME, pretrained=False, img_size=16, in_chans=1, num_classes=0).eval()
    monkeypatch.setattr(cw, "timm_pretrained_state_dict", lambda source: reference.state_dict())
    cfg = compose_cfg("eval", ARGS)
    with caplog.at_level(logging.INFO):
        metrics = evaluate(cfg)
    assert metrics["pretrained"] == NAME and 0.0 <= metrics["knn/top1_k5"] <= 1.0
    assert f"loaded timm's weights of {NAME}" in caplog.text and "(new head)" not in caplog.text
    cache = tmp_path / "outputs" / "features" / NAME  # <paths.log_dir>/features/<name>/
    meta = json.loads((cache / "train.json").read_text())
    assert meta["pretrained"] == NAME and meta["model"]["embed_dim"] == 192 and meta["data"]["mean"] == [0.5]
    dm = build.build_datamodule(eval_plan(cfg).data)  # the data as evaluated: the weights' mean and std filled in
    dm.setup("test")
    x, _ = dm.device_transform(next(iter(dm._loader(dm.eval_view("train"), train=False))), train=False)
    with torch.no_grad():
        expected = reference.forward_head(reference.forward_features(x), pre_logits=True)
    np.testing.assert_allclose(np.load(cache / "train.npy")[: len(x)], expected.numpy(), rtol=1e-4, atol=1e-5)


def test_pretrained_weights_offline_are_one_line_naming_them(tmp_path):
    r = run_cli("eval", *ARGS, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: cannot fetch timm weights '{NAME}': no network and not in the Hugging Face cache ({tmp_path / 'hf'}); "
        "run once online, or give a local .safetensors/.pth file or a timm folder (local-dir:<folder>) instead"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=knn"], "ckpt_path must be given: ckpt_path=<file.ckpt>, or timm's weights with model.pretrained="),
        (["task=knn", f"model.pretrained={NAME}", "data=digits"], "task=knn on model.pretrained=vit_tiny_patch16_22"),
        (
            ["task=test", f"model.pretrained={NAME}", "data=digits"],
            f"the data has 10 classes and 1 channels, and model.pretrained={NAME}'s head 21843 classes of 3-channel",
        ),
        (["task=knn", "model=vit_ti16", f"model.pretrained={NAME}"], "needs the data to evaluate on: data=<name>"),
    ],
)
def test_what_pretrained_evaluation_needs_is_named(compose_cfg, overrides, message):
    from vitlab.eval import evaluate

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(compose_cfg("eval", overrides))


def test_a_distilled_checkpoint_is_probed_beside_its_teacher_with_the_retention(
    digits_ckpt, tmp_path_factory, tmp_path
):
    """Issue 76, point 5: vitlab.eval task=knn of a student distilled from a vitlab checkpoint probes its teacher too,
    on the same images as the teacher takes them: `teacher/<metric>` as vitlab.eval of the teacher alone gives it,
    `retention/<metric>` the student's over the teacher's; teacher=false evaluates the student alone."""
    from tests.helpers.runs import trained

    run = trained(tmp_path_factory, "distilled-feature", "debug=limit", "progress_bar=none", "objective=distill",
                  "objective.kind=feature", f"objective.teacher={digits_ckpt}", "model.depth=2")  # fmt: skip
    student = json.loads((run / "metrics.json").read_text())["tested_checkpoint"]
    knn = ["task=knn", "knn.k=[5,10]"]
    for name, ckpt, extra in (("both", student, []), ("alone", digits_ckpt, [f"features_dir={tmp_path / 'f'}"]),
                              ("student", student, ["teacher=false"])):  # fmt: skip
        r = run_cli("eval", f"ckpt_path={ckpt}", *knn, *extra, f"hydra.run.dir={tmp_path / name}")
        assert r.returncode == 0, r.stderr[-3000:]
    both, alone, only = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("both", "alone", "student"))
    for k in ("knn/top1_k5", "knn/top1_k10", "knn/top5_k10"):
        assert both[f"teacher/{k}"] == pytest.approx(alone[k], abs=1e-9) and both[k] == only[k]
        assert both[f"retention/{k}"] == pytest.approx(both[k] / alone[k])
    assert not any(k.startswith(("teacher", "retention")) for k in only)


def test_several_teachers_are_named_beside_the_student_and_only_scores_get_a_retention():
    from vitlab.evaluation.tasks import beside_teacher

    student = {"linear/top1": 0.6, "linear/val_top1": 0.7, "linear/lr": 0.01, "fewshot/5shot_std": 0.1, "split": "test"}
    teacher = {"linear/top1": 0.8, "linear/val_top1": 0.9, "linear/lr": 0.1, "fewshot/5shot_std": 0.2, "split": "test"}
    one = beside_teacher(student, "teacher", teacher)
    assert one["teacher/linear/top1"] == 0.8 and one["retention/linear/top1"] == pytest.approx(0.75)
    assert {k for k in one if k.startswith("retention/")} == {"retention/linear/top1"} and "teacher/split" not in one
    named = beside_teacher(one, "dinov2", {"linear/top1": 0.5})
    assert named["teacher_dinov2/linear/top1"] == 0.5 and named["retention_dinov2/linear/top1"] == pytest.approx(1.2)
    assert beside_teacher(None, "teacher", None) is None  # (a process other than rank 0)
