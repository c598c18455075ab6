"""timm's weights scored without a checkpoint (vitlab.evaluation.classifier; issue 39, point 2): `vitlab.predict
model.pretrained=local-dir:<folder>` gives timm's probabilities, and `vitlab.eval task=test` timm's validate.py's
top-1/top-5, on the same files: timm's own model and transform are the reference. A tiny timm ViT with a random head
saved as timm saves one (save_for_hf), so nothing is downloaded."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.commands import run_cli
from vitlab.utils.errors import UserError

CLASSES = 7  # more than 5: top-5 can miss
# the folder's config.json's preprocessing, none of it timm's defaults: squash, a crop below 1, bilinear, mean not 0.5
DATA_CONFIG = {"crop_pct": 0.8, "crop_mode": "squash", "interpolation": "bilinear", "mean": [0.4, 0.5, 0.6],
               "std": [0.2, 0.25, 0.3]}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder of timm's saved model, folder of class folders): 7 classes of 2 images of other aspect ratios each,
    JPEG and PNG."""
    import timm
    from timm.models._hub import save_for_hf

    root = tmp_path_factory.mktemp("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        num_classes=CLASSES,
    )  # fmt: skip
    with torch.no_grad():  # a head that decides (timm starts it near zero: every class ~1/7)
        model.head.weight.normal_(0, 3.0)
    save_for_hf(model, str(root / "model"), safe_serialization=True, data_config=DATA_CONFIG)
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (root / "val" / f"c{c}").mkdir(parents=True)
        for i, (h, w, ext) in enumerate([(30, 40, "jpg"), (44, 33, "png")]):
            a = (rng.random((h, w, 3)) * 255 * rng.random()).astype(np.uint8)
            Image.fromarray(a).save(root / "val" / f"c{c}" / f"{i}.{ext}")
    return root / "model", root / "val"


def _timms(folder, images):
    """timm's reference: its model from the folder, its transform from resolve_data_config, on the PIL images."""
    import timm
    from timm.data import create_transform, resolve_data_config

    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    data_config = resolve_data_config(model=model)
    assert {k: data_config[k] for k in DATA_CONFIG} == DATA_CONFIG  # the folder's preprocessing, not timm's defaults
    tf = create_transform(**data_config)
    with torch.no_grad():
        return torch.cat([model(tf(Image.open(p).convert("RGB")).unsqueeze(0)) for p in images])


def test_predict_gives_timms_probabilities(saved, tmp_path):
    folder, val = saved
    images = sorted(val.rglob("*.*"))[:4]
    r = run_cli(
        "predict", f"model.pretrained=local-dir:{folder}", f"images=[{','.join(map(str, images))}]", "top_k=7",
        f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    expected = _timms(folder, images).softmax(-1)
    for result, probs in zip(json.loads((tmp_path / "predictions.json").read_text()), expected, strict=True):
        ours = torch.zeros(CLASSES)
        for t in result["top_k"]:
            ours[t["index"]] = t["prob"]
        torch.testing.assert_close(ours, probs, atol=1e-5, rtol=0)
        assert [t["index"] for t in result["top_k"]][0] == int(probs.argmax())


def test_eval_task_test_gives_timms_top1_and_top5_as_validate_py(saved, compose_cfg, tmp_path):
    """A folder of class folders (timm's validate.py --data-dir), and a tree whose val/ holds them: top-1 and top-5
    as timm.utils.accuracy counts them over timm's DataLoader, the loss as its CrossEntropyLoss."""
    from timm.data import ImageDataset
    from timm.utils import accuracy

    from vitlab.cli.entry import check_config
    from vitlab.cli.eval_plans import eval_plan
    from vitlab.cli.schemas import SCHEMAS
    from vitlab.eval import evaluate

    folder, val = saved
    dataset = ImageDataset(str(val))
    images, targets = [p for p, _ in dataset.reader.samples], torch.tensor([t for _, t in dataset.reader.samples])
    logits = _timms(folder, images)
    top1, top5 = (float(a) / 100 for a in accuracy(logits, targets, topk=(1, 5)))
    assert 0 < top1 < top5 < 1  # the test can tell them apart
    loss = float(torch.nn.functional.cross_entropy(logits, targets))
    args = ["task=test", f"model.pretrained=local-dir:{folder}", "data=imagefolder", "data.num_workers=0"]
    cfg = compose_cfg("eval", [*args, f"data.data_dir={val}", "data.batch_size=4"])
    check_config(cfg, *SCHEMAS["eval"])
    metrics = evaluate(cfg)
    # (timm's float32 percentages: one image of 14 is 0.07)
    assert metrics["test/acc"] == pytest.approx(top1, abs=1e-6) and metrics["test/acc_top5"] == pytest.approx(top5)
    assert metrics["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["pretrained"] == f"local-dir:{folder}"
    evaluated = eval_plan(cfg).data  # the data as evaluated, planned once: the weights' eval transform filled in
    assert evaluated["eval_transform"] == {k: DATA_CONFIG[k] for k in ("crop_pct", "crop_mode", "interpolation")}
    assert cfg.data.eval_transform.crop_pct is None  # and the command's config as it was given (nothing writes it)
    tree = tmp_path / "tree"
    for split in ("train", "val"):
        (tree / split).mkdir(parents=True)
        for c in val.iterdir():
            (tree / split / c.name).symlink_to(c)
    metrics = evaluate(compose_cfg("eval", [*args, f"data.data_dir={tree}"]))
    assert (metrics["val/acc"], metrics["val/acc_top5"]) == (pytest.approx(top1, abs=1e-6), pytest.approx(top5))


def test_a_folder_whose_classes_are_not_the_heads_is_refused_in_one_line(saved, compose_cfg, tmp_path):
    from vitlab.eval import evaluate

    folder, val = saved
    for c in sorted(val.iterdir())[:5]:
        (tmp_path / "five" / c.name).mkdir(parents=True)
        (tmp_path / "five" / c.name / "0.png").symlink_to(c / "1.png")
    overrides = ["task=test", f"model.pretrained=local-dir:{folder}", "data=imagefolder", "data.num_workers=0"]
    said = r"^the data has 5 classes and 3 channels, and model.pretrained=local-dir:.*'s head 7 classes of 3-channel "
    with pytest.raises(UserError, match=said):
        evaluate(compose_cfg("eval", [*overrides, f"data.data_dir={tmp_path / 'five'}"]))


def test_hub_weights_offline_are_one_line_naming_them(compose_cfg, tmp_path, saved, monkeypatch):
    from vitlab.predict import predict

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    image = next(saved[1].rglob("*.png"))
    hub = "hf-hub:timm/vit_tiny_patch16_224.augreg_in21k"
    cfg = compose_cfg("predict", [f"model.pretrained={hub}", f"images=[{image}]"])
    with pytest.raises(UserError, match=rf"^cannot fetch timm weights '{hub}': no network and not in the Hugging Face"):
        predict(cfg)
