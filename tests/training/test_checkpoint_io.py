"""Checkpoints written before objectives were objects (tests/fixtures/checkpoints, made by 23cbadb with a 16-wide,
1-deep digits ViT) still load for eval, predict and visualize, predict exactly what they predicted then, and resume."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, run_cli
from vitlab.training.build import load_for_inference
from vitlab.training.checkpoint_io import upgrade_hparams
from vitlab.training.classification import Classification
from vitlab.training.distillation import Distillation
from vitlab.training.mae import MAE

FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
EXPECTED = json.loads((FIXTURES / "expected-2026-11-24.json").read_text())
KINDS = {"classify": Classification, "distill": Distillation, "mae": MAE}


def old(kind: str) -> Path:
    return FIXTURES / f"{kind}-2026-11-24.ckpt"


def test_the_old_hyper_parameters_become_the_objective_they_trained():
    assert upgrade_hparams({"objective": {"name": "mae"}}) == {}  # today's: nothing to do
    hp = {k: torch.load(old(k), weights_only=True)["hyper_parameters"] for k in KINDS}
    assert upgrade_hparams(hp["classify"])["objective"] == {
        "name": "classify",
        "label_smoothing": 0.05,
        "loss": "ce",
        "bce_target_thresh": None,
        "mixup": hp["classify"]["mixup"],
    }
    distill = upgrade_hparams(hp["distill"])["objective"]
    assert (distill["name"], distill["type"], distill["loss"]) == ("distill", "soft", "bce")
    assert upgrade_hparams(hp["mae"])["objective"] == {"name": "mae", **hp["mae"]["mae"]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_old_checkpoint_loads_and_predicts_what_it_predicted_then(kind):
    module = load_for_inference(str(old(kind))).eval()
    assert type(module.objective) is KINDS[kind]
    assert module.hparams["objective"]["name"] == kind and "label_smoothing" not in module.hparams
    torch.manual_seed(0)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        if kind == "mae":
            torch.manual_seed(1)
            loss, _, mask = module.objective.reconstruct(module.model, x)
            assert loss.item() == pytest.approx(EXPECTED["mae"]["loss"], abs=1e-6)
            assert mask.tolist() == EXPECTED["mae"]["mask"]
        else:
            torch.testing.assert_close(module(x), torch.tensor(EXPECTED[kind]["logits"]), atol=1e-6, rtol=0)


def test_an_old_checkpoint_is_evaluated_and_resumed_from_the_command_line(tmp_path):
    r = run_cli("eval", f"ckpt_path={old('classify')}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0.0 <= json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"] <= 1.0
    small = ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", "data.batch_size=16", "progress_bar=none"]
    r = run_cli(
        "train",
        *small,
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        f"ckpt_path={old('classify')}",
        f"hydra.run.dir={tmp_path / 'resumed'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (1, 4)  # the old epoch's 2 steps, then 2 more
    assert last["hyper_parameters"]["objective"]["name"] == "classify" and "rank_states" in last
