"""On a CUDA GPU (skipped elsewhere): a bf16-mixed training step of the module, as trainer=gpu runs it."""

import pytest
import torch

from tests.helpers import tiny
from vitlab.lit_module import ViTModule
from vitlab.optim import OptimConfig, make_optimizer

pytestmark = pytest.mark.gpu


def test_bf16_autocast_training_step_lowers_the_loss():
    torch.manual_seed(0)
    module = ViTModule(model=tiny().to_dict(), optim={"warmup_epochs": 0}).cuda()
    optimizer = make_optimizer(module.model, OptimConfig(lr=3e-3, warmup_epochs=0))
    x, y = torch.randn(16, 3, 32, 32, device="cuda"), torch.randint(0, 7, (16,), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, logits = module.loss(x, y)
        assert logits.dtype == torch.bfloat16
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32
    assert losses[-1] < 0.5 * losses[0]
