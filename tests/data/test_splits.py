"""Honest splits (issue 23, point 1): the split that selects the checkpoint is never reported as the test. An image
folder without test/ validates on val/ and tests nothing (its result is val/acc_best, named so), or, with
data.val_fraction, validates on a seeded slice held out of train and tests on val/."""

import json

import pytest

from tests.helpers.images import image_tree
from vitlab.data import ImageFolderDataModule
from vitlab.data.base import held_out
from vitlab.utils.errors import UserError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return image_tree(tmp_path_factory.mktemp("splits"), classes=("a", "b", "c"), per_class=8, size=(12, 12))


def dm(folder, **kw):
    d = ImageFolderDataModule(data_dir=str(folder), num_classes=3, img_size=8, batch_size=4, num_workers=0, **kw)
    d.setup("fit")
    return d


def test_without_test_folder_val_validates_and_nothing_is_tested(folder):
    d = dm(folder)
    assert d.test_set is None and len(d.val_set) == 24 and len(d.train_set) == 24
    assert d.splits == {"train": "train/", "val": "val/"}


def test_val_fraction_holds_a_seeded_slice_of_train_out_and_tests_on_val(folder):
    d = dm(folder, val_fraction=0.25, split_seed=3)
    assert len(d.val_set) == 6 and len(d.train_set) == 18 and len(d.test_set) == 24
    assert not set(d.val_set.indices) & set(d.train_set.indices)  # disjoint, all of train between them
    assert sorted(d.val_set.indices + d.train_set.indices) == list(range(24))
    assert d.val_set.base is d.train_set.base and d.test_set.base.root.endswith("val")
    assert d.val_set.indices == dm(folder, val_fraction=0.25, split_seed=3).val_set.indices  # fixed by the seed
    assert d.val_set.indices != dm(folder, val_fraction=0.25, split_seed=4).val_set.indices
    assert d.splits["test"] == "val/" and "6 images of train/ held out" in d.splits["val"]
    assert held_out(100, 1, 0)[1] == held_out(100, 1, 0)[1] and len(held_out(100, 1, 0)[1]) == 1
    with pytest.raises(UserError, match=r"data.val_fraction 1.5 must be in \[0, 1\)"):
        dm(folder, val_fraction=1.5)
    with pytest.raises(UserError, match=r"data.val_fraction 0.001 of 24 training images holds out 0"):
        dm(folder, val_fraction=0.001)


@pytest.mark.parametrize("val_fraction", [0.0, 0.25])
def test_a_run_reports_each_number_on_its_split(compose_cfg, tmp_path, folder, caplog, val_fraction):
    """metrics.json: no test/acc computed on the selecting split; `splits` says what val and test were; eval of the
    checkpoint measures the same split its run reported (val/ metrics where there is no test split)."""
    import logging

    from vitlab.eval import evaluate
    from vitlab.train import train

    data = ["data=imagefolder", f"data.data_dir={folder}", "data.batch_size=4", "data.num_workers=0",
            "model.img_size=8", f"data.val_fraction={val_fraction}"]  # fmt: skip
    with caplog.at_level(logging.INFO):
        train(compose_cfg("train", ["debug=limit", "progress_bar=none", *data]))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    if val_fraction:
        assert (
            "test/acc" in metrics and metrics["splits"]["test"] == "2 batches of val/" and metrics["tested_checkpoint"]
        )
    else:
        assert "test/acc" not in metrics and "tested_checkpoint" not in metrics
        # (debug=limit validates on 2 batches: the split says so)
        assert metrics["splits"] == {"train": "train/", "val": "2 batches of val/"} and metrics["best_checkpoint"]
        assert any("no test split, so the result is val/acc" in m for m in caplog.messages)
    ckpt = metrics.get("tested_checkpoint") or metrics["best_checkpoint"]
    out = tmp_path / "eval"
    result = evaluate(compose_cfg("eval", [f"ckpt_path={ckpt}"], output_dir=out))
    assert ("test/acc" in result) == bool(val_fraction) and ("val/acc" in result) != bool(val_fraction)
