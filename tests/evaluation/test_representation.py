"""callbacks=representation: k-NN and few-shot accuracy of the features being trained, logged every few epochs and
equal to what vitlab.evaluation.probes computes on the same features."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from vitlab.evaluation.representation import RepresentationProbe


def test_a_run_logs_knn_and_fewshot_of_its_features(compose_cfg, tmp_path):
    from vitlab.train import train

    probe = ["every_n_epochs=1", "max_train_images=500", "knn_k=[20,5]"]
    cfg = compose_cfg(
        "train", ["debug=limit", "progress_bar=none", "callbacks=representation"]
        + [f"callbacks.representation.{o}" for o in probe]
    )  # fmt: skip
    train(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"knn/top1", "knn/top1_k20", "knn/top1_k5", "fewshot/10shot"} <= metrics.keys()
    expected = _probes_of(tmp_path / "checkpoints" / "last.ckpt", 500, ks=(20, 5), shots=(10,))
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert metrics["knn/top1"] == metrics["knn/top1_k20"]
    rows = (tmp_path / "csv").rglob("metrics.csv")
    assert any("knn/top1" in p.read_text().splitlines()[0] for p in rows)  # logged per epoch, beside val/acc


def test_the_training_split_is_cut_to_a_seeded_subset():
    from vitlab.data.digits import DigitsDataModule
    from vitlab.evaluation.representation import _Limited

    dm = DigitsDataModule(img_size=8, batch_size=64)
    dm.setup("fit")
    a = _Limited(dm, 100, seed=0).eval_view("train")
    b = _Limited(dm, 100, seed=0).eval_view("train")
    assert len(a) == 100 and a.indices == b.indices and set(a.indices) <= set(dm.train_set.indices)
    assert len(_Limited(dm, None, seed=0).eval_view("train")) == len(dm.train_set)
    assert RepresentationProbe(every_n_epochs=2).every == 2


def test_a_ddp_run_gathers_its_features_and_every_rank_logs_rank_0s_numbers(tmp_path):
    """trainer=ddp_cpu: each process extracts half of the images, rank 0 scores and hands the numbers on (a rank
    that missed the gather would stall the run; one that logged others would show in its own metrics)."""
    from tests.helpers.commands import run_cli

    probe = ["every_n_epochs=1", "max_train_images=301", "knn_k=[5]", "shots=[2]"]
    r = run_cli(
        "train", "trainer=ddp_cpu", "debug=limit", "progress_bar=none", "callbacks=representation",
        *[f"callbacks.representation.{o}" for o in probe], f"hydra.run.dir={tmp_path}",
        "+callbacks.ranks._target_=tests.evaluation.test_representation.LoggedPerRank",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    expected = _probes_of(tmp_path / "checkpoints" / "last.ckpt", 301, ks=(5,), shots=(2,))  # on one process
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    per_rank = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("representation_rank*.json"))]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1] and per_rank[0]["knn/top1"] == metrics["knn/top1"]


def _probes_of(ckpt: Path, max_train: int, ks, shots) -> dict[str, float]:
    """k-NN and few-shot accuracy on the validation split of the weights `ckpt` holds (the last epoch's, which the
    probe measured last), computed here with vitlab.evaluation's extraction and classifiers, the bank a seeded
    `max_train` of the training split."""
    from vitlab.evaluation.features import split_features
    from vitlab.evaluation.probes import fewshot_accuracy, knn_accuracy
    from vitlab.evaluation.representation import _Limited
    from vitlab.training.run.inference import inference_datamodule, load_for_inference

    module = load_for_inference(str(ckpt)).eval()
    dm = inference_datamodule(module, str(ckpt))
    dm.setup("fit")
    cpu = torch.device("cpu")
    train, train_y = split_features(module.model, _Limited(dm, max_train, 0), "train", cpu, None, {})
    val, val_y = split_features(module.model, dm, "val", cpu, None, {})
    knn = knn_accuracy(train, train_y, val, val_y, dm.num_classes, ks, 0.07)
    few = fewshot_accuracy(train, train_y, val, val_y, dm.num_classes, shots, 2.0**10, 0)
    return {f"knn/top1_k{k}": v for k, v in knn.items()} | {f"fewshot/{n}shot": v for n, v in few.items()}


class LoggedPerRank(L.Callback):
    """Writes what this rank logged of the representation at the end of training (representation_rank<r>.json)."""

    def on_train_end(self, trainer, pl_module):
        logged = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith(("knn/", "fewshot/"))}
        out = Path(trainer.default_root_dir) / f"representation_rank{trainer.global_rank}.json"
        out.write_text(json.dumps(logged))
