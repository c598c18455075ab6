"""k-fold splits (issue 67, point 4): `data.folds=K data.fold=i` on the map-style readers (digits, imagefolder, hf,
list) cuts the training split into K fixed, class-stratified folds; fold i validates; the test split is untouched."""

from collections import Counter

import pytest

from vitlab.data import DigitsDataModule, ImageFolderDataModule
from vitlab.data.folds import check_folds, fold_split
from vitlab.utils.errors import UserError


def _labels(split) -> list[int]:
    """The labels of a split's items (TransformDataset over a base that lists its labels), without decoding."""
    base = split.base
    labels = getattr(base, "targets", None) or getattr(base, "labels", None)
    return [int(labels[i]) for i in split.indices]


def _check_folds(make, folds: int) -> None:
    """Every fold of `make(fold)` keeps the same test split and training pool; the validation folds are disjoint,
    cover the pool, and hold each class in near-equal shares (stratified); the train split is the pool less the fold."""
    parts = [make(i) for i in range(folds)]
    pool = set(parts[0].train_set.indices) | set(parts[0].val_set.indices)
    held = [set(d.val_set.indices) for d in parts]
    for d, h in zip(parts, held, strict=True):
        assert set(d.train_set.indices) == pool - h and set(d.train_set.indices).isdisjoint(h)
        assert d.test_set.indices == parts[0].test_set.indices and d.test_set.base is d.test_set.base
    assert sum(len(h) for h in held) == len(pool) and set().union(*held) == pool  # disjoint and covering
    per_class = [Counter(_labels(d.val_set)) for d in parts]
    for c in per_class[0]:
        counts = [p[c] for p in per_class]
        assert max(counts) - min(counts) <= 1, (c, counts)  # class-stratified
    assert [d.val_set.indices for d in parts] == [make(i).val_set.indices for i in range(folds)]  # fixed


def test_digits_folds_are_disjoint_cover_the_training_digits_and_leave_test_alone():
    def make(fold, folds=5, seed=0):
        d = DigitsDataModule(img_size=8, batch_size=8, folds=folds, fold=fold, split_seed=seed)
        d.setup("fit")
        return d

    _check_folds(make, 5)
    plain = DigitsDataModule(img_size=8, batch_size=8)
    plain.setup("fit")
    assert make(0).test_set.indices == plain.test_set.indices  # the test digits are the unfolded run's
    assert len(make(0).train_set) + len(make(0).val_set) == len(plain.train_set) + len(plain.val_set)
    assert make(0).val_set.indices != make(0, seed=1).val_set.indices  # split_seed chooses the folds
    assert make(2).splits["val"].startswith(f"{len(make(2).val_set)} digits (fold 2 of 5")


def test_folder_hf_and_list_folds_split_train_and_test_on_test(folder, records):
    from vitlab.data.hf import HFDataModule
    from vitlab.data.lists import ListDataModule

    common = dict(img_size=8, batch_size=4, num_workers=0, folds=3)
    readers = {
        "imagefolder": lambda i: ImageFolderDataModule(data_dir=str(folder), num_classes=3, fold=i, **common),
        "hf": lambda i: HFDataModule(name=str(records / "saved"), num_classes=3, fold=i, **common),
        "list": lambda i: ListDataModule(
            train_file=str(records / "train.csv"), test_file=str(records / "test.csv"), num_classes=3, fold=i, **common
        ),
    }
    for name, build in readers.items():

        def make(i, build=build):
            d = build(i)
            d.setup("fit")
            return d

        _check_folds(make, 3)
        d = make(1)
        assert len(d.val_set) == 24 and len(d.train_set) == 48 and len(d.test_set) == 72, name
        assert "fold 1 of 3" in d.splits["val"], (name, d.splits)


def test_a_fold_outside_the_folds_and_readers_without_folds_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"data.fold 5 is not a fold of data.folds 5: give one of 0..4"):
        DigitsDataModule(img_size=8, folds=5, fold=5)
    with pytest.raises(UserError, match=r"data.folds 1 must be 0 \(no k-fold\) or a number of folds >= 2"):
        check_folds(1, 0)
    with pytest.raises(UserError, match=r"data.fold 2 needs data.folds=K"):
        check_folds(0, 2)
    from vitlab.data.fake import FakeDataModule

    with pytest.raises(UserError, match=r"FakeDataModule takes no folds; k-fold splits map-style data"):
        FakeDataModule(img_size=8, folds=3, fold=0)
    with pytest.raises(UserError, match=r"data.folds 4 is more than the images of any class \(3 at most\)"):
        fold_split([0, 0, 0, 1, 1, 1], 4, 0, 0)


def test_the_command_line_refuses_a_fold_beyond_the_folds_before_writing_anything(tmp_path):
    from tests.helpers.commands import run_cli

    r = run_cli("train", "data.folds=3", "data.fold=3", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "error: data.fold 3 is not a fold of data.folds 3: give one of 0..2"
    assert not list(tmp_path.rglob("*"))  # no run directory


def test_a_fold_sweeps_summary_gives_mean_and_std_over_the_folds():
    from vitlab.cli.sweep import fold_means

    rows = [
        {"job": i, "overrides": ["optim.lr=0.1", f"data.fold={i % 3}"], "status": "done", "test/acc": a}
        for i, a in enumerate([0.8, 0.9, 1.0])
    ] + [{"job": 3, "overrides": ["optim.lr=0.2", "data.fold=0"], "status": "failed", "test/acc": None}]
    out = fold_means(rows, ["test/acc"])
    assert out[0]["overrides"] == ["optim.lr=0.1"] and out[0]["done"] == 3
    assert out[0]["test/acc"]["mean"] == pytest.approx(0.9) and out[0]["test/acc"]["std"] == pytest.approx(0.0816497)
    assert out[1] == {"overrides": ["optim.lr=0.2"], "folds": 1, "done": 0}
    assert fold_means([{"job": 0, "overrides": ["optim.lr=0.1"], "status": "done"}], ["test/acc"]) == []
