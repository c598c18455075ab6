"""Several labels an image (issue 77, point 1): data=list reads them from a cell of `;`-separated names (or indices),
a JSON list, or a 0/1 column a class (data.label_format); data=hf from a list column or 0/1 columns; each image's
label is its multi-hot row; k-fold is iteratively stratified; bad labels are refused in one line."""

import json

import numpy as np
import pytest
import torch

from vitlab.data import HFDataModule, ListDataModule
from vitlab.data.folds import fold_split
from vitlab.data.indexes import hf_classes, list_classes
from vitlab.utils.errors import UserError

NAMES = ["cat", "dog", "owl"]
LABELS = [["cat"], ["dog", "cat"], ["owl"], ["cat", "owl", "dog"], ["dog"], ["owl", "dog"]]
HOT = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1], [1, 1, 1], [0, 1, 0], [0, 1, 1]])


@pytest.fixture(scope="module")
def lists(folder, tmp_path_factory):
    """The `folder` fixture's first six training images listed with LABELS three ways."""
    root = tmp_path_factory.mktemp("multilabel")
    files = sorted((folder / "train").glob("*/*.png"))[:6]
    rows = list(zip(files, LABELS, strict=True))
    (root / "names.csv").write_text("path,label\n" + "".join(f"{f},{';'.join(ls)}\n" for f, ls in rows))
    (root / "indices.csv").write_text("path,label\n" + "".join(
        f"{f},{' ; '.join(str(NAMES.index(n)) for n in ls)}\n" for f, ls in rows))  # fmt: skip
    (root / "list.jsonl").write_text("".join(json.dumps({"path": str(f), "label": ls}) + "\n" for f, ls in rows))
    (root / "columns.csv").write_text("path," + ",".join(NAMES) + "\n" + "".join(
        f"{f}," + ",".join(str(int(n in ls)) for n in NAMES) + "\n" for f, ls in rows))  # fmt: skip
    return root


def _module(file, **kwargs):
    dm = ListDataModule(train_file=str(file), val_file=str(file), num_classes=3, img_size=8, multilabel=True,
                        **kwargs)  # fmt: skip
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(
    "file, kwargs", [("names.csv", {}), ("list.jsonl", {}), ("columns.csv", {"label_format": "columns"})]
)
def test_a_list_s_several_labels_are_each_image_s_multi_hot_row(lists, file, kwargs):
    dm = _module(lists / file, **kwargs)
    assert dm.class_names == NAMES and dm.multilabel
    assert torch.equal(dm.train_set.base.labels, HOT)
    image, label = dm.val_set[0]
    assert image.dtype == torch.uint8 and torch.equal(label, HOT[0])
    assert dm.class_counts == {"cat": 3, "dog": 4, "owl": 3}
    fmt = kwargs.get("label_format", "names")
    assert list_classes(str(lists / file), multilabel=True, label_format=fmt) == 3


def test_class_indices_in_a_cell_name_the_classes_by_number(lists):
    dm = _module(lists / "indices.csv")
    assert dm.class_names == ["0", "1", "2"] and torch.equal(dm.train_set.base.labels, HOT)


def test_bad_multilabel_lists_are_one_line(lists, tmp_path):
    image = (lists / "names.csv").read_text().splitlines()[1].split(",")[0]
    cases = [
        ("path,label\n{0},cat;dog\n{0},\n", {}, r"row 2, has no label, and objective.multilabel=true needs one"),
        ("path,cat,dog\n{0},1,2\n", {"label_format": "columns"}, r"row 1, column 'dog' holds '2': a class column"),
        ("path,label\n{0},cat;dog\n", {"label_format": "names;"}, r"^data.label_format 'names;' is not one of"),
        ("path,label\n{0},cat;1\n", {}, r"mixes class names and indices \(\['1', 'cat'\]\): give one kind$"),
    ]
    for n, (text, kwargs, message) in enumerate(cases):
        bad = tmp_path / f"bad{n}.csv"  # (a list is read once a process: read_rows)
        bad.write_text(text.format(image))
        with pytest.raises(UserError, match=message):
            ListDataModule(train_file=str(bad), num_classes=0, img_size=8, multilabel=True, **kwargs).setup("fit")
    val = tmp_path / "val.csv"
    val.write_text(f"path,label\n{image},cat;bat\n")
    with pytest.raises(UserError, match=r"val.csv holds labels not among the classes \['cat', 'dog', 'owl'\]...: \['b"):
        ListDataModule(train_file=str(lists / "names.csv"), val_file=str(val), num_classes=3, img_size=8,
                       multilabel=True).setup("fit")  # fmt: skip
    with pytest.raises(UserError, match=r"^data.label_format=columns \(a 0/1 column per class\) is several labels"):
        list_classes(str(lists / "columns.csv"), label_format="columns")


def test_k_fold_of_several_labels_is_iteratively_stratified():
    rng = np.random.default_rng(0)
    labels = (rng.random((120, 4)) < [0.5, 0.2, 0.1, 0.05]).astype(int)  # a rare class among common ones
    held = [fold_split(labels.tolist(), 5, f, seed=3)[1] for f in range(5)]
    assert sorted(i for h in held for i in h) == list(range(120))  # disjoint, every image once
    kept, first = fold_split(labels.tolist(), 5, 0, seed=3)
    assert sorted(kept + first) == list(range(120)) and first == held[0]
    per_fold = np.array([labels[h].sum(0) for h in held])  # positives of each class in each fold
    assert (per_fold.max(0) - per_fold.min(0) <= 1).all(), per_fold  # each class spread evenly (Sechidis et al.)


def test_a_hugging_face_list_column_and_0_1_columns(records, tmp_path):
    import datasets

    saved = datasets.load_from_disk(str(records / "saved"))
    first = saved["train"].select(range(6))
    feature = datasets.Sequence(datasets.ClassLabel(names=NAMES))
    listed = first.remove_columns("label").add_column("tags", [[NAMES.index(n) for n in ls] for ls in LABELS])
    listed = listed.cast_column("tags", feature)
    columns = first.remove_columns("label")
    for i, name in enumerate(NAMES):
        columns = columns.add_column(name, HOT[:, i].tolist())
    for name, data, fmt in (("listed", listed, "names"), ("columns", columns, "columns")):
        datasets.DatasetDict({"train": data, "validation": data}).save_to_disk(str(tmp_path / name))
        dm = HFDataModule(name=str(tmp_path / name), num_classes=3, img_size=8, multilabel=True, label_format=fmt,
                          test_split=None)  # fmt: skip
        dm.setup("fit")
        assert dm.class_names == NAMES and torch.equal(dm.train_set.base.labels, HOT)
        assert hf_classes(str(tmp_path / name), multilabel=True, label_format=fmt) == 3
        # Streamed (data.streaming=true): the classes from the features, each row's multi-hot row as it is read
        dm = HFDataModule(name=str(tmp_path / name), num_classes=3, img_size=8, multilabel=True, label_format=fmt,
                          test_split=None, streaming=True, cache_dir=str(tmp_path / "cache"))  # fmt: skip
        dm.setup("fit")
        assert dm.class_names == NAMES
        assert torch.equal(torch.stack([y for _, y in dm.eval_view("train").place(0, 0, 1, 2)]), HOT[:6])
        assert hf_classes(str(tmp_path / name), multilabel=True, label_format=fmt, streaming=True) == 3
    plain = listed.cast_column("tags", datasets.Sequence(datasets.Value("int64")))  # indices without class names
    datasets.DatasetDict({"train": plain, "validation": plain}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(UserError, match=r"^objective.multilabel=true streams its classes from the dataset's features"):
        hf_classes(str(tmp_path / "plain"), multilabel=True, streaming=True)
