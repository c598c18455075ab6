"""Checkpoints in the layout written before objectives were objects (their hyper-parameters as 23cbadb wrote them for
a 16-wide, 1-deep digits ViT: tests/fixtures/checkpoints/hparams-2026-11-24.json; the tensors made here, no weights
in the repository) still load for eval, predict and visualize as the objective they trained, predict what the module
that wrote them predicted, and resume."""

import inspect
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers.commands import ROOT, run_cli
from vitlab.training.checkpoint_io import upgrade_hparams
from vitlab.training.module import ViTModule
from vitlab.training.objectives.classification import Classification
from vitlab.training.objectives.distillation import Distillation
from vitlab.training.objectives.mae import MAE
from vitlab.training.run.inference import load_for_inference

OLD_HPARAMS = json.loads((ROOT / "tests" / "fixtures" / "checkpoints" / "hparams-2026-11-24.json").read_text())
KINDS = {"classify": Classification, "distill": Distillation, "mae": MAE}


def _predict(module: ViTModule, kind: str):
    """What a module predicts for a fixed input: logits, or MAE's loss and mask under a fixed seed."""
    torch.manual_seed(0)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        if kind == "mae":
            torch.manual_seed(1)
            loss, _, mask = module.objective.reconstruct(module.model, x)
            return loss.item(), mask.tolist()
        return module(x)


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """kind -> (a checkpoint holding the old hyper-parameters and a state dict of the module they describe, what
    that module predicts)."""
    root, made = tmp_path_factory.mktemp("old"), {}
    takes = inspect.signature(ViTModule.__init__).parameters
    for kind, hp in OLD_HPARAMS.items():
        torch.manual_seed(0)
        module = ViTModule(**{k: v for k, v in hp.items() if k in takes} | upgrade_hparams(hp)).eval()
        path = root / f"{kind}.ckpt"
        torch.save(
            {"state_dict": module.state_dict(), "hyper_parameters": hp, "pytorch-lightning_version": L.__version__},
            path,
        )
        made[kind] = (path, _predict(module, kind))
    return made


def test_the_old_hyper_parameters_become_the_objective_they_trained():
    assert upgrade_hparams({"objective": {"name": "mae"}}) == {}  # today's: nothing to do
    hp = OLD_HPARAMS
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
def test_an_old_checkpoint_loads_and_predicts_what_it_predicted_then(old, kind):
    path, expected = old[kind]
    module = load_for_inference(str(path)).eval()
    assert type(module.objective) is KINDS[kind]
    assert module.hparams["objective"]["name"] == kind and "label_smoothing" not in module.hparams
    if kind == "mae":
        loss, mask = _predict(module, kind)
        assert loss == pytest.approx(expected[0], abs=1e-6)
        assert mask == expected[1]
    else:
        torch.testing.assert_close(_predict(module, kind), expected, atol=1e-6, rtol=0)


def test_an_old_checkpoint_is_evaluated_and_resumed_from_the_command_line(tmp_path):
    small = ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", "data.batch_size=16", "progress_bar=none"]
    limits = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    classify = ["objective.label_smoothing=0.05", "objective.mixup.mixup_alpha=0.2"]
    r = run_cli("train", *small, *limits, *classify, "trainer.max_epochs=1", "test=false",
                f"hydra.run.dir={tmp_path / 'first'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["hyper_parameters"] = OLD_HPARAMS["classify"]  # the layout of before
    torch.save(ckpt, tmp_path / "old.ckpt")

    evaluated = []
    for name in ("first/checkpoints/last.ckpt", "old.ckpt"):  # the run's own checkpoint, then its old layout
        out = tmp_path / f"eval{len(evaluated)}"
        r = run_cli("eval", f"ckpt_path={tmp_path / name}", f"hydra.run.dir={out}")
        assert r.returncode == 0, r.stderr[-3000:]
        evaluated.append({k: v for k, v in json.loads((out / "metrics.json").read_text()).items() if "/" in k})
    assert evaluated[0] == evaluated[1] and {"test/acc", "test/loss"} <= evaluated[0].keys()  # every number alike
    r = run_cli(
        "train",
        *small,
        "trainer.max_epochs=2",
        *limits,
        f"ckpt_path={tmp_path / 'old.ckpt'}",
        f"hydra.run.dir={tmp_path / 'resumed'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (1, 4)  # the old epoch's 2 steps, then 2 more
    assert last["hyper_parameters"]["objective"]["name"] == "classify" and "rank_states" in last
