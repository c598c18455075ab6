"""The three references' evaluation code, on features already extracted, as their files write it (only the device,
the distributed wrappers and the data loaders left out), so that the study can hold ours against them:

- `dino_knn`: facebookresearch/dino eval_knn.py `knn_classifier` (line for line; DINOv2's eval/knn.py gives the
  same top-1, its top-5 breaks ties otherwise);
- `dinov2_linear`: facebookresearch/dinov2 eval/linear.py: `setup_linear_classifiers` (one LinearClassifier per
  (n_last_blocks, avgpool, lr), init N(0, 0.01), lr x batch x world / 256), `run_eval_linear`'s SGD(momentum 0.9,
  wd 0) and CosineAnnealingLR(max_iter = epochs x epoch_length, eta_min 0), `eval_linear`'s loop over an infinite
  shuffled sampler (SamplerType.SHARDED_INFINITE: a new permutation every pass), `evaluate_linear_classifiers`'
  choice (the first classifier whose top-1 is strictly higher). DINOv2 computes features from augmented images each
  step; here, as in the probe of cached features, they are the fixed eval features;
- `big_vision_fewshot`: google-research/big_vision evaluators/fewshot_lsr.py `_precompute_cache`,
  `_eig_fewshot_acc_fn`, `compute_fewshot_metrics` and `run`'s seeds (numpy for jax).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

BIAS_CONSTANT = 100.0
DINOV2_LRS = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1]


def dino_knn(train_features, train_labels, test_features, test_labels, k, T, num_classes=1000):
    """eval_knn.py's knn_classifier: (top1, top5) in percent. Features L2-normalised by the caller, as
    eval_knn.py's extract_features does."""
    top1, top5, total = 0.0, 0.0, 0
    train_features = train_features.t()
    num_test_images, num_chunks = test_labels.shape[0], 100
    imgs_per_chunk = max(1, num_test_images // num_chunks)
    retrieval_one_hot = torch.zeros(k, num_classes).to(train_features.device)
    for idx in range(0, num_test_images, imgs_per_chunk):
        features = test_features[idx : min((idx + imgs_per_chunk), num_test_images), :]
        targets = test_labels[idx : min((idx + imgs_per_chunk), num_test_images)]
        batch_size = targets.shape[0]
        similarity = torch.mm(features, train_features)
        distances, indices = similarity.topk(k, largest=True, sorted=True)
        candidates = train_labels.view(1, -1).expand(batch_size, -1)
        retrieved_neighbors = torch.gather(candidates, 1, indices)
        retrieval_one_hot.resize_(batch_size * k, num_classes).zero_()
        retrieval_one_hot.scatter_(1, retrieved_neighbors.view(-1, 1), 1)
        distances_transform = distances.clone().div_(T).exp_()
        probs = torch.sum(
            torch.mul(retrieval_one_hot.view(batch_size, -1, num_classes), distances_transform.view(batch_size, -1, 1)),
            1,
        )
        _, predictions = probs.sort(1, True)
        correct = predictions.eq(targets.data.view(-1, 1))
        top1 = top1 + correct.narrow(1, 0, 1).sum().item()
        top5 = top5 + correct.narrow(1, 0, min(5, k)).sum().item()
        total += targets.size(0)
    return top1 * 100.0 / total, top5 * 100.0 / total


def dinov2_linear(views, train_y, val_y, test_y, num_classes, epochs=10, epoch_length=1250, batch_size=128, world=1,
                  learning_rates=DINOV2_LRS, seed=0):  # fmt: skip
    """eval/linear.py on fixed features: `views` maps a feature configuration ('last1', 'last4+avgpool', ...) to
    its (train, val, test) tensors. Returns the classifier chosen on val and its val and test top-1."""
    torch.manual_seed(seed)
    classifiers, groups = nn.ModuleDict(), []
    for name, (train, _, _) in views.items():
        for lr in learning_rates:
            lr = lr * (batch_size * world) / 256.0  # scale_lr
            linear = nn.Linear(train.shape[1], num_classes)
            linear.weight.data.normal_(mean=0.0, std=0.01)
            linear.bias.data.zero_()
            key = f"classifier_{name}_lr_{lr:.5f}".replace(".", "_").replace("+", "_")
            classifiers[key] = linear
            groups.append({"params": linear.parameters(), "lr": lr})
    source = {key: next(v for n, v in views.items() if key.startswith(f"classifier_{n.replace('+', '_')}_lr"))
              for key in classifiers}  # fmt: skip
    optimizer = torch.optim.SGD(groups, momentum=0.9, weight_decay=0)
    max_iter = epochs * epoch_length
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max_iter, eta_min=0)
    g = torch.Generator().manual_seed(seed)
    stream = _infinite(len(train_y), batch_size, g)
    for _ in range(max_iter):
        idx = next(stream)
        losses = [nn.CrossEntropyLoss()(c(source[k][0][idx]), train_y[idx]) for k, c in classifiers.items()]
        optimizer.zero_grad()
        sum(losses).backward()
        optimizer.step()
        scheduler.step()
    with torch.no_grad():
        val = {k: (c(source[k][1]).argmax(1) == val_y).float().mean().item() for k, c in classifiers.items()}
        best, best_acc = "", 0.0
        for k, acc in val.items():  # evaluate_linear_classifiers: strictly higher replaces
            if acc > best_acc:
                best, best_acc = k, acc
        test = (classifiers[best](source[best][2]).argmax(1) == test_y).float().mean().item()
    return {"classifier": best, "val_top1": best_acc, "test_top1": test}


def _infinite(n, batch_size, g):
    """SHARDED_INFINITE with one process: a fresh permutation each pass, batches taken across pass boundaries."""
    buffer = torch.empty(0, dtype=torch.long)
    while True:
        while len(buffer) < batch_size:
            buffer = torch.cat([buffer, torch.randperm(n, generator=g)])
        yield buffer[:batch_size]
        buffer = buffer[batch_size:]


def _precompute_cache(x, y, num_classes):
    mean = np.mean(x, axis=0, keepdims=True)
    std = np.std(x, axis=0, keepdims=True) + 1e-5
    x = (x - mean) / std
    x = np.pad(x, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)
    y = 2.0 * np.eye(num_classes)[y] - 1.0
    num_points, dim = x.shape
    if num_points >= dim:
        eigs, q = np.linalg.eigh(x.T @ x)
        rhs, lhs = q.T @ (x.T @ y), q
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        rhs, lhs = q.T @ y, x.T @ q
    return {"eigs": eigs, "rhs": rhs, "lhs": lhs, "mean": mean, "std": std}


def _eig_fewshot_acc_fn(cache, x_test, y_test, l2_reg):
    x_test = (x_test - cache["mean"]) / cache["std"]
    x_test = np.pad(x_test, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)
    scaling = (1.0 / (cache["eigs"] + l2_reg * np.ones_like(cache["eigs"]))).reshape((1, -1))
    w = (cache["lhs"] * scaling) @ cache["rhs"]
    return float(np.mean(np.argmax(x_test @ w, axis=1) == y_test))


def big_vision_fewshot(repr_train, labels_train, repr_test, labels_test, num_classes, shots=(1, 5, 10, 25),
                       l2_reg=2.0**10, num_seeds=3):  # fmt: skip
    """{f'{shots}shot-seed-{seed}': accuracy} as fewshot_lsr.py's Evaluator.run yields them (float64 here)."""
    results = {}
    for seed in range(num_seeds):
        rng = np.random.default_rng(seed)
        class_indices = [rng.permutation(np.where(labels_train == c)[0]) for c in range(num_classes)]
        for s in shots:
            all_idx = np.concatenate([indices[:s] for indices in class_indices], axis=0)
            cache = _precompute_cache(repr_train[all_idx].astype(np.float64), labels_train[all_idx], num_classes)
            results[f"{s}shot-seed-{seed}"] = _eig_fewshot_acc_fn(cache, repr_test, labels_test, l2_reg)
    return results
