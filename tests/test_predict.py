"""vitlab.predict on photos that are not square (issue 53, point 12): a checkpoint and its own timm export are one
model with one preprocessing, the eval transform of the data the checkpoint was trained with, whether vitlab reads
the checkpoint, vitlab reads the export (`model.pretrained=local-dir:`) or timm does (resolve_data_config,
create_transform)."""

import json
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from sklearn.datasets import load_digits
from timm.data import create_transform, resolve_data_config

from tests.helpers.commands import run_cli
from tests.helpers.docs import documented
from tests.helpers.runs import digits_checkpoint
from vitlab.cli import predict_plan
from vitlab.data.images import read_image
from vitlab.training.run import inference

SIZES = [(40, 64), (90, 30), (120, 200)]  # (height, width) of the photos: wide, tall, wide


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory)


def _photos(folder):
    """Three test digits drawn large on black RGB canvases of other aspect ratios, as a camera would give them."""
    digits = load_digits()
    paths = []
    for i, (h, w) in enumerate(SIZES):
        side = min(h, w)
        digit = Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8)).resize((side, side), Image.NEAREST)
        canvas = Image.new("L", (w, h))
        canvas.paste(digit, ((w - side) // 2, (h - side) // 2))
        canvas.convert("RGB").save(path := folder / f"photo{i}.png")
        paths.append(path)
    return paths


def _predicted(ckpt_or_weights, photos, run_dir):
    """`python -m vitlab.predict` as typed, every class ranked: {image: [(class, prob), ...]}."""
    images = f"images=[{','.join(map(str, photos))}]"
    r = run_cli("predict", ckpt_or_weights, images, "top_k=10", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    ranked = json.loads((run_dir / "predictions.json").read_text())
    return {p["image"]: [(t["class"], t["prob"]) for t in p["top_k"]] for p in ranked}


def test_predict_and_the_timm_export_prepare_and_rank_photos_alike(ckpt, tmp_path):
    photos, folder = _photos(tmp_path), tmp_path / "timm"
    r = run_cli("export", f"ckpt_path={ckpt}", "format=timm", f"output={folder}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # The one preprocessing: the eval transform of the data module the checkpoint stores.
    module = inference.load_for_inference(str(ckpt)).eval()
    data = inference.inference_datamodule(module, str(ckpt))
    pretrained_cfg = json.loads((folder / "config.json").read_text())["pretrained_cfg"]
    assert {k: pretrained_cfg[k] for k in data.preprocessing} == json.loads(json.dumps(data.preprocessing))
    assert pretrained_cfg["crop_mode"] == "center" and pretrained_cfg["crop_pct"] == 1.0
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    timm_tf = create_transform(**resolve_data_config(model=theirs))
    from_ckpt = predict_plan._checkpoint(str(ckpt), "cpu")[1]
    from_export = predict_plan._pretrained(f"local-dir:{folder}", None, "cpu")[1]
    x = torch.cat([timm_tf(Image.open(p).convert("L"))[None] for p in photos])  # (3, 1, 8, 8)
    for prepare in (from_ckpt, from_export, data.predict_tensor):
        assert torch.equal(torch.cat([prepare(read_image(p, 1)) for p in photos]), x)
    # ... which is what the test images went through: 8x8 digits pass unchanged, normalised.
    test_images = data.first_images("test", 4)
    pils = [Image.fromarray(data.test_set.base[i][0][0].numpy()) for i in data.test_set.indices[:4]]
    assert torch.equal(torch.cat([timm_tf(img)[None] for img in pils]), test_images)
    # The same classes and probabilities: predict on the checkpoint, on its export, and timm's model.
    ours = _predicted(f"ckpt_path={ckpt}", photos, tmp_path / "p1")
    exported = _predicted(f"model.pretrained=local-dir:{folder}", photos, tmp_path / "p2")
    with torch.no_grad():
        probs = theirs(x).softmax(-1)
    for path, p in zip(photos, probs, strict=True):
        top = p.topk(10)
        timms = [(str(int(i)), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
        for ranked in (ours[str(path)], exported[str(path)]):
            assert [c for c, _ in ranked] == [c for c, _ in timms]
            np.testing.assert_allclose([v for _, v in ranked], [v for _, v in timms], atol=1e-5, rtol=0)
    # Issue 53, point 13: the folder and its files as readable as a checkpoint (the umask's ordinary permissions).
    umask = os.umask(0o022)
    os.umask(umask)
    assert folder.stat().st_mode & 0o7777 == 0o777 & ~umask
    assert {f.name: f.stat().st_mode & 0o7777 for f in folder.iterdir()} == {
        "config.json": 0o666 & ~umask,
        "model.safetensors": 0o666 & ~umask,
        "README.md": 0o666 & ~umask,  # the model card (convert/publish.py)
    }
    assert ckpt.stat().st_mode & 0o7777 == 0o666 & ~umask
    # Issue 53, point 15: the export given as ckpt_path is named for what it is, with the key that reads it.
    r = run_cli("predict", f"ckpt_path={folder}", f"images=[{photos[0]}]", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: ckpt_path '{folder}' is a timm folder (vitlab.export format=timm writes them), not a training "
        f"checkpoint: read it with model.pretrained=local-dir:{folder} instead of ckpt_path"
    ]


def test_the_getting_started_command_ranks_every_class_of_a_model_with_fewer_than_five(shards_run, folder, tmp_path):
    """Issue 64 point 12: top_k's default 5 refused every model of fewer classes, Getting started's own command
    included; by default it ranks min(5, classes): all 3 here. A top_k beyond them is still refused."""
    (tmp_path / "photos" / "new").mkdir(parents=True)
    Image.open(folder / "test" / "b" / "0.png").convert("RGB").save(tmp_path / "photos" / "new" / "1.jpg")
    ckpt = shards_run / "checkpoints" / "last.ckpt"
    args = documented("predict", "ckpt_path=x/checkpoints/last.ckpt", "images=[photos/new/1.jpg]")
    r = run_cli("predict", f"ckpt_path={ckpt}", *args[1:], f"hydra.run.dir={tmp_path / 'p'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (ranked,) = json.loads((tmp_path / "p" / "predictions.json").read_text())
    assert sorted(t["class"] for t in ranked["top_k"]) == ["a", "b", "c"]
    r = run_cli("predict", f"ckpt_path={ckpt}", *args[1:], "top_k=4", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: top_k 4 is more than the model's 3 classes"), r.stderr
