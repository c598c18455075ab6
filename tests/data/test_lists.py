"""data=list (data/lists.py): CSV and JSON Lines lists of an image folder's files yield its images and labels in the
list's order, train exactly as the folder does, and refuse bad input in one line."""

import json

import pytest

from tests.data.test_hf_datasets import assert_same_items, items
from tests.helpers.commands import run_cli
from tests.helpers.configs import SHARDS_RUN
from tests.helpers.runs import assert_same_run
from vitlab.data import ImageFolderDataModule, ListDataModule
from vitlab.data.indexes import list_classes as count_classes
from vitlab.utils.errors import MissingFileError, UserError


def test_csv_and_jsonl_lists_yield_the_folder_s_images_and_labels_in_order(folder, records, tmp_path):
    ref = ImageFolderDataModule(data_dir=str(folder), num_classes=3, img_size=8)
    lines = (records / "val.csv").read_text().splitlines()[1:]
    jsonl = tmp_path / "val.jsonl"  # absolute paths, labels as class names
    jsonl.write_text("".join(json.dumps({"path": str(records / p), "label": c}) + "\n" for p, c in
                             (line.split(",") for line in lines)))  # fmt: skip
    dm = ListDataModule(train_file=str(records / "train.csv"), val_file=str(jsonl),
                        test_file=str(records / "test.csv"), num_classes=3, img_size=8)  # fmt: skip
    ref.setup("fit"), dm.setup("fit")
    for split in ("train", "val", "test"):
        assert_same_items(items(ref, split), items(dm, split))
    assert dm.class_names == ["a", "b", "c"] and count_classes(str(records / "train.csv")) == 3


def test_training_on_a_list_equals_training_on_the_folder(records, shards_run, tmp_path):
    files = [f"data.{k}_file={records / s}.csv" for k, s in (("train", "train"), ("val", "val"), ("test", "test"))]
    r = run_cli("train", "data=list", *files, *SHARDS_RUN, f"hydra.run.dir={tmp_path / 'list'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(shards_run, tmp_path / "list")


def test_bad_lists_are_one_line(records, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("file,label\nx.png,a\n")
    with pytest.raises(UserError, match=r"has no column 'path'; its columns: file, label \(name the image column"):
        ListDataModule(train_file=str(bad), num_classes=1, img_size=8).setup("fit")
    bad.write_text("path,label\nx.png,1.5\n")
    with pytest.raises(MissingFileError, match="does not exist"):
        ListDataModule(train_file=str(tmp_path / "none.csv"), num_classes=1, img_size=8).setup("fit")
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"path": "x.png", "label": 1.5}\n')
    with pytest.raises(UserError, match=r"holds the label 1.5 \(float\): labels must be integers or class names$"):
        ListDataModule(train_file=str(jsonl), num_classes=1, img_size=8).setup("fit")
    with pytest.raises(UserError, match="is neither a .csv"):
        ListDataModule(train_file=str(records / "saved" / "dataset_dict.json"), num_classes=1, img_size=8).setup("fit")
