"""`python -m vitlab.visualize what=views` (evaluation/views.py): on a folder of 400 x 300 photos objective=dino's
global crops are cut from the whole image, as DINO's are (their boxes reach its left and right borders and their
areas span DINO's scales of the whole image); digits keep the on-device path from a square, and the log line says
which path; the classifier's crop is its RandomResizedCrop's box; MAE's adds the patches its encoder does not see; what
cannot make views is one line."""

import json
import logging

import pytest
from omegaconf import OmegaConf

from tests.helpers.commands import run_cli
from tests.helpers.images import image_tree
from vitlab.cli.schemas import check_visualize
from vitlab.evaluation.views import LAYOUT, draw_views
from vitlab.model.config import vit_config
from vitlab.training.run import build
from vitlab.utils.errors import UserError
from vitlab.visualize import check_views

SMALL = ["model=vit_cifar", "objective.crops.local_size=16", "objective.crops.local_crops=2"]  # 32 px, 16 px views


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """4 training photos of 400 x 300 (and a validation one), in one class folder."""
    root = tmp_path_factory.mktemp("photos")
    image_tree(root, classes=("a",), per_class=4, size=(300, 400), splits=("train",))
    return image_tree(root, classes=("a",), per_class=1, size=(300, 400), splits=("val",))


def views_of(compose_cfg, tmp_path, overrides, num_images=4, draws=1):
    cfg = compose_cfg("visualize", ["what=views", *overrides])
    dm = build.build_datamodule(cfg.data, **views(cfg))
    draw_views(dm, cfg.objective.name, num_images, draws, tmp_path / "out")
    return json.loads((tmp_path / "out" / "views.json").read_text())


def test_dinos_global_crops_reach_the_borders_of_the_whole_photo_at_dinos_scales(compose_cfg, tmp_path, photos, caplog):
    with caplog.at_level(logging.INFO, logger="vitlab.data.image_views"):
        folder = ["data=imagefolder", f"data.data_dir={photos}", "objective=dino", *SMALL]
        info = views_of(compose_cfg, tmp_path, folder, draws=40)
    assert "cut from each whole decoded image in the loader's workers" in caplog.text
    assert info["path"].startswith("workers") and (tmp_path / "out" / "views.png").is_file()
    assert {tuple(image["source_size"]) for image in info["images"]} == {(300, 400)}
    views = [view for image in info["images"] for run in image["draws"] for view in run]
    assert len(views) == 4 * 40 * 4 and {tuple(v["size"]) for v in views} == {(32, 32), (16, 16)}
    glob = [v["box"] for v in views if v["size"] == [32, 32]]
    x0, y0 = min(b[0] for b in glob), min(b[1] for b in glob)
    x1, y1 = max(b[2] for b in glob), max(b[3] for b in glob)
    assert (x0, y0, x1, y1) == (0, 0, 400, 300)  # the image's borders are seen (a 224 square's never were)
    area = [(b[2] - b[0]) * (b[3] - b[1]) / (400 * 300) for b in glob]
    assert 0.39 < min(area) < 0.45 and max(area) > 0.95  # DINO's (0.4, 1) of the whole image, not of a square
    local = [(b[2] - b[0]) * (b[3] - b[1]) / (400 * 300) for v in views if v["size"] == [16, 16] for b in [v["box"]]]
    assert 0.04 < min(local) < 0.07 and 0.35 < max(local) < 0.41  # (0.05, 0.4)


def test_digits_keep_the_on_device_path_from_a_square(compose_cfg, tmp_path, caplog):
    overrides = ["data=digits", "model=vit_digits", "model.img_size=16", "objective=dino",
                 "objective.crops.local_size=8", "objective.crops.blur_kernel=3"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="vitlab.data.image_views"):
        info = views_of(compose_cfg, tmp_path, overrides, num_images=2, draws=5)
    assert "cut on the device from each image resized and centre-cropped to a 16x16 square" in caplog.text
    assert info["path"].startswith("device") and info["images"][0]["source_size"] == [8, 8]
    boxes = [v["box"] for image in info["images"] for run in image["draws"] for v in run]  # the 8x8 digit's pixels
    assert all(0 <= b[0] < b[2] <= 8 and 0 <= b[1] < b[3] <= 8 for b in boxes) and len(boxes) == 2 * 5 * 10


def test_the_classifiers_view_is_its_random_resized_crop(compose_cfg, tmp_path, photos):
    info = views_of(compose_cfg, tmp_path, ["data=imagefolder", f"data.data_dir={photos}", "objective=classify",
                                            "model=vit_cifar"], draws=10)  # fmt: skip
    boxes = [v["box"] for image in info["images"] for run in image["draws"] for v in run]
    assert len(boxes) == 40 and all(0 <= b[0] < b[2] <= 400 and 0 <= b[1] < b[3] <= 300 for b in boxes)
    area = [(b[2] - b[0]) * (b[3] - b[1]) / (400 * 300) for b in boxes]
    assert min(area) < 0.5 and len(set(map(tuple, boxes))) == 40  # timm's (0.08, 1) crops, each its own


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["objective=dino", "model=vit_digits"], "missing: data"),
    ],
)
def test_what_cannot_make_views_is_one_line(compose_cfg, overrides, said):
    cfg = compose_cfg("visualize", ["what=views", *overrides])
    with pytest.raises(UserError) as e:
        check_visualize(cfg)
        check_views(cfg)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_what_views_from_the_command_line_shows_maes_mask(tmp_path):
    """objective=mae: the classifier's crop with the patches its encoder does not see (mask_ratio 0.75 of the 2 x 2
    patches of an 8-px digit at patch 4: 3 masked, as encode_visible keeps int(4 * 0.25) = 1)."""
    r = run_cli("visualize", "what=views", "data=digits", "model=vit_digits", "objective=mae", "num_images=2",
                f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "views.json").read_text())
    assert info["objective"] == "mae" and (tmp_path / "views.png").is_file()
    assert info["layout"] == LAYOUT and "size: [height, width]; box: [x0, y0, x1, y1]" in info["layout"]
    for image in info["images"]:
        (view,) = image["draws"][0]
        assert view["size"] == [8, 8] and view["patch"] == 4 and len(set(view["masked_patches"])) == 3
        assert all(0 <= k < 4 for k in view["masked_patches"])


@pytest.mark.parametrize("model, patch, side", [("vit_s16", 16, 224), ("eva02_ti14", 14, 224)])
def test_maes_mask_on_a_zoo_model_whose_patch_size_comes_from_its_variant(tmp_path, model, patch, side):
    """Issue 74, point 8: the zoo files leave patch_size null (their variant gives it): `w // None` was a TypeError."""
    r = run_cli("visualize", "what=views", "data=digits", f"model={model}", "objective=mae", "num_images=1", "draws=1",
                f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (image,) = json.loads((tmp_path / "views.json").read_text())["images"]
    (view,) = image["draws"][0]
    n = (side // patch) ** 2
    assert view["size"] == [side, side] and view["patch"] == patch and len(view["masked_patches"]) == n - n // 4


def test_an_objective_without_views_is_one_line(compose_cfg):
    from vitlab.evaluation.views import training_views

    cfg = compose_cfg("visualize", ["what=views", "data=digits", "model=vit_digits", "objective=classify"])
    dm = build.build_datamodule(cfg.data, **views(cfg))
    dm.setup("fit")
    with pytest.raises(UserError, match=r"objective=dino\|classify\|distill\|mae, not objective=ibot$"):
        training_views(dm, "ibot", 0, 0)


def views(cfg):
    """What vitlab.visualize adds to the data module for the config's objective and model (build.data_views)."""
    objective = OmegaConf.to_container(cfg.objective, resolve=True)
    return build.data_views(cfg.data, objective, vit_config(cfg.model))
