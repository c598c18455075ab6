"""Evaluations of frozen features, as the papers compute them (no training of the network):

- `knn_accuracy`: DINO's and DINOv2's weighted k-NN classifier (dinov2/eval/knn.py): L2-normalised features,
  cosine similarity to every training feature, the k most similar vote for their class with weight
  exp(similarity / T) (T = 0.07); ties go to the lowest class index (torch.argmax's first maximum);
- `linear_probe`: DINOv2's linear evaluation: a grid of learning rates, each a linear classifier trained on the
  frozen training features, the best chosen on the validation split and only it scored on the test split;
- `fewshot_accuracy`: big_vision's `fewshot_lsr` (evaluators/fewshot_lsr.py): per shot count, that many training
  images per class drawn with a seeded generator, features whitened on them, a constant bias feature of 100,
  targets one-hot in {-1, 1}, L2-regularised least squares in closed form (l2_reg 2^10), argmax.

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
    if temperature <= 0:
        raise UserError(f"knn temperature {temperature} must be > 0")
    train, test = F.normalize(train.float(), dim=1), F.normalize(test.float(), dim=1)
    top = min(max(ks), len(train))
    preds: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    for start in range(0, len(test), chunk):
        sims, idx = (test[start : start + chunk] @ train.T).topk(top, dim=1)  # sorted, most similar first
        votes = F.one_hot(train_labels[idx], num_classes).float() * (sims / temperature).exp().unsqueeze(-1)
        for k in ks:
            preds[k].append(votes[:, : min(k, top)].sum(1).argmax(1))
    return {k: torch.cat(p) for k, p in preds.items()}


def knn_accuracy(train, train_labels, test, test_labels, num_classes, ks=KNN_KS, temperature=0.07) -> dict[int, float]:
    preds = knn_predict(train, train_labels, test, num_classes, ks, temperature)
    return {k: (p == test_labels).float().mean().item() for k, p in preds.items()}


def lsr_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2_reg: float) -> tuple[torch.Tensor, ...]:
    """big_vision's L2-regularised least squares on (x, y): (weights, mean, std) in float64."""
    x = x.double()
    mean, std = x.mean(0, keepdim=True), x.std(0, unbiased=False, keepdim=True) + 1e-5
    x = F.pad((x - mean) / std, (0, 1), value=BIAS_CONSTANT)
    targets = 2.0 * F.one_hot(y, num_classes).double() - 1.0
    n, d = x.shape
    if n >= d:  # (x^T x + l2 I)^-1 x^T y
        w = torch.linalg.solve(x.T @ x + l2_reg * torch.eye(d, dtype=x.dtype), x.T @ targets)
    else:  # x^T (x x^T + l2 I)^-1 y
        w = x.T @ torch.linalg.solve(x @ x.T + l2_reg * torch.eye(n, dtype=x.dtype), targets)
    return w, mean, std


def lsr_predict(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (F.pad((x.double() - mean) / std, (0, 1), value=BIAS_CONSTANT) @ w).argmax(1)


def fewshot_accuracy(
    train, train_labels, test, test_labels, num_classes, shots=FEWSHOT_SHOTS, l2_reg=2.0**10, seed=0
) -> dict[int, float]:
    """big_vision's few-shot linear evaluation: for each shot count, the first `shots` of a seeded permutation of
    each class's training images (fewer where a class has fewer), least squares, accuracy on the test features."""
    rng = np.random.default_rng(seed)
    labels = train_labels.cpu().numpy()
    per_class = [rng.permutation(np.where(labels == c)[0]) for c in range(num_classes)]
    results = {}
    for s in shots:
        idx = torch.from_numpy(np.concatenate([ix[:s] for ix in per_class]))
        w, mean, std = lsr_fit(train[idx].cpu(), train_labels[idx].cpu(), num_classes, l2_reg)
        results[s] = (lsr_predict(test.cpu(), w, mean, std) == test_labels.cpu()).double().mean().item()
    return results


LINEAR_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)  # DINOv2's grid


def linear_probe(
    train, train_labels, val, val_labels, test, test_labels, num_classes,
    lrs=LINEAR_LRS, epochs: int = 10, batch_size: int = 256, seed: int = 0,
) -> dict:  # fmt: skip
    """DINOv2's linear evaluation on frozen features (eval/linear.py): one linear classifier per learning rate of the
    grid (SGD, momentum 0.9, no weight decay, lr scaled by batch / 256, cosine to 0), all trained on the same
    shuffles; the learning rate with the best validation accuracy is chosen, and only its test accuracy reported
    (the test split never takes part in the choice)."""
    g = torch.Generator().manual_seed(seed)
    heads = torch.nn.ModuleList(torch.nn.Linear(train.shape[1], num_classes) for _ in lrs)
    for h in heads:
        torch.nn.init.normal_(h.weight, std=0.01, generator=g), torch.nn.init.zeros_(h.bias)
    groups = [{"params": h.parameters(), "lr": lr * batch_size / 256} for h, lr in zip(heads, lrs, strict=True)]
    opt = torch.optim.SGD(groups, momentum=0.9, weight_decay=0.0)
    steps = epochs * max(1, len(train) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    train, val, test = train.float(), val.float(), test.float()
    for _ in range(epochs):
        order = torch.randperm(len(train), generator=g)
        for i in range(0, len(train) - batch_size + 1 if len(train) >= batch_size else 1, batch_size):
            idx = order[i : i + batch_size]
            loss = sum(F.cross_entropy(h(train[idx]), train_labels[idx]) for h in heads)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        val_acc = [(h(val).argmax(1) == val_labels).float().mean().item() for h in heads]
        best = int(np.argmax(val_acc))  # the first of equal bests: the smallest learning rate
        test_acc = (heads[best](test).argmax(1) == test_labels).float().mean().item()
    per_lr = dict(zip(lrs, val_acc, strict=True))
    return {"lr": lrs[best], "val_acc": val_acc[best], "test_acc": test_acc, "val_acc_per_lr": per_lr}


def linear_grid(
    views: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    train_labels, val_labels, test_labels, num_classes,
    lrs=LINEAR_LRS, epochs: int = 10, batch_size: int = 256, seed: int = 0,
) -> dict:  # fmt: skip
    """DINOv2's grid over feature configurations x learning rates (eval/linear.py: n_last_blocks x avgpool x lr):
    `views` maps a configuration's name to its (train, val, test) features; a linear_probe each, on the same
    shuffles; the (configuration, learning rate) with the best validation accuracy is chosen (the first of equals,
    in `views`' order), and only its test accuracy reported."""
    found = {name: linear_probe(tr, train_labels, va, val_labels, te, test_labels, num_classes, lrs, epochs,
                                batch_size, seed) for name, (tr, va, te) in views.items()}  # fmt: skip
    best = max(found, key=lambda name: found[name]["val_acc"])
    return found[best] | {"features": best, "val_acc_per_features": {k: v["val_acc"] for k, v in found.items()}}
