"""Test-time augmentation in vitlab.eval (issue 67, point 3): the logits averaged over the views, as timm's --tta
reduces them, reported beside the plain numbers; timm's test_time_pool does not apply to a ViT."""

import json

import pytest
import torch

from tests.helpers.configs import tiny
from vitlab.evaluation.tta import TestTimeAugmentation, crop_pad, views
from vitlab.model.vit import ViT
from vitlab.utils.errors import UserError


def test_the_views_are_the_image_its_mirror_and_reflected_shifted_crops():
    x = torch.randn(2, 3, 16, 16)
    flip = views(x, "flip")
    assert len(flip) == 2 and torch.equal(flip[0], x) and torch.equal(flip[1], torch.flip(x, dims=[-1]))
    crops = views(x, "flip_crops")
    assert len(crops) == 10 and all(v.shape == x.shape for v in crops)
    assert torch.equal(crops[0], x) and torch.equal(crops[1], x.flip(-1))  # the centre crop is the image
    p = crop_pad(16)
    assert p == 1 and crop_pad(224) == 14 and crop_pad(8) == 1
    assert torch.equal(crops[2][..., p:, p:], x[..., :-p, :-p])  # top-left: the image moved down and right by p
    assert torch.equal(crops[8][..., :-p, :-p], x[..., p:, p:])  # bottom-right: moved up and left
    assert torch.equal(crops[2][..., 0, p:], x[..., 1, :-p])  # the border reflected, not black
    assert views(x, "none") == [x]


def test_tta_logits_are_the_mean_of_the_views_logits_as_timms_reduction_gives():
    torch.manual_seed(0)
    model = ViT(tiny(img_size=16, patch_size=8)).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for mode in ("flip", "flip_crops"):
            got = TestTimeAugmentation(model, mode)(x)
            each = torch.stack([model(v) for v in views(x, mode)])  # (V, B, classes), one view at a time
            torch.testing.assert_close(got, each.mean(0), atol=1e-6, rtol=0)
            # timm's train.py: a batch of each image's N views side by side, output.unfold(0, N, N).mean(dim=2)
            n = len(each)
            side_by_side = torch.stack(views(x, mode), 1).flatten(0, 1)  # (B * N, C, H, W)
            timm_logits = model(side_by_side).unfold(0, n, n).mean(dim=2)
            torch.testing.assert_close(got, timm_logits, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="tta 'rotate' is not one of"):
        TestTimeAugmentation(model, "rotate")


def test_timms_test_time_pool_does_not_apply_to_a_vit():
    """timm's apply_test_time_pool wraps a ViT evaluated above its size, and its head then fails: the pool reads a
    CNN's feature-map size (pretrained_cfg pool_size), which a ViT's tokens have none of."""
    import timm
    from timm.layers import apply_test_time_pool

    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, img_size=32, dynamic_img_size=True)
    pooled, applied = apply_test_time_pool(vit, {"input_size": (3, 256, 256)})
    assert applied and vit.pretrained_cfg.get("pool_size") is None
    with pytest.raises(TypeError, match="kernel_size"):
        pooled(torch.randn(1, 3, 48, 48))


def test_eval_reports_tta_beside_the_plain_numbers(compose_cfg, tmp_path, digits_ckpt, capsys):
    """metrics.json: the plain test/acc (as without tta) and test/acc_tta, which is the accuracy of the mean of each
    test image's views' logits, computed here image by image. The second table, TTA's, is labelled (issue 74, 11)."""
    from vitlab.eval import evaluate
    from vitlab.training.run import inference

    common = [f"ckpt_path={digits_ckpt}", "progress_bar=none", "trainer.limit_test_batches=1.0"]
    metrics = evaluate(compose_cfg("eval", [*common, "tta=flip_crops"], output_dir=tmp_path / "tta"))
    said = "with test-time augmentation, tta=flip_crops: the logits averaged over 10 views of each image (<metric>_tta)"
    assert capsys.readouterr().out.count(said) == 1
    plain = evaluate(compose_cfg("eval", common, output_dir=tmp_path / "plain"))
    assert metrics["test/acc"] == plain["test/acc"] and metrics["tta"] == "flip_crops" and metrics["tta_views"] == 10
    assert json.loads((tmp_path / "tta" / "metrics.json").read_text()) == metrics

    module = inference.load_for_inference(digits_ckpt).eval()
    dm = inference.inference_datamodule(module, digits_ckpt)
    dm.setup("test")
    hits = n = 0
    with torch.no_grad():
        for batch in dm.test_dataloader():
            x, y = dm.device_transform(batch, train=False)
            mean = torch.stack([module.model(v) for v in views(x, "flip_crops")]).mean(0)
            hits, n = hits + int((mean.argmax(-1) == y).sum()), n + len(y)
    assert metrics["test/acc_tta"] == pytest.approx(hits / n, abs=1e-6)


def test_tta_without_a_checkpoints_test_is_refused(compose_cfg, tmp_path):
    from vitlab.cli.schemas import check_eval

    with pytest.raises(UserError, match=r"tta=flip averages the logits of a checkpoint's classifier over views"):
        (tmp_path / "x.ckpt").touch()  # (a missing checkpoint is refused first)
        check_eval(compose_cfg("eval", ["tta=flip", "task=knn", f"ckpt_path={tmp_path / 'x.ckpt'}"]))
