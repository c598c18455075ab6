"""DINOv2's linear evaluation written out as dinov2/eval/linear.py runs it, for tests/evaluation/test_linear.py to
hold vitlab.evaluation.linear to: its ShardedInfiniteSampler (data/samplers.py, the default shuffle, an element at a
time), one nn.Linear per (n_last_blocks, avgpool, lr) in its classifiers_dict order, initialised N(0, 0.01) / 0 from
the global generator, torch.optim.SGD with a parameter group per head, CosineAnnealingLR, and the first head with
the strictly best validation accuracy. Only the feature extraction is left out: it reads features already made."""

import itertools

import numpy as np
import torch
from torch import nn


def _shuffle_tensor_slice(*, tensor, start=0, step=1, generator):  # samplers.py, as written there
    stop = len(tensor)
    count = stop // step
    result = np.empty(count, dtype=np.int32 if stop <= 2**31 else np.int64)
    for i in range(count):
        j = torch.randint(0, i + 1, size=(1,), generator=generator).item() if i > 0 else 0
        result[i] = result[j]
        result[j] = tensor[start + i * step].item()
    return result


def _new_shuffle_tensor_slice(*, tensor, start=0, step=1, generator):  # samplers.py: SHARDED_INFINITE_NEW
    count = len(tensor) // step
    indices = torch.randperm(count, dtype=torch.int64, generator=generator)
    return tensor[start::step][indices].numpy()


def sharded_infinite_sampler(sample_count, seed=0, start=0, step=1, new=False):
    """ShardedInfiniteSampler(shuffle=True)'s _shuffled_iterator."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    perm = torch.randperm(
        sample_count, dtype=torch.int32 if sample_count <= 2**31 else torch.int64, generator=generator
    )
    iter_count = 0
    while True:
        generator.manual_seed(seed + start + (iter_count << 24))
        fn = _new_shuffle_tensor_slice if new else _shuffle_tensor_slice
        yield from fn(tensor=perm, start=start, step=step, generator=generator)
        iter_count += 1


def create_linear_input(feats, width, use_n_blocks, use_avgpool):
    """linear.py's create_linear_input on features [class tokens of the last blocks..., mean patch token]."""
    blocks = feats[:, : feats.shape[1] - width].reshape(len(feats), -1, width)
    output = blocks[:, -use_n_blocks:].flatten(1)
    if use_avgpool:
        output = torch.cat((output, feats[:, -width:]), dim=-1)
    return output.float()


def run(train, train_y, val, val_y, test, test_y, width, num_classes, learning_rates, max_iter, batch_size=128,
        n_last_blocks_list=(1, 4), new_sampler=False, init=None):  # fmt: skip
    """(the chosen classifier's name, its val accuracy, its test accuracy, every classifier trained in their order of
    creation); one process (global size 1). `init`: each classifier's (weight, bias) to start from instead of its
    own draw (the draws are from the global generator, which nn.Linear's default init also draws from)."""
    torch.manual_seed(0)
    classifiers, groups, trained = nn.ModuleDict(), [], []
    for n in n_last_blocks_list:
        for avgpool in [False, True]:
            for _lr in learning_rates:
                lr = _lr * (batch_size * 1) / 256.0  # scale_lr
                out_dim = create_linear_input(train[:1], width, n, avgpool).shape[1]
                linear = nn.Linear(out_dim, num_classes)
                linear.weight.data.normal_(mean=0.0, std=0.01)
                linear.bias.data.zero_()
                # At one process lr 1e-5 and 2e-5 scale to 5e-6 and 1e-5, one name at 5 decimals: the second
                # classifier takes the first's place in the dict (the first still trains in its parameter group, and
                # is never scored), as in DINOv2.
                classifiers[f"classifier_{n}_blocks_avgpool_{avgpool}_lr_{lr:.5f}".replace(".", "_")] = linear
                groups.append({"params": linear.parameters(), "lr": lr})
                if init is not None:
                    linear.weight.data.copy_(init[len(trained)][0]), linear.bias.data.copy_(init[len(trained)][1])
                trained.append((linear, (n, avgpool)))
    setup = {id(c): s for c, s in trained}
    optimizer = torch.optim.SGD(groups, momentum=0.9, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max_iter, eta_min=0)
    sampler = sharded_infinite_sampler(len(train), new=new_sampler)
    for _ in range(max_iter):
        idx = torch.from_numpy(np.fromiter(itertools.islice(sampler, batch_size), dtype=np.int64))  # drop_last
        data, labels = train[idx], train_y[idx]
        outputs = [c(create_linear_input(data, width, *s)) for c, s in trained]
        loss = sum(nn.CrossEntropyLoss()(v, labels) for v in outputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    with torch.no_grad():

        def accuracy(k, x, y):
            c = classifiers[k]
            return (c(create_linear_input(x, width, *setup[id(c)])).argmax(1) == y).float().mean().item()

        best, max_accuracy = "", 0
        for k in classifiers:  # evaluate_linear_classifiers: strictly better only
            if (acc := accuracy(k, val, val_y)) > max_accuracy:
                best, max_accuracy = k, acc
        return best, max_accuracy, accuracy(best, test, test_y), [c for c, _ in trained]
