"""A checkpoint made ready for inference (training/run/inference.py): read once per command (STYLE rule 13), and the
module built from that one read is the one Lightning's load_from_checkpoint builds from the file."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from tests.helpers.runs import digits_checkpoint
from vitlab.training.module import ViTModule
from vitlab.training.run.inference import load_for_inference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory)


@pytest.fixture
def reads(monkeypatch, ckpt):
    """How many times torch.load opens the checkpoint file (read_checkpoint's reader, and Lightning's)."""
    counted = []
    load = torch.load

    def counting(f, *args, **kwargs):
        if os.fspath(f if isinstance(f, (str, os.PathLike)) else f.name) == str(ckpt):  # a path, or an open file
            counted.append(f)
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    return counted


def test_the_module_of_one_read_is_lightnings(ckpt):
    ours = load_for_inference(str(ckpt))
    theirs = ViTModule.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    assert ours.hparams == theirs.hparams and ours.model.cfg == theirs.model.cfg
    mine, lightnings = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(lightnings)
    for key, value in lightnings.items():
        assert torch.equal(mine[key], value), key


def test_eval_reads_the_checkpoint_once(ckpt, reads, compose_cfg, tmp_path):
    from vitlab.eval import evaluate

    cfg = compose_cfg("eval", [f"ckpt_path={ckpt}", "progress_bar=none"], output_dir=tmp_path)
    assert "test/acc" in evaluate(cfg)
    assert len(reads) == 1


def test_predict_reads_the_checkpoint_once(ckpt, reads, compose_cfg, tmp_path):
    from vitlab.predict import predict

    image = tmp_path / "digit.png"
    Image.fromarray((load_digits().images[0] * 255 / 16).astype(np.uint8)).save(image)
    cfg = compose_cfg("predict", [f"ckpt_path={ckpt}", f"images=[{image}]"], output_dir=tmp_path)
    assert len(predict(cfg)[0]["top_k"]) == 5
    assert len(reads) == 1
