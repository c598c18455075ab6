"""Issue 77's acceptance, as typed: `python -m vitlab.train data=list data.train_file=<a CSV of ;-separated names>
objective.multilabel=true` trains, chooses its checkpoint by mAP and reports it (each class's AP, the class counts, in
metrics.json); `vitlab.predict` on the checkpoint gives every label over a threshold with its score; `vitlab.eval`
scores the checkpoint and its frozen features (k-NN, linear) by mAP; data that has one label an image is refused under
multilabel, in one line."""

import json

import numpy as np
import pytest
from PIL import Image

from tests.helpers.commands import run_cli
from tests.helpers.runs import once

NAMES = ("blue", "green", "red")  # the classes sorted; an image is labelled by the colour channels lit in it


def _colours(root):
    """48 images of 8 px whose labels are the colour channels lit in them (1 to 3 a picture), as a CSV of names."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(48):
        lit = rng.integers(0, 2, 3)
        lit[i % 3] = 1
        pixels = rng.integers(0, 60, (8, 8, 3)).astype(np.uint8) + 150 * lit[::-1].astype(np.uint8)  # RGB: red first
        Image.fromarray(pixels).save(root / f"{i}.png")
        rows.append(f"{i}.png,{';'.join(n for n, on in zip(NAMES, lit, strict=True) if on)}")
    (root / "train.csv").write_text("path,label\n" + "\n".join(rows[:32]) + "\n")
    (root / "test.csv").write_text("path,label\n" + "\n".join(rows[32:]) + "\n")


RUN = ["data=list", "objective.multilabel=true", "model.img_size=8", "model.patch_size=4", "model.embed_dim=32",
       "model.depth=1", "model.num_heads=2", "data.batch_size=4", "trainer.max_epochs=4", "progress_bar=none",
       "data.num_workers=0", "optim.lr=0.01", "scheduler.warmup_epochs=0", "data.val_fraction=0.25",
       "objective.label_smoothing=0"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    def train(root):
        _colours(root)
        r = run_cli("train", *RUN, f"data.train_file={root / 'train.csv'}", f"data.test_file={root / 'test.csv'}",
                    f"hydra.run.dir={root / 'run'}", cwd=root)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        (root / "stdout").write_text(r.stdout + r.stderr)

    return once(tmp_path_factory, "multilabel-colours", train)


def test_a_list_of_several_labels_trains_and_reports_map(run):
    metrics = json.loads((run / "run" / "metrics.json").read_text())
    cells = [line.split(",")[1].split(";") for line in (run / "train.csv").read_text().splitlines()[1:]]
    assert metrics["class_counts"] == {n: sum(n in c for c in cells) for n in NAMES}  # the training list's
    assert metrics["best_checkpoint"] == metrics["tested_checkpoint"]
    assert {"val/map_best", "test/map", "test/map_micro", "test/f1", "test/f1_micro"} <= set(metrics)
    aps = [metrics[f"test/ap/{name}"] for name in NAMES]  # each class's AP, by name (metrics.json alone)
    assert metrics["test/map"] == pytest.approx(sum(aps) / 3) and metrics["test/map"] > 0.75  # learnt the colours
    config = (run / "run" / "config.yaml").read_text()
    assert "monitor: val/map" in config and "multilabel: true" in config
    assert "val/map_best" in (run / "stdout").read_text().splitlines()[-3]  # the run's last line reports it
    assert "test/ap" not in (run / "stdout").read_text()  # (no console row a class)


def test_predict_gives_every_label_over_the_threshold(run, tmp_path):
    ckpt = run / "run" / "checkpoints" / "last.ckpt"  # (the best on 8 validation images is an early tie at mAP 1)
    test = [line.split(",") for line in (run / "test.csv").read_text().splitlines()[1:6]]
    images = f"images=[{','.join(str(run / p) for p, _ in test)}]"
    r = run_cli("predict", f"ckpt_path={ckpt}", images, "threshold=0.5", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "predictions.json").read_text())
    for result in results:
        probs = [label["prob"] for label in result["labels"]]
        assert result["threshold"] == 0.5 and all(p > 0.5 for p in probs) and probs == sorted(probs, reverse=True)
        assert "top_k" not in result
    said = [{label["class"] for label in result["labels"]} for result in results]
    hits = sum(set(truth.split(";")) == labels for (_, truth), labels in zip(test, said, strict=True))
    assert hits >= 3, results  # the colours lit, as the labels say
    r = run_cli("predict", f"ckpt_path={ckpt}", images, "threshold=1", f"hydra.run.dir={tmp_path / 'bad'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: threshold 1 must be a number in (0, 1) or null"


def test_data_of_one_label_an_image_is_refused_under_multilabel(folder, tmp_path):
    r = run_cli("train", "data=imagefolder", f"data.data_dir={folder}", "objective.multilabel=true", *RUN[2:],
                f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 2
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith("error: objective.multilabel=true needs several labels an image, and ImageFolderDataModule")
    assert list(tmp_path.iterdir()) == []  # refused before the run's directory is made


def test_eval_scores_a_multilabel_checkpoint_by_map_in_test_knn_linear_and_fewshot(run, tmp_path):
    """vitlab.eval on the checkpoint: its classifier (task=test) and its frozen features (task=knn, task=linear,
    task=fewshot) each give mAP (k-NN and linear: over the classes and over every (image, class) pair) in
    metrics.json. The features separate the colours: each mAP above the 0.69 a constant score gets (the test split's
    share of positive (image, class) pairs; per class 0.62-0.75)."""
    ckpt = run / "run" / "checkpoints" / "last.ckpt"
    labels = [line.split(",")[1].split(";") for line in (run / "test.csv").read_text().splitlines()[1:]]
    chance = sum(map(len, labels)) / (3 * len(labels))
    r = run_cli("eval", f"ckpt_path={ckpt}", "task=test", f"hydra.run.dir={tmp_path / 'test'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "test" / "metrics.json").read_text())["test/map"] > chance
    r = run_cli("eval", f"ckpt_path={ckpt}", "task=knn", "knn.k=[5,20]", f"hydra.run.dir={tmp_path / 'knn'}")
    assert r.returncode == 0, r.stderr[-3000:]
    knn = json.loads((tmp_path / "knn" / "metrics.json").read_text())
    assert {"knn/map_k5", "knn/map_micro_k5", "knn/map_k20", "knn/map_micro_k20"} <= set(knn)
    assert not any("top1" in name for name in knn) and knn["knn/map_k5"] > chance and knn["knn/map_micro_k5"] > chance
    r = run_cli("eval", f"ckpt_path={ckpt}", "task=linear", "linear.iterations=60", "linear.batch_size=8",
                "linear.n_last_blocks=[1]", f"hydra.run.dir={tmp_path / 'linear'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    linear = json.loads((tmp_path / "linear" / "metrics.json").read_text())
    assert linear["linear/map"] > chance and 0 < linear["linear/val_map"] <= 1 and "linear/map_micro" in linear
    assert linear["split"] == "test" and "linear/top1" not in linear
    r = run_cli("eval", f"ckpt_path={ckpt}", "task=fewshot", "fewshot.shots=[1,4]", "fewshot.seeds=[0,1]",
                f"hydra.run.dir={tmp_path / 'fewshot'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    fewshot = json.loads((tmp_path / "fewshot" / "metrics.json").read_text())
    names = {"fewshot_map/1shot", "fewshot_map/4shot", "fewshot_map/4shot_std", "fewshot_map/4shot-seed-1"}
    assert names <= set(fewshot)
    assert fewshot["fewshot_map/4shot"] > chance and not any(name.startswith("fewshot/") for name in fewshot)
