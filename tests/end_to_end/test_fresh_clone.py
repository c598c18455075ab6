"""The documented commands (tests/helpers/docs.py: documented) as a new user types them, from a fresh clone: no
hydra.sweep.dir, no hydra.run.dir, real image files (issue 10, "Broken for users")."""

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.helpers.commands import ROOT, run_cli
from tests.helpers.docs import documented
from tests.helpers.images import image_tree
from tests.helpers.runs import earlier_run


@contextlib.contextmanager
def sweep_as_typed(where: str, tmp_path: Path, *args: str):
    """Run `python -m vitlab.train <args>` from the repo root or another directory, as a user types it
    (no hydra.sweep.dir), and yield the sweep directory it announced; one made in the repo is removed."""
    cwd = ROOT if where == "repo root" else tmp_path
    r = run_cli("train", *args, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("sweep results: ")]
    sweep = Path(line.removeprefix("sweep results: ")).parent
    try:
        assert sweep.parent == cwd / "outputs" / "train" / "multiruns"
        assert "setup plugin" not in r.stdout  # Optuna's storage layer is quiet
        yield sweep, r
    finally:
        if where == "repo root":
            shutil.rmtree(sweep)
            for parent in sweep.parents:  # and the folders it made, up to outputs/, where nothing else is
                if parent == ROOT or any(parent.iterdir()):
                    break
                parent.rmdir()


@pytest.mark.parametrize("where", ["repo root", "another directory"])
def test_readme_grid_sweep_runs_as_typed(tmp_path, where):
    """Each job its own directory (0, 1) with its metrics, and a summary in the order of the grid, also printed."""
    args = (*documented("train", "-m", "model.drop_path_rate=0,0.1"), "trainer.max_epochs=1")
    with sweep_as_typed(where, tmp_path, *args) as (sweep, r):
        summary = json.loads((sweep / "summary.json").read_text())
        assert [s["status"] for s in summary] == ["done", "done"]
        assert [s["overrides"][0] for s in summary] == ["model.drop_path_rate=0", "model.drop_path_rate=0.1"]
        jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
        assert jobs == ["0", "1"] and all((sweep / j / "metrics.json").is_file() for j in jobs)
        assert "sweep summary" in r.stdout


@pytest.mark.parametrize("where", ["repo root", "another directory"])
def test_readme_optuna_search_runs_as_typed(tmp_path, where):
    """Optuna's result is the best trial's: its value and the parameters the search space names."""
    args = (*documented("train", "hparams_search=digits_optuna"), "hydra.sweeper.n_trials=2", "trainer.max_epochs=1")
    with sweep_as_typed(where, tmp_path, *args) as (sweep, _):
        result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
        summary = json.loads((sweep / "summary.json").read_text())
        assert len(summary) == 2 and result["best_value"] == max(s["val/acc_best"] for s in summary)
        assert set(result["best_params"]) >= {"optim.lr", "model.depth"}


def test_a_sweep_with_an_invalid_job_runs_the_others_and_summarises_all(tmp_path):
    r = run_cli("train", "-m", "model.drop_rate=0,1.5,0.1", "trainer.max_epochs=1", cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [
        "error: sweep job 1: drop_rate 1.5 must be in [0, 1)",
        f"error: 1 of 3 sweep jobs failed (job 1: drop_rate 1.5 must be in [0, 1)); every job is listed in "
        f"{next((tmp_path / 'outputs' / 'train' / 'multiruns').iterdir()) / 'summary.json'}",
    ]
    sweep = next((tmp_path / "outputs" / "train" / "multiruns").iterdir())
    summary = json.loads((sweep / "summary.json").read_text())
    assert [s["status"] for s in summary] == ["done", "failed", "done"]
    assert summary[1]["error"] == "drop_rate 1.5 must be in [0, 1)"


def test_a_small_image_folder_is_refused_not_trained_on_nothing(tmp_path):
    tree = image_tree(tmp_path / "photos", classes=("cat", "dog", "eel"), per_class=3)
    before = earlier_run(tmp_path)
    r = run_cli("train", "data=imagefolder", f"data.data_dir={tree}", "model=vit_digits", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: data.batch_size 256 is larger than the 9 training images, and training uses full batches only, "
        "so nothing would be trained; set data.batch_size to at most 9"
    )
    assert not list((tmp_path / "outputs").rglob("metrics.json"))[1:]  # only the earlier run's
    assert {p: p.read_bytes() for p in before} == before
    # With a batch that fits it trains; the class count (3) was read from the folder.
    r = run_cli(
        "train", "data=imagefolder", f"data.data_dir={tree}", "model=vit_digits", "data.batch_size=3",
        "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'ok'}", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "ok" / "metrics.json").read_text())
    assert metrics["best_checkpoint"].endswith(".ckpt") and "test/acc" not in metrics  # no test/: val/ selected
    ckpt = torch.load(tmp_path / "ok" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6 and ckpt["hyper_parameters"]["model"]["num_classes"] == 3
    assert ckpt["hyper_parameters"]["class_names"] == ["cat", "dog", "eel"]


def _photos(root: Path) -> dict[str, Path]:
    """Files predict used to read differently from training: a 16-bit PNG and an EXIF-rotated JPEG."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    sixteen = root / "gray16.png"
    Image.fromarray(rng.integers(0, 65535, (24, 20), dtype=np.uint16)).save(sixteen)
    assert Image.open(sixteen).mode.startswith("I")
    rotated = root / "portrait.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(rotated, exif=exif, quality=95)
    return {"16-bit": sixteen, "EXIF-rotated": rotated}


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A model trained through the CLI on an image folder (classes a, b), with its data."""
    tmp = tmp_path_factory.mktemp("folder")
    tree = image_tree(tmp / "tree", per_class=4, size=(12, 10))
    r = run_cli(
        "train", "data=imagefolder", f"data.data_dir={tree}", "model=vit_digits", "data.batch_size=4",
        "trainer.max_epochs=1", f"hydra.run.dir={tmp / 'run'}", cwd=tmp,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return tree, json.loads((tmp / "run" / "metrics.json").read_text())["best_checkpoint"]


@pytest.mark.parametrize("kind", ["16-bit", "EXIF-rotated"])
def test_predict_sees_the_image_training_and_eval_see(folder_run, tmp_path, kind):
    from vitlab.data.images import load_image
    from vitlab.training.run.inference import inference_datamodule, load_for_inference

    tree, ckpt = folder_run
    photo = _photos(tmp_path / "photos")[kind]
    shutil.copy(photo, tree / "val" / "a" / photo.name)  # the eval loader reads it from the folder
    module = load_for_inference(ckpt).eval()
    dm = inference_datamodule(module, ckpt)
    dm.data_dir = str(tree)
    dm.setup("test")
    (index,) = [i for i, (path, _) in enumerate(dm.val_set.base.samples) if path.endswith(photo.name)]
    x_eval, _ = dm.device_transform(
        (dm.val_set[index][0][None], None), train=False
    )  # the loader's uint8, then the device's half
    with torch.no_grad():
        expected = module(x_eval).softmax(-1)[0]

    r = run_cli("predict", f"ckpt_path={ckpt}", f"images=[{photo}]", "top_k=2", f"hydra.run.dir={tmp_path / 'p'}")
    assert r.returncode == 0, r.stderr[-3000:]
    (pred,) = json.loads((tmp_path / "p" / "predictions.json").read_text())
    got = {t["index"]: t["prob"] for t in pred["top_k"]}
    assert got == pytest.approx({i: expected[i].item() for i in got}, abs=1e-6)
    if kind == "16-bit":  # read as the gray image it is, not clipped to white
        pixels = np.asarray(load_image(photo))
        assert 100 < pixels.mean() < 155 and pixels.std() > 40
    else:  # upright: the 30x20 stored pixels display as 20 wide, 30 high
        assert load_image(photo).size == (20, 30)


def test_run_directory_is_never_reused(tmp_path):
    before = earlier_run(tmp_path)
    old = tmp_path / "outputs" / "train" / "runs" / "earlier"
    for prefix in ("", "+", "++"):
        r = run_cli("train", f"{prefix}hydra.run.dir={old}", "trainer.max_epochs=1", cwd=tmp_path)
        assert r.returncode == 2, (prefix, r.stderr[-2000:])
        assert r.stderr.strip() == (
            f"error: run directory '{old}' already holds files; vitlab never reuses a run directory: "
            "give a new hydra.run.dir or leave it to the default"
        )
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in old.iterdir()) == ["checkpoints", "config.yaml", "metrics.json"]


def test_two_runs_started_together_in_one_new_directory(tmp_path):
    new = tmp_path / "new"
    cmd = [sys.executable, "-m", "vitlab.train", f"hydra.run.dir={new}", "debug=fdr"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    results = sorted((p.wait(timeout=300), p.stderr.read().decode().strip()) for p in procs)
    assert [code for code, _ in results] == [0, 2], results
    assert results[1][1] == (
        f"error: run directory '{new}' already holds files; vitlab never reuses a run directory: "
        "give a new hydra.run.dir or leave it to the default"
    )
    assert (new / "metrics.json").is_file()


def test_eval_refuses_data_whose_classes_differ_and_follows_moved_data(folder_run, tmp_path):
    tree, ckpt = folder_run
    renamed = image_tree(tmp_path / "renamed", classes=("a", "c"), per_class=4, size=(12, 10))
    r = run_cli("eval", f"ckpt_path={ckpt}", f"data.data_dir={renamed}", f"hydra.run.dir={tmp_path / 'e'}")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: the data's classes ['a', 'c'] are not the 2 classes checkpoint '{ckpt}' was trained on ['a', 'b'] "
        "(first difference at index 1); evaluate on data with the same class folders"
    )
    assert not (tmp_path / "e" / "metrics.json").exists()
    moved = tmp_path / "moved"
    shutil.copytree(tree, moved)
    r = run_cli("eval", f"ckpt_path={ckpt}", f"data.data_dir={moved}", f"hydra.run.dir={tmp_path / 'm'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "m" / "metrics.json").read_text())["ckpt_path"] == ckpt


def test_parity_with_pretrained_weights_offline_says_it_did_not_check(tmp_path):
    r = run_cli("parity", "model=vit_ti16", "pretrained=true", f"hydra.run.dir={tmp_path / 'p'}")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: cannot fetch timm weights 'vit_tiny_patch16_224'")
    assert line.endswith("or check parity on random weights with pretrained=false")
    assert "PASS" not in r.stdout and not (tmp_path / "p" / "parity.json").exists()
