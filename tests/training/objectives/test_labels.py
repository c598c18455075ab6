"""objective=classify with several labels an image and with long-tailed classes (issue 77, points 2 and 3): the losses
are timm's and the papers' number for number, MixUp mixes multi-hot targets as timm's mixup_target does, the metrics
are scikit-learn's, and bad settings are refused in one line."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, balanced_accuracy_score, f1_score
from timm.loss import AsymmetricLossMultiLabel

from tests.helpers.configs import tiny
from vitlab.training.module import OBJECTIVES, build_objective
from vitlab.training.objectives.classification import Classification
from vitlab.utils.errors import UserError

C = 5


def _multilabel_batch(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, C, generator=g) < 0.3).long()
    y[torch.arange(C), torch.arange(C)] = 1  # every class has a positive (AP is defined)
    logits = torch.randn(n, C, generator=g) + 1.5 * y  # scores that know something
    return logits, y


def _compute(metrics, logits, y):
    for m in metrics.values():
        m.update(logits, y)
    return {k: m.compute() for k, m in metrics.items()}


def test_multilabel_metrics_are_scikit_learns():
    logits, y = _multilabel_batch()
    obj = build_objective({"multilabel": True, "threshold": 0.4}, tiny(num_classes=C))
    got = _compute(obj.metrics("test", C), logits, y)
    scores, truth = logits.sigmoid().numpy(), y.numpy()
    assert got["map"].item() == pytest.approx(average_precision_score(truth, scores, average="macro"), abs=1e-5)
    assert got["map_micro"].item() == pytest.approx(average_precision_score(truth, scores, average="micro"), abs=1e-5)
    per_class = average_precision_score(truth, scores, average=None)
    assert got["ap"].tolist() == pytest.approx(per_class, abs=1e-5)
    predicted = (scores > 0.4).astype(int)
    assert got["f1"].item() == pytest.approx(f1_score(truth, predicted, average="macro"), abs=1e-5)
    assert got["f1_micro"].item() == pytest.approx(f1_score(truth, predicted, average="micro"), abs=1e-5)
    assert set(obj.metrics("val", C)) == {"map", "map_micro", "f1", "f1_micro"}  # per-class AP: test only
    assert obj.best == ("map", "max") and OBJECTIVES["classify"].best_of({"multilabel": True}) == ("map", "max")
    assert OBJECTIVES["classify"].best_of({}) == ("acc", "max")


def test_single_label_runs_report_the_mean_of_class_recalls_and_each_class_accuracy():
    g = torch.Generator().manual_seed(1)
    y = torch.cat([torch.zeros(40, dtype=torch.long), torch.randint(1, C, (24,), generator=g)])  # a head class
    logits = torch.randn(len(y), C, generator=g) + 2.0 * F.one_hot(y, C)
    got = _compute(build_objective({}, tiny(num_classes=C)).metrics("test", C), logits, y)
    pred = logits.argmax(-1).numpy()
    assert got["recall_mean"].item() == pytest.approx(balanced_accuracy_score(y.numpy(), pred), abs=1e-6)
    for i in range(C):
        assert got["acc_class"][i].item() == pytest.approx((pred[y.numpy() == i] == i).mean())
    assert got["acc"].item() == pytest.approx((pred == y.numpy()).mean())


def test_multilabel_losses_are_bce_and_timm_s_asl():
    logits, y = _multilabel_batch()
    bce = build_objective({"multilabel": True, "label_smoothing": 0.1}, tiny(num_classes=C))
    smoothed = y.float() * 0.9 + 0.05  # towards 0.5, as timm's multi-label mixup_target smooths
    assert torch.allclose(bce.label_loss(logits, y), F.binary_cross_entropy_with_logits(logits, smoothed))
    opts = {"multilabel": True, "loss": "asl", "label_smoothing": 0.0, "asl": {"gamma_neg": 2, "gamma_pos": 0.5,
                                                                             "clip": 0.1}}  # fmt: skip
    asl = build_objective(opts, tiny(num_classes=C))
    ref = AsymmetricLossMultiLabel(gamma_neg=2, gamma_pos=0.5, clip=0.1)(logits, y)
    assert torch.allclose(asl.label_loss(logits, y), ref)
    assert not torch.allclose(asl.label_loss(logits, y), bce.label_loss(logits, y))
    loss, out = asl.evaluation_loss(lambda x: x, logits, y)  # evaluation: plain BCE of the logits
    assert torch.allclose(loss, F.binary_cross_entropy_with_logits(logits, y.float())) and out is logits


def test_mixup_mixes_multi_hot_targets_as_timm_s_mixup_target():
    _, y = _multilabel_batch(n=8)
    obj = build_objective({"multilabel": True, "mixup": {"mixup_alpha": 0.8}}, tiny(num_classes=C, img_size=8))
    x = torch.randn(8, 3, 8, 8)
    np.random.seed(0)
    mixed, target = obj.mix(x.clone(), y, epoch=0)
    lam = ((mixed - x.flip(0)) / (x - x.flip(0)))[0, 0, 0, 0].item()  # the draw, read back from the images
    assert target.shape == (8, C)
    assert torch.allclose(target, y.float() * lam + y.flip(0).float() * (1 - lam), atol=1e-5)


def test_class_weights_and_logit_adjustment_are_the_papers():
    counts, images = [100, 30, 10, 3, 1], 144
    logits = torch.randn(16, C, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, C, (16,), generator=torch.Generator().manual_seed(3))
    for kind, raw in (("inverse", [images / n for n in counts]),
                      ("effective_number", [(1 - 0.99) / (1 - 0.99**n) for n in counts])):  # fmt: skip
        obj = build_objective({"class_weights": kind, "class_weights_beta": 0.99, "label_smoothing": 0.0},
                              tiny(num_classes=C))  # fmt: skip
        obj.loss.fit(counts, images, torch.device("cpu"))
        w = torch.tensor(raw) / torch.tensor(raw).mean()  # mean 1, as timm's compute_class_weights
        assert torch.allclose(obj.loss.weight, w.float(), rtol=1e-5)
        assert torch.allclose(obj.label_loss(logits, y), F.cross_entropy(logits, y, weight=w.float()), rtol=1e-5)
    la = build_objective({"logit_adjust": 1.5, "label_smoothing": 0.0}, tiny(num_classes=C))
    la.loss.fit(counts, images, torch.device("cpu"))
    prior = torch.tensor(counts, dtype=torch.float32) / sum(counts)
    assert torch.allclose(la.label_loss(logits, y), F.cross_entropy(logits + 1.5 * prior.log(), y))  # Menon eq. 10
    assert torch.allclose(la.evaluation_loss(lambda x: x, logits, y)[0], F.cross_entropy(logits, y))
    given = build_objective({"class_weights": [1, 2, 3, 4, 5]}, tiny(num_classes=C))
    given.loss.fit(counts, images, torch.device("cpu"))
    assert given.loss.weight.tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(UserError, match=r"^objective.class_weights has 2 weights and the data 5 classes: give one"):
        build_objective({"class_weights": [1, 2]}, tiny(num_classes=C)).loss.fit(counts, images, "cpu")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"multilabel": True, "threshold": 1.0}, r"^objective.threshold 1.0 must be in \(0, 1\)$"),
        ({"multilabel": True, "threshold": 0}, r"^objective.threshold 0 must be in \(0, 1\)$"),
        ({"loss": "asl"}, r"^objective.loss=asl is timm's multi-label asymmetric loss: set objective.multilabel=true$"),
        ({"class_weights": "sqrt"}, r"^objective.class_weights 'sqrt' is not one of \['inverse', 'effective_number'\]"),
        ({"logit_adjust": 1.0, "multilabel": True}, r"^objective.logit_adjust 1.0 adjusts the softmax of one label"),
        ({"multilabel": "yes"}, r"^objective.multilabel 'yes' must be true or false$"),
        ({"asl": {"clip": 2}}, r"^objective.asl.clip 2 must be in \[0, 1\)$"),
    ],
)
def test_bad_label_settings_are_one_line(options, message):
    with pytest.raises(UserError, match=message):
        build_objective(options, tiny(num_classes=C))


def test_distillation_of_several_labels_is_refused():
    with pytest.raises(UserError, match=r"^objective=distill is DeiT's distillation of one label an image \(type hard"):
        build_objective({"name": "distill", "teacher": "x.ckpt", "multilabel": True}, tiny(num_classes=C))


def test_data_of_one_label_an_image_is_refused_under_multilabel():
    class OneLabel:  # an image folder's data module, as the objective sees it
        multilabel = False

    obj = build_objective({"multilabel": True}, tiny(num_classes=C))
    assert isinstance(obj, Classification)
    with pytest.raises(UserError, match=r"^objective.multilabel=true needs several labels an image, and OneLabel "):
        obj.fit_start(OneLabel(), torch.device("cpu"))
