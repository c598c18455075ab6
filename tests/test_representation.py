"""callbacks=representation: k-NN and few-shot accuracy of the features being trained, logged every few epochs and
equal to what vitlab.probes computes on the same features."""

import json

import torch

from vitlab.representation import RepresentationProbe


def test_a_run_logs_knn_and_fewshot_of_its_features(compose_cfg, tmp_path):
    from vitlab.commands.train import train

    probe = ["every_n_epochs=1", "max_train_images=500", "knn_k=[20,5]"]
    cfg = compose_cfg(
        "train", ["debug=limit", "progress_bar=none", "callbacks=representation"]
        + [f"callbacks.representation.{o}" for o in probe]
    )  # fmt: skip
    train(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"knn/top1", "knn/top1_k20", "knn/top1_k5", "fewshot/10shot"} <= metrics.keys()
    assert metrics["knn/top1"] == metrics["knn/top1_k20"] and 0.0 <= metrics["fewshot/10shot"] <= 1.0
    rows = (tmp_path / "csv").rglob("metrics.csv")
    assert any("knn/top1" in p.read_text().splitlines()[0] for p in rows)  # logged per epoch, beside val/acc


def test_the_training_split_is_cut_to_a_seeded_subset():
    from vitlab.data.digits import DigitsDataModule
    from vitlab.representation import _Limited

    dm = DigitsDataModule(img_size=8, batch_size=64)
    dm.setup("fit")
    a = _Limited(dm, 100, seed=0).eval_view("train")
    b = _Limited(dm, 100, seed=0).eval_view("train")
    assert len(a) == 100 and torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert len(_Limited(dm, None, seed=0).eval_view("train")) == len(dm.train_set)
    assert RepresentationProbe(every_n_epochs=2).every == 2
