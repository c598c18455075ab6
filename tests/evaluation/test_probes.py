"""Frozen-feature evaluations (issue 23, point 2): the k-NN classifier against a direct computation, few-shot
least squares against the closed-form ridge solution, and the features cache (extracted once, resumed, reused)."""

import json
import math

import numpy as np
import pytest
import torch

from vitlab.evaluation.probes import fewshot_accuracy, knn_predict, lsr_fit, lsr_predict


def direct_knn(train, train_labels, test, num_classes, k, T):
    """One test feature at a time, as written in DINO: cosine similarity, the k largest, weights exp(s / T)."""
    preds = []
    for q in test:
        sims = [float(np.dot(q, t) / (np.linalg.norm(q) * np.linalg.norm(t))) for t in train]
        order = sorted(range(len(train)), key=lambda i: -sims[i])[:k]
        votes = [0.0] * num_classes
        for i in order:
            votes[int(train_labels[i])] += math.exp(sims[i] / T)
        preds.append(max(range(num_classes), key=lambda c: (votes[c], -c)))  # a tie: the lowest class
    return preds


def test_knn_equals_a_direct_computation_with_temperature_weights_and_ties():
    g = torch.Generator().manual_seed(0)
    train, test = torch.randn(60, 8, generator=g), torch.randn(25, 8, generator=g)
    labels = torch.randint(0, 4, (60,), generator=g)
    for T in (0.07, 1.0):
        preds = knn_predict(train, labels, test, 4, ks=(1, 5, 20, 100), temperature=T)
        for k, p in preds.items():
            assert p.tolist() == direct_knn(train.numpy(), labels.numpy(), test.numpy(), 4, min(k, 60), T), (k, T)
    # A tie: two neighbours of classes 2 and 1 at the same similarity: the lower class wins, as argmax's first.
    tie_train, tie_labels = torch.tensor([[1.0, 1.0], [1.0, -1.0]]), torch.tensor([2, 1])
    assert knn_predict(tie_train, tie_labels, torch.tensor([[1.0, 0.0]]), 3, ks=(2,))[2].tolist() == [1]
    # The temperature matters: one very close neighbour against two farther ones.
    near = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]])
    lab = torch.tensor([0, 1, 1])
    q = torch.tensor([[1.0, 0.0]])
    assert knn_predict(near, lab, q, 2, ks=(3,), temperature=0.07)[3].tolist() == [0]
    assert knn_predict(near, lab, q, 2, ks=(3,), temperature=100.0)[3].tolist() == [1]


@pytest.mark.parametrize("n, d", [(40, 6), (6, 40)])
def test_least_squares_is_the_closed_form_ridge_solution(n, d):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)
    w, mean, std = lsr_fit(x, y, 3, l2_reg=4.0)
    xs = np.pad((x.double().numpy() - mean.numpy()) / std.numpy(), ((0, 0), (0, 1)), constant_values=100.0)
    t = 2.0 * np.eye(3)[y.numpy()] - 1.0
    ridge = np.linalg.solve(xs.T @ xs + 4.0 * np.eye(d + 1), xs.T @ t)  # the primal form, whichever branch ran
    np.testing.assert_allclose(w.numpy(), ridge, rtol=1e-6, atol=1e-9)
    assert lsr_predict(x, w, mean, std).tolist() == (xs @ ridge).argmax(1).tolist()


def clusters(classes: int, dim: int, per_class: tuple[int, ...], seed: int, spread: float):
    """Features around one random centre per class (`spread` apart, unit noise): a (features, labels) pair per count."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * spread
    out = []
    for n in per_class:
        labels = torch.arange(classes).repeat(n)
        out += [centers[labels] + torch.randn(len(labels), dim, generator=g), labels]
    return out


def test_fewshot_draws_shots_per_class_and_scores_the_test_split():
    train, labels, test, test_labels = clusters(3, 16, (20, 10), seed=2, spread=5)
    acc = fewshot_accuracy(train, labels, test, test_labels, 3, shots=(1, 5), seed=0)
    assert set(acc) == {1, 5} and acc[5] == 1.0  # well-separated classes
    assert acc == fewshot_accuracy(train, labels, test, test_labels, 3, shots=(1, 5), seed=0)  # seeded


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory):
    from tests.helpers import run_cli

    run_dir = tmp_path_factory.mktemp("probe") / "run"
    r = run_cli("train", "debug=limit", "progress_bar=none", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text())["tested_checkpoint"]


def test_features_are_cached_once_resumed_and_reused(digits_ckpt, tmp_path):
    from vitlab.evaluation.features import source_id, split_features
    from vitlab.training import build

    module = build.load_for_inference(digits_ckpt)
    dm = build.inference_datamodule(module, digits_ckpt)
    dm.setup("test")
    calls = []
    real = module.model.forward_features
    module.model.forward_features = lambda x, *a, **kw: calls.append(len(x)) or real(x, *a, **kw)
    src = source_id(digits_ckpt)
    f1, y1 = split_features(module.model, dm, "train", torch.device("cpu"), tmp_path, src)
    n = len(f1)
    assert sum(calls) == n and f1.shape[0] == y1.shape[0] == n
    calls.clear()
    f2, y2 = split_features(module.model, dm, "train", torch.device("cpu"), tmp_path, src)
    assert calls == [] and torch.equal(f1, f2) and torch.equal(y1, y2)  # read, not recomputed
    meta = json.loads((tmp_path / "train.json").read_text())
    (tmp_path / "train.json").write_text(json.dumps(meta | {"done": 64}))  # as if it had stopped after a batch
    f3, _ = split_features(module.model, dm, "train", torch.device("cpu"), tmp_path, src)
    assert sum(calls) == n - 64 and torch.equal(f1, f3)
    calls.clear()
    split_features(module.model, dm, "train", torch.device("cpu"), tmp_path, {**src, "mtime_ns": 0})
    assert sum(calls) == n  # other weights: extracted anew


@pytest.mark.parametrize("task", ["knn", "fewshot", "linear"])
def test_eval_knn_linear_and_fewshot_on_a_checkpoint(digits_ckpt, compose_cfg, tmp_path, task):
    from vitlab.eval import evaluate

    metrics = evaluate(compose_cfg("eval", [f"ckpt_path={digits_ckpt}", f"task={task}"]))
    names = {"knn": ["knn/top1_k10", "knn/top1_k200"], "fewshot": ["fewshot/1shot", "fewshot/25shot"],
             "linear": ["linear/top1", "linear/val_top1"]}[task]  # fmt: skip
    assert all(0.0 <= metrics[n] <= 1.0 for n in names) and metrics["split"] == "test"
    assert json.loads((tmp_path / "metrics.json").read_text())[names[0]] == metrics[names[0]]


def test_the_linear_probe_picks_its_learning_rate_on_validation_never_on_test():
    """Validation features that agree with training, test features whose labels are permuted: the chosen learning
    rate is the best on validation, and the reported test accuracy is that one head's, whatever test would prefer."""
    from vitlab.evaluation.probes import linear_probe

    train, y, val, val_y = clusters(4, 12, (64, 16), seed=3, spread=3)
    test_y = (val_y + 1) % 4  # the same images, labelled otherwise: test would pick the worst head
    lrs = (1e-5, 1e-3, 0.1)
    out = linear_probe(train, y, val, val_y, val.clone(), test_y, 4, lrs=lrs, epochs=5, batch_size=32)
    per_lr = out["val_acc_per_lr"]
    assert out["lr"] == max(lrs, key=lambda lr: (per_lr[lr], -lr)) and out["val_acc"] == per_lr[out["lr"]] > 0.9
    assert out["test_acc"] < 0.2  # scored, not chosen, on test
    with pytest.raises(Exception, match="needs a test split besides it"):
        from types import SimpleNamespace

        from vitlab.evaluation.features import probe

        probe(SimpleNamespace(task="linear"), None, SimpleNamespace(test_set=None), {}, None, torch.device("cpu"))


def test_the_linear_grid_chooses_features_and_learning_rate_on_validation():
    """Two feature configurations, one of them noise: the (configuration, learning rate) best on validation is
    chosen, and its test accuracy reported, also where test would have preferred the other."""
    from vitlab.evaluation.probes import linear_grid, linear_probe

    train, y, val, val_y = clusters(4, 12, (64, 16), seed=4, spread=3)
    g = torch.Generator().manual_seed(5)
    noise = [torch.randn(len(t), 12, generator=g) for t in (train, val, val)]
    test_y = (val_y + 1) % 4  # the clusters' test labels permuted: on test, noise would do better
    views = {"noise": tuple(noise), "clusters": (train, val, val.clone())}
    out = linear_grid(views, y, val_y, test_y, 4, lrs=(1e-3, 0.1), epochs=3, batch_size=32)
    assert out["features"] == "clusters" and out["val_acc"] > 0.9 > out["val_acc_per_features"]["noise"]
    alone = linear_probe(train, y, val, val_y, val.clone(), test_y, 4, lrs=(1e-3, 0.1), epochs=3, batch_size=32)
    assert (out["lr"], out["test_acc"]) == (alone["lr"], alone["test_acc"]) and out["test_acc"] < 0.2
