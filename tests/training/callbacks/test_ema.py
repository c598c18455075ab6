"""training/callbacks/ema.py's average (CountedAverage): it keeps the module's frozen tensors and hyper-parameters as
they are rather than copying them, and averages the rest (issue 75: a LoRA run held its frozen base twice)."""

import lightning as L
import torch
from torch import nn

from vitlab.training.callbacks.ema import CountedAverage


class Adapted(L.LightningModule):
    """A frozen base and a trainable head, with hyper-parameters (a run's config)."""

    def __init__(self, config: dict):
        super().__init__()
        self.save_hyperparameters()
        self.base, self.head = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 2)


def halfway(averaged, current, n) -> None:
    torch._foreach_lerp_(list(averaged), list(current), 0.5)


def test_the_average_shares_the_frozen_tensors_and_averages_the_rest():
    torch.manual_seed(0)
    module = Adapted({"model": {"embed_dim": 4}})
    average = CountedAverage(module, share=True, multi_avg_fn=halfway, use_buffers=True)
    copied = average.module
    assert copied.base.weight is module.base.weight and copied.base.bias is module.base.bias
    assert copied.hparams is module.hparams
    assert copied.head.weight is not module.head.weight
    average.update_parameters(module)  # the first update copies
    with torch.no_grad():
        module.head.weight.add_(1.0)
    average.update_parameters(module)
    torch.testing.assert_close(copied.head.weight, module.head.weight - 0.5)
    assert copied.base.weight is module.base.weight
    unshared = CountedAverage(module, multi_avg_fn=halfway).module  # (another device than the module's: copied)
    assert unshared.base.weight is not module.base.weight and torch.equal(unshared.base.weight, module.base.weight)
