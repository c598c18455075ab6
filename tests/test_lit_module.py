import pytest
import torch

from tests.helpers import tiny
from vitlab.lit_module import ViTModule
from vitlab.optim import param_groups


def test_module_rejects_unknown_optim_keys_and_keeps_plain_hparams():
    with pytest.raises(ValueError, match=r"unknown optim key\(s\) \['momentum'\]"):
        ViTModule(model=tiny().to_dict(), optim={"momentum": 0.9})
    m = ViTModule(model=tiny().to_dict(), optim={"lr": 3e-4}, mixup={"mixup_alpha": 0.2})
    assert m.hparams["optim"] == {"lr": 3e-4} and m.optim.weight_decay == 0.05


def test_mixup_gives_soft_targets_and_training_step_runs():
    torch.manual_seed(0)
    m = ViTModule(model=tiny().to_dict(), mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0})
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    mixed_x, soft = m.mixup(x, y)
    assert soft.shape == (4, 7) and torch.allclose(soft.sum(1), torch.ones(4))
    assert not torch.equal(mixed_x, x)


def test_linear_probe_trains_only_the_head():
    m = ViTModule(model=tiny(global_pool="avg").to_dict(), freeze_backbone=True)
    names = {n for g in param_groups(m.model, 1e-3, 0.05) for n in g["names"]}
    assert names == {"head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"}


def test_checkpoint_without_metric_states_loads_but_weights_stay_strict(tmp_path):
    import lightning

    from vitlab.run import load_for_inference as load_checkpoint

    m = ViTModule(model=tiny().to_dict())
    weights = {k: v for k, v in m.state_dict().items() if k.startswith("model.")}
    ckpt = {
        "state_dict": weights,
        "hyper_parameters": dict(m.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    torch.save(ckpt, tmp_path / "old.ckpt")
    loaded = load_checkpoint(str(tmp_path / "old.ckpt"))
    assert torch.equal(loaded.model.head.weight, m.model.head.weight)
    del weights["model.head.bias"]
    torch.save(ckpt, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match="model.head.bias"):
        load_checkpoint(str(tmp_path / "broken.ckpt"))
