"""Frozen-feature evaluations (issue 23, point 2): the k-NN classifier against a direct computation, few-shot
least squares against the closed-form ridge solution, and the features cache (extracted once, resumed, reused)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitlab.evaluation.probes import fewshot_accuracy, fewshot_seeds, knn_map, knn_predict, lsr_fit, lsr_predict


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


def direct_knn_scores(train, train_labels, test, k, T):
    """Several labels an image: one test feature at a time, its k most similar training features (cosine), each of
    weight exp(s / T); a class's score the share of that weight whose images carry the class."""
    scores = np.zeros((len(test), train_labels.shape[1]))
    for row, q in enumerate(test):
        sims = [float(np.dot(q, t) / (np.linalg.norm(q) * np.linalg.norm(t))) for t in train]
        nearest = sorted(range(len(train)), key=lambda i: -sims[i])[:k]
        for i in nearest:
            scores[row] += math.exp(sims[i] / T) * train_labels[i]
        scores[row] /= sum(math.exp(sims[i] / T) for i in nearest)
    return scores


def test_knn_map_scores_each_class_by_its_neighbours_weighted_votes_as_scikit_learn_ranks_them():
    """mAP over the classes and over every (image, class) pair, of the direct computation's scores, by scikit-learn's
    average_precision_score (the reference the classifier's test/map is held to)."""
    from sklearn.metrics import average_precision_score

    g = torch.Generator().manual_seed(3)
    train, test = torch.randn(60, 8, generator=g), torch.randn(30, 8, generator=g)
    labels, test_labels = torch.randint(0, 2, (60, 4), generator=g), torch.randint(0, 2, (30, 4), generator=g)
    test_labels[0] = 1  # every class has a positive test image
    for T in (0.5, 0.07):  # (0.07, DINO's: weights of exp(14), far outside a float32 sigmoid's range)
        found = knn_map(train, labels, test, test_labels, ks=(1, 5, 20), temperature=T)
        for k in (1, 5, 20):
            scores = direct_knn_scores(train.numpy(), labels.numpy(), test.numpy(), k, T)
            for name, average in (("map", "macro"), ("map_micro", "micro")):
                want = average_precision_score(test_labels.numpy(), scores, average=average)
                assert found[k][name] == pytest.approx(want, abs=1e-6), (k, T, name)
        assert found[1] != found[20]  # the votes of more neighbours rank otherwise


def test_fewshot_of_several_labels_an_image_draws_each_classs_carriers_and_ranks_the_ridge_by_map():
    """Multi-hot labels: per class the first `shots` of a seeded permutation of the images that carry it (an image
    drawn twice taken once), the closed-form ridge on targets 2 x multi-hot - 1 (numpy, the primal form), its scores on
    the test split by scikit-learn's macro average_precision_score; named fewshot_map/ over the seeds."""
    from sklearn.metrics import average_precision_score

    g = torch.Generator().manual_seed(6)
    train, test = torch.randn(50, 5, generator=g), torch.randn(20, 5, generator=g)
    labels, test_labels = torch.randint(0, 2, (50, 3), generator=g), torch.randint(0, 2, (20, 3), generator=g)
    test_labels[0] = 1
    found = fewshot_accuracy(train, labels, test, test_labels, 3, shots=(1, 4), l2_reg=8.0, seed=2)
    for s in (1, 4):
        rng = np.random.default_rng(2)
        carriers = [rng.permutation(np.flatnonzero(labels[:, c].numpy())) for c in range(3)]
        idx = sorted({int(i) for ix in carriers for i in ix[:s]})
        x = train[idx].double().numpy()
        mean, std = x.mean(0), x.std(0) + 1e-5
        xs = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
        ridge = np.linalg.solve(xs.T @ xs + 8.0 * np.eye(6), xs.T @ (2.0 * labels[idx].numpy() - 1.0))
        scores = np.pad((test.double().numpy() - mean) / std, ((0, 0), (0, 1)), constant_values=100.0) @ ridge
        assert found[s] == pytest.approx(average_precision_score(test_labels.numpy(), scores), abs=1e-6), s
    named = fewshot_seeds(train, labels, test, test_labels, 3, shots=(1, 4), l2_reg=8.0, seeds=(0, 2))
    assert named["fewshot_map/4shot-seed-2"] == found[4] and not any(k.startswith("fewshot/") for k in named)
    assert named["fewshot_map/4shot"] == pytest.approx((named["fewshot_map/4shot-seed-0"] + found[4]) / 2)


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


def test_features_are_cached_once_resumed_and_reused(digits_ckpt, tmp_path):
    from vitlab.evaluation.features import source_id, split_features
    from vitlab.training.run import inference

    module = inference.load_for_inference(digits_ckpt)
    dm = inference.inference_datamodule(module, digits_ckpt)
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

    metrics = evaluate(compose_cfg("eval", [f"ckpt_path={digits_ckpt}", f"task={task}", "linear.iterations=20"]))
    names = {"knn": ["knn/top1_k10", "knn/top1_k200", "knn/top5_k10", "knn/top5_k200"],
             "fewshot": ["fewshot/1shot", "fewshot/25shot", "fewshot/1shot-seed-2", "fewshot/25shot_std"],
             "linear": ["linear/top1", "linear/val_top1"]}[task]  # fmt: skip
    assert all(0.0 <= metrics[n] <= 1.0 for n in names) and metrics["split"] == "test"
    assert json.loads((tmp_path / "metrics.json").read_text())[names[0]] == metrics[names[0]]


def dinov2_knn_accuracies(train, train_labels, test, test_labels, num_classes, ks, T):
    """DINOv2's eval/knn.py in one process, as written there: KnnModule's top max_k similarities and their labels,
    softmax(s / T) weights, probas summed over the first k, scored by its build_topk_accuracy_metric (torchmetrics'
    MulticlassAccuracy, top_k 1 and 5, average micro) on each k's probas."""
    from torchmetrics.classification import MulticlassAccuracy

    train, test = F.normalize(train, dim=1), F.normalize(test, dim=1)  # ModelWithNormalize
    topk_sims, indices = (test @ train.T).topk(max(ks), largest=True, sorted=True)
    neighbors_labels = torch.gather(train_labels.view(1, -1).expand(len(test), -1), 1, indices)
    matmul = F.one_hot(neighbors_labels, num_classes) * F.softmax(topk_sims / T, 1).view(len(test), -1, 1)
    out = {}
    for k in ks:
        probas = torch.sum(matmul[:, :k, :], 1)
        out[k] = {f"top{t}": MulticlassAccuracy(top_k=t, num_classes=num_classes, average="micro")(probas, test_labels)
                  .item() for t in (1, 5)}  # fmt: skip
    return out


def test_knn_top1_and_top5_are_dinov2s():
    """Top-1 and top-5 on features where the target often has few or no votes (ten overlapping classes, k down to 3,
    so the fifth place is often a tie among classes no neighbour voted for): DINOv2's numbers exactly."""
    from vitlab.evaluation.probes import knn_accuracy, knn_topk_accuracy

    train, labels, test, test_labels = clusters(10, 16, (30, 40), seed=6, spread=0.4)
    ks = (3, 10, 20, 100)
    ours = knn_topk_accuracy(train, labels, test, test_labels, 10, ks, 0.07)
    ref = dinov2_knn_accuracies(train, labels, test, test_labels, 10, ks, 0.07)
    for k in ks:  # counts of right answers over 400: equal counts are equal to float32's rounding
        assert ours[k] == pytest.approx(ref[k], abs=1e-6), (k, ours[k], ref[k])
    assert {k: v["top1"] for k, v in ours.items()} == pytest.approx(
        knn_accuracy(train, labels, test, test_labels, 10, ks)
    )
    assert all(v["top5"] > v["top1"] for v in ours.values())  # a top-5 that could not differ would prove nothing
    assert knn_topk_accuracy(train, labels % 4, test, test_labels % 4, 4, ks)[10].keys() == {"top1"}  # < 5 classes


def test_fewshot_runs_big_visions_three_seeds_each_reported_with_mean_and_std():
    """big_vision's run(): seeds 0, 1, 2, each seed's draw its own; reported per seed (its `-seed-<s>` names), their
    mean and standard deviation beside them."""
    from vitlab.evaluation.probes import fewshot_seeds

    train, labels, test, test_labels = clusters(5, 16, (30, 20), seed=7, spread=0.8)
    out = fewshot_seeds(train, labels, test, test_labels, 5, shots=(1, 5))
    each = {s: fewshot_accuracy(train, labels, test, test_labels, 5, shots=(1, 5), seed=s) for s in (0, 1, 2)}
    for shots in (1, 5):
        accs = [each[s][shots] for s in (0, 1, 2)]
        assert [out[f"fewshot/{shots}shot-seed-{s}"] for s in (0, 1, 2)] == accs
        assert out[f"fewshot/{shots}shot"] == pytest.approx(np.mean(accs))
        assert out[f"fewshot/{shots}shot_std"] == pytest.approx(np.std(accs, ddof=1))
    assert len({out[f"fewshot/1shot-seed-{s}"] for s in (0, 1, 2)}) > 1  # the seeds draw different shots
    one = fewshot_seeds(train, labels, test, test_labels, 5, shots=(1,), seeds=(4,))
    acc = fewshot_accuracy(train, labels, test, test_labels, 5, shots=(1,), seed=4)[1]
    assert one == {"fewshot/1shot-seed-4": acc, "fewshot/1shot": acc, "fewshot/1shot_std": 0.0}
