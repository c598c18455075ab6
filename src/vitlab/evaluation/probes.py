"""Evaluations of frozen features, as the papers compute them (no training of the network):

- `knn_accuracy`: DINO's and DINOv2's weighted k-NN classifier (dinov2/eval/knn.py): L2-normalised features,
  cosine similarity to every training feature, the k most similar vote for their class with weight
  exp(similarity / T) (T = 0.07); ties go to the lowest class index (torch.argmax's first maximum);
  `knn_topk_accuracy` also top-5, as DINOv2 reports it (torchmetrics' top-k accuracy: the target among
  torch.topk's 5 classes of the votes); `knn_map` for several labels an image: a class's score the share of the
  neighbours' weight that carries it, mAP (macro and micro) on them;
- `fewshot_accuracy`: big_vision's `fewshot_lsr` (evaluators/fewshot_lsr.py): per shot count, that many training
  images per class drawn with a seeded generator, features whitened on them, a constant bias feature of 100,
  targets one-hot in {-1, 1}, L2-regularised least squares in closed form (l2_reg 2^10), argmax; `fewshot_seeds`
  over big_vision's 3 seeds (num_seeds), each reported, with their mean and standard deviation; several labels an
  image: each class's images those that carry it, targets 2 x multi-hot - 1, mAP (`fewshot_map/...`).

DINOv2's linear probe is `vitlab.evaluation.linear`.

Plain torch on tensors (features from `vitlab.evaluation.features`); no Lightning, no Hydra.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.utils.errors import UserError

KNN_KS = (10, 20, 100, 200)  # DINOv2's nb_knn
FEWSHOT_SHOTS = (1, 5, 10, 25)  # big_vision's common_fewshot
BIAS_CONSTANT = 100.0  # big_vision: large, so the bias is almost unregularised


def _votes(train, train_labels, test, num_classes: int, ks: Sequence[int], temperature: float, chunk: int,
           total: bool = False):  # fmt: skip
    """For each chunk of `test`, {k: (chunk, C) votes}: the labels of its k nearest training features by cosine
    similarity, each weighted exp(similarity / T) and summed. A label is a class index (one-hot), or a multi-hot row
    (several labels an image). k larger than the training set is capped at its size. `total`: {k: (votes, (chunk, 1)
    the neighbours' summed weight)}, both float64."""
    if temperature <= 0:
        raise UserError(f"knn temperature {temperature} must be > 0")
    train, test = F.normalize(train.float(), dim=1), F.normalize(test.float(), dim=1)
    top = min(max(ks), len(train))
    for start in range(0, len(test), chunk):
        sims, idx = (test[start : start + chunk] @ train.T).topk(top, dim=1)  # sorted, most similar first
        found = train_labels[idx]
        found = found.float() if train_labels.ndim == 2 else F.one_hot(found, num_classes).float()
        weights = (sims / temperature).exp().unsqueeze(-1)
        votes = found * weights
        if total:  # summed one neighbour after the other, in float64: a class all k carry has a share of exactly 1
            cum, weight = votes.double().cumsum(1), weights.double().cumsum(1)
            yield {k: (cum[:, min(k, top) - 1], weight[:, min(k, top) - 1]) for k in ks}
        else:
            yield {k: votes[:, : min(k, top)].sum(1) for k in ks}


@torch.no_grad()
def knn_predict(
    train: torch.Tensor,
    train_labels: torch.Tensor,
    test: torch.Tensor,
    num_classes: int,
    ks: Sequence[int] = KNN_KS,
    temperature: float = 0.07,
    chunk: int = 1024,
) -> dict[int, torch.Tensor]:
    """The predicted class of each test feature, per k: the temperature-weighted vote of its k nearest training
    features by cosine similarity. k larger than the training set is capped at its size."""
    preds: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for summed in _votes(train, train_labels, test, num_classes, ks, temperature, chunk):
        for k in ks:
            preds[k].append(summed[k].argmax(1))
    return {k: torch.cat(p) for k, p in preds.items()}


def knn_accuracy(train, train_labels, test, test_labels, num_classes, ks=KNN_KS, temperature=0.07) -> dict[int, float]:
    """Top-1 accuracy of `knn_predict`'s weighted vote on `test`, for each k of `ks`."""
    preds = knn_predict(train, train_labels, test, num_classes, ks, temperature)
    return {k: (p == test_labels).float().mean().item() for k, p in preds.items()}


@torch.no_grad()
def knn_topk_accuracy(
    train, train_labels, test, test_labels, num_classes: int, ks=KNN_KS, temperature: float = 0.07, chunk: int = 1024
) -> dict[int, dict[str, float]]:
    """{k: {"top1": ..., "top5": ...}}: top-1 as `knn_accuracy`; top-5 as DINOv2's knn.py scores it, torchmetrics'
    MulticlassAccuracy(top_k=5) on the votes: right where the target is among torch.topk(votes, 5)'s classes (ties
    at the fifth place, classes no neighbour voted for among them, go as torch.topk leaves them; DINO's eval_knn.py
    sorts votes padded to 1,000 classes and may break them otherwise). Data of fewer than 5 classes: top-1 only (as
    torchmetrics refuses top_k > classes)."""
    tops = (1, 5) if num_classes >= 5 else (1,)
    right = {k: dict.fromkeys(tops, 0) for k in ks}
    votes = _votes(train, train_labels, test, num_classes, ks, temperature, chunk)
    for start, summed in zip(range(0, len(test), chunk), votes, strict=True):
        target = test_labels[start : start + chunk, None]
        for k in ks:
            right[k][1] += int((summed[k].argmax(1, keepdim=True) == target).sum())
            if 5 in tops:
                right[k][5] += int((summed[k].topk(5, dim=1).indices == target).any(1).sum())
    return {k: {f"top{t}": n / len(test) for t, n in r.items()} for k, r in right.items()}


@torch.no_grad()
def knn_map(train, train_labels, test, test_labels, ks=KNN_KS, temperature: float = 0.07, chunk: int = 1024):
    """Several labels an image ((N, C) multi-hot rows): a test image's score for a class is the share of its k
    nearest training images' weight (exp(similarity / T), as `knn_predict` weighs votes) that carry that class;
    {k: {"map": mAP over the classes, "map_micro": over every (image, class) pair}} (`average_precision`)."""
    num_classes = train_labels.shape[1]
    scores: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for summed in _votes(train, train_labels, test, num_classes, ks, temperature, chunk, total=True):
        for k in ks:
            votes, weight = summed[k]
            scores[k].append(votes / weight)
    out = {}
    for k, parts in scores.items():
        found = torch.cat(parts)
        macro, micro = average_precision(found, test_labels), average_precision(found, test_labels, "micro")
        out[k] = {"map": macro, "map_micro": micro}
    return out


def average_precision(scores: torch.Tensor, labels: torch.Tensor, average: str = "macro") -> float:
    """torchmetrics' multi-label average precision (`average`: macro, over the classes; micro, over every (image,
    class) pair) of any real scores, the same number as scikit-learn's average_precision_score: the scores are
    first mapped into [0, 1] by one increasing map in float64 (torchmetrics would put scores outside [0, 1] through a
    float32 sigmoid, where scores above about 17 all become 1.0 and tie)."""
    from torchmetrics.functional.classification import multilabel_average_precision

    x = scores.double()
    span = (x.max() - x.min()).clamp_min(torch.finfo(torch.float64).tiny)
    return multilabel_average_precision((x - x.min()) / span, labels.long(), labels.shape[1], average=average).item()


def lsr_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2_reg: float) -> tuple[torch.Tensor, ...]:
    """big_vision's L2-regularised least squares on (x, y): (weights, mean, std) in float64."""
    x = x.double()
    mean, std = x.mean(0, keepdim=True), x.std(0, unbiased=False, keepdim=True) + 1e-5
    x = F.pad((x - mean) / std, (0, 1), value=BIAS_CONSTANT)
    targets = 2.0 * (y.double() if y.ndim == 2 else F.one_hot(y, num_classes).double()) - 1.0  # (or multi-hot rows)
    n, d = x.shape
    if n >= d:  # (x^T x + l2 I)^-1 x^T y
        w = torch.linalg.solve(x.T @ x + l2_reg * torch.eye(d, dtype=x.dtype), x.T @ targets)
    else:  # x^T (x x^T + l2 I)^-1 y
        w = x.T @ torch.linalg.solve(x @ x.T + l2_reg * torch.eye(n, dtype=x.dtype), targets)
    return w, mean, std


def lsr_scores(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Each row of `x` (whitened by the few-shot set's `mean`, `std`) through `lsr_fit`'s ridge solution `w`: a score
    a class."""
    return F.pad((x.double() - mean) / std, (0, 1), value=BIAS_CONSTANT) @ w


def lsr_predict(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The class `lsr_fit`'s ridge solution `w` gives each row of `x` (whitened by the few-shot set's `mean`, `std`)."""
    return lsr_scores(x, w, mean, std).argmax(1)


def fewshot_accuracy(
    train, train_labels, test, test_labels, num_classes, shots=FEWSHOT_SHOTS, l2_reg=2.0**10, seed=0
) -> dict[int, float]:
    """big_vision's few-shot linear evaluation: for each shot count, the first `shots` of a seeded permutation of
    each class's training images (fewer where a class has fewer), least squares, accuracy on the test features.
    Several labels an image (multi-hot rows, which big_vision does not evaluate): a class's images are those that
    carry it (an image drawn for two classes is taken once), the targets 2 x multi-hot - 1, and the ridge's scores are
    ranked by mAP over the classes (`average_precision`) in place of accuracy."""
    rng = np.random.default_rng(seed)
    labels = train_labels.cpu().numpy()
    several = labels.ndim == 2
    carries = [labels[:, c] == 1 if several else labels == c for c in range(num_classes)]
    per_class = [rng.permutation(np.where(carry)[0]) for carry in carries]
    results = {}
    for s in shots:
        drawn = np.concatenate([ix[:s] for ix in per_class])
        idx = torch.from_numpy(np.unique(drawn) if several else drawn)
        w, mean, std = lsr_fit(train[idx].cpu(), train_labels[idx].cpu(), num_classes, l2_reg)
        scores = lsr_scores(test.cpu(), w, mean, std)
        if several:
            results[s] = average_precision(scores, test_labels.cpu())
        else:
            results[s] = (scores.argmax(1) == test_labels.cpu()).double().mean().item()
    return results


FEWSHOT_SEEDS = (0, 1, 2)  # big_vision's num_seeds=3: range(3)


def fewshot_seeds(
    train, train_labels, test, test_labels, num_classes, shots=FEWSHOT_SHOTS, l2_reg=2.0**10, seeds=FEWSHOT_SEEDS
) -> dict[str, float]:
    """big_vision's few-shot evaluation over `seeds`: each seed's accuracy per shot count, named as big_vision's
    run() names them (`fewshot/<shots>shot-seed-<seed>`), then their mean (`fewshot/<shots>shot`) and sample
    standard deviation (`fewshot/<shots>shot_std`, ddof 1; 0 for one seed): the draw of the few images moves the
    score by points at 1 and 5 shots."""
    per_seed = {seed: fewshot_accuracy(train, train_labels, test, test_labels, num_classes, shots, l2_reg, seed)
                for seed in seeds}  # fmt: skip
    name = "fewshot_map" if train_labels.ndim == 2 else "fewshot"  # several labels an image: mAP (fewshot_accuracy)
    out = {f"{name}/{s}shot-seed-{seed}": acc[s] for seed, acc in per_seed.items() for s in shots}
    for s in shots:
        accs = np.array([acc[s] for acc in per_seed.values()])
        out[f"{name}/{s}shot"] = float(accs.mean())
        out[f"{name}/{s}shot_std"] = float(accs.std(ddof=1)) if len(accs) > 1 else 0.0
    return out
