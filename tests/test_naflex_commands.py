"""Images as they are, through the commands (issue 65, points 2-3): the acceptance command trains model=naflexvit_b16
(shrunk) on photos of three aspect ratios with data.naflex.seq_lens; its checkpoint is tested and its frozen
features probed by vitlab.eval, vitlab.predict reads photos of any shape, and what=views draws each view at its own
size; a model without NaFlex is refused before any work."""

import json

import numpy as np
import pytest
from PIL import Image

from tests.helpers.commands import assert_refused, run_cli

ASPECTS = [(96, 32), (48, 48), (32, 96)]  # (w, h): 3:1, 1:1, 1:3
SMALL = ("model.depth=2", "model.embed_dim=32", "model.num_heads=2", "data.batch_size=4", "data.num_workers=0")
NAFLEX = ("model=naflexvit_b16", "data=imagefolder", "data.naflex.seq_lens=[16,36]", *SMALL)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 3)):
        for k, c in enumerate(("dark", "bright")):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                w, h = ASPECTS[i % 3]
                pixels = (rng.random((h, w, 3)) * (90 if k == 0 else 255)).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def run(photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("naflex") / "run"
    r = run_cli("train", *NAFLEX, f"data.data_dir={photos}", "trainer.max_epochs=1", f"hydra.run.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stderr + r.stdout


def test_the_acceptance_command_trains_on_three_aspect_ratios(run):
    out, log = run
    assert "NaFlex: sequence lengths [16, 36] patches, global batch sizes [8, 1]" in log  # timm's rule, divisor 8
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["val/acc_best"] <= 1.0
    assert (out / "checkpoints" / "last.ckpt").is_file()


def test_eval_tests_and_probes_and_predict_reads_any_shape(run, photos, tmp_path):
    ckpt = run[0] / "checkpoints" / "last.ckpt"
    r = run_cli("eval", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'test'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "val/acc" in json.loads((tmp_path / "test" / "metrics.json").read_text())
    r = run_cli("eval", f"ckpt_path={ckpt}", "task=knn", "knn.k=[3]", f"features_dir={tmp_path / 'f'}",
                f"hydra.run.dir={tmp_path / 'knn'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    images = [str(next((photos / "val" / "dark").glob(f"{i}.png"))) for i in range(3)]
    r = run_cli("predict", f"ckpt_path={ckpt}", f"images=[{','.join(images)}]", "top_k=2",
                f"hydra.run.dir={tmp_path / 'pred'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    predictions = json.loads((tmp_path / "pred" / "predictions.json").read_text())
    assert [p["image"] for p in predictions] == images
    assert all(abs(sum(t["prob"] for t in p["top_k"]) - 1) < 1e-4 for p in predictions)


def test_views_are_drawn_at_each_views_own_size(photos, tmp_path):
    r = run_cli("visualize", "what=views", "objective=classify", *NAFLEX, f"data.data_dir={photos}", "num_images=3",
                "draws=3", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    views = json.loads((tmp_path / "views.json").read_text())
    for image in views["images"]:
        for (view,) in image["draws"]:
            x0, y0, x1, y1 = view["box"]
            h, w = view["size"]
            assert h % 16 == 0 and w % 16 == 0 and (h // 16) * (w // 16) <= 36  # within the largest budget
            # the view keeps its box's aspect up to one patch's rounding
            assert abs(np.log((w / h) / ((x1 - x0) / (y1 - y0)))) < np.log((max(h, w) + 16) / max(h, w)) + 0.35


def test_bad_input_is_refused_in_one_line(photos, tmp_path):
    """A model without NaFlex, a budget below one patch, a length whose batch the memory estimate says will not fit,
    MixUp/CutMix (timm's Mixup mixes square images)."""
    r = run_cli("train", "model=vit_ti16", "data=imagefolder", f"data.data_dir={photos}",
                "data.naflex.seq_lens=[16,36]", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert_refused(r, "error: data.naflex.seq_lens feeds NaFlex batches")
    r = run_cli("train", *NAFLEX[:2], *NAFLEX[3:], f"data.data_dir={photos}", "data.naflex.seq_lens=[0,16]",
                f"hydra.run.dir={tmp_path / 'run2'}")  # fmt: skip
    assert_refused(r, "error: data.naflex.seq_lens [0, 16]: 0 is not a positive number of patches")
    r = run_cli("train", *NAFLEX[:2], *NAFLEX[3:], f"data.data_dir={photos}", "data.naflex.seq_lens=[16,4000000]",
                f"hydra.run.dir={tmp_path / 'run3'}")  # fmt: skip
    assert_refused(r, "error: the run needs about")
    r = run_cli("train", *NAFLEX, f"data.data_dir={photos}", "objective.mixup.cutmix_alpha=1.0",
                f"hydra.run.dir={tmp_path / 'run4'}")  # fmt: skip
    assert_refused(r, "error: objective.mixup {'cutmix_alpha': 1.0} mixes square images")
