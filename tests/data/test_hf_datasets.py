"""data=hf (data/hf.py): a saved Hugging Face dataset and its parquet files yield the image folder's images and labels
in its order, train exactly as it does, find their columns, classes and splits, and refuse bad input in one line.
The datasets are built offline from the `folder` fixture (`records`, tests/conftest.py)."""

import pytest
import torch

from tests.helpers.commands import run_cli
from tests.helpers.configs import SHARDS_RUN
from tests.helpers.runs import assert_same_run
from vitlab.data import HFDataModule, ImageFolderDataModule
from vitlab.data.indexes import hf_classes as count_classes
from vitlab.utils.errors import OfflineError, UserError


def items(dm, split):
    dataset = getattr(dm, f"{split}_set")
    return [dataset.base[i] for i in dataset.indices]


def assert_same_items(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) and i == j for (x, i), (y, j) in zip(a, b, strict=True))


@pytest.mark.parametrize("form", ["saved", "parquet"])
def test_a_saved_dataset_and_its_parquet_yield_the_folder_s_images_and_labels_in_order(folder, records, form, tmp_path):
    ref = ImageFolderDataModule(data_dir=str(folder), num_classes=3, img_size=8)
    dm = HFDataModule(name=str(records / form), num_classes=3, img_size=8, cache_dir=str(tmp_path))
    ref.setup("fit"), dm.setup("fit")
    for split in ("train", "val", "test"):
        assert_same_items(items(ref, split), items(dm, split))
    assert dm.class_names == ["a", "b", "c"] and count_classes(str(records / form), cache_dir=str(tmp_path)) == 3
    assert dm.splits["val"].endswith("[validation]")


def test_a_streamed_saved_dataset_yields_the_folder_s_images_and_labels_in_order(folder, records, tmp_path):
    """data.streaming=true reads the same rows through the streamed splits (data/streamed.py): each split's images and
    labels, one by one, are the folder's (a label a row off would pass a count or a training run that only ends)."""
    ref = ImageFolderDataModule(data_dir=str(folder), num_classes=3, img_size=8)
    dm = HFDataModule(name=str(records / "saved"), num_classes=3, img_size=8, streaming=True, cache_dir=str(tmp_path))
    ref.setup("fit"), dm.setup("fit")
    assert dm.num_train == 72 and dm.class_names == ["a", "b", "c"]
    for split in ("train", "val", "test"):
        theirs = ref.eval_view(split)
        ours = list(dm.eval_view(split).place(0, 0, 1, 8))
        assert len(ours) == len(theirs) == 72
        assert [y for _, y in ours] == [theirs[i][1] for i in range(72)]
        assert all(torch.equal(x, theirs[i][0]) for i, (x, _) in enumerate(ours))


def test_training_on_a_saved_dataset_equals_training_on_the_folder(records, shards_run, tmp_path):
    """shards_run trains on the folder's shards, which train as the folder itself (tests/data/test_streaming.py)."""
    r = run_cli("train", "data=hf", f"data.name={records / 'saved'}", *SHARDS_RUN, f"hydra.run.dir={tmp_path / 'hf'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(shards_run, tmp_path / "hf")


def test_without_a_validation_split_a_fixed_slice_of_train_validates_and_the_log_says_so(records, caplog, tmp_path):
    dm = HFDataModule(name=str(records / "saved"), num_classes=3, img_size=8, val_split="test", test_split=None)
    dm.setup("fit")
    assert len(dm.val_set) == 72 and dm.test_set is None
    one = HFDataModule(name=str(records / "saved"), num_classes=3, img_size=8, val_split=None, test_split=None)
    one.split_names["val"] = "nonesuch"  # (as a dataset with no validation split finds none)
    with pytest.raises(UserError, match="has no split 'nonesuch'; its splits: train, validation, test"):
        one.setup("fit")
    import datasets

    folder = tmp_path / "train-only"  # a single Dataset saved: its one split is train
    datasets.load_from_disk(str(records / "saved"))["train"].save_to_disk(str(folder))
    caplog.set_level("INFO")
    dm = HFDataModule(name=str(folder), num_classes=3, img_size=8, split_seed=3)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (65, 7) and not set(dm.train_set.indices) & set(dm.val_set.indices)
    assert "the data has no validation split: 0.1 of" in caplog.text
    again = HFDataModule(name=str(folder), num_classes=3, img_size=8, split_seed=3)
    again.setup("fit")
    assert again.val_set.indices == dm.val_set.indices  # fixed by the seed


def test_bad_input_is_one_line(records, tmp_path, monkeypatch):
    import datasets

    saved = str(records / "saved")
    with pytest.raises(UserError, match=r"data.image_key 'picture' is not a column of .* its columns: image, label"):
        HFDataModule(name=saved, num_classes=3, img_size=8, image_key="picture").setup("fit")
    with pytest.raises(UserError, match=r"^.*has no split 'dev'; its splits: train, validation, test$"):
        HFDataModule(name=saved, num_classes=3, img_size=8, val_split="dev").setup("fit")
    odd = datasets.Dataset.from_dict({"image": [b"x"], "img": [b"y"], "label": [0.5]})
    odd.save_to_disk(str(tmp_path / "odd"))
    with pytest.raises(UserError, match=r"has no single image column \(image, img, label\): name it with data.image_"):
        HFDataModule(name=str(tmp_path / "odd"), num_classes=3, img_size=8).setup("fit")
    with pytest.raises(UserError, match=r"holds the label 0.5 \(float\): labels must be integers or class names$"):
        HFDataModule(name=str(tmp_path / "odd"), num_classes=3, img_size=8, image_key="image").setup("fit")
    with pytest.raises(OfflineError, match=r"offline, point data.name at a local copy: a folder Dataset.save_to_disk"):
        HFDataModule(name="nobody/no-such-dataset", num_classes=3, img_size=8).setup("fit")


def test_a_hub_name_offline_fails_in_one_line_from_the_command(tmp_path):
    r = run_cli("train", "data=hf", "data.name=nobody/no-such-dataset", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: data.name 'nobody/no-such-dataset' cannot be loaded from the Hugging Face Hub")


def test_a_hub_dataset_without_a_network_reads_the_cache_at_once(monkeypatch):
    """Issue 64 point 17: with no network and HF_HUB_OFFLINE unset, `datasets` retried for 34 s before the line; the
    Hub is looked for once (2 s at most), and unreachable, `datasets` reads its cache alone, as HF_HUB_OFFLINE=1."""
    import time

    import datasets
    from huggingface_hub import constants

    from vitlab.data.hf import load

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (refuses at once: the look's answer)
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    t0 = time.monotonic()
    with pytest.raises(OfflineError, match=r"^data.name 'nobody/no-such-dataset-64' cannot be loaded from the Hugging"):
        load("nobody/no-such-dataset-64")
    assert time.monotonic() - t0 < 10 and datasets.config.HF_HUB_OFFLINE and constants.HF_HUB_OFFLINE
