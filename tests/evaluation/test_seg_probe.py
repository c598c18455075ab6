"""vitlab.eval task=segmentation (issue 68, point 2): DINOv2's linear segmentation probe held to DINOv2's own code
(its BNHead, get_intermediate_layers) and mmseg's (its loss, resize and metrics), vendored verbatim under
tests/reference/ and imported over a minimal shim (tests/evaluation/mmseg_shim.py); then the task end to end, on an
ADE20k-layout folder with timm-named weights under DDP, and on the embedded default with a checkpoint."""

import json
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from tests.evaluation import mmseg_shim
from tests.helpers.commands import run_cli
from tests.helpers.images import segmentation_tree
from tests.helpers.references import reference
from vitlab.convert.dino_weights import from_dinov2
from vitlab.convert.timm_args import config_from_timm
from vitlab.data.masks import IGNORE
from vitlab.evaluation import seg_probe as seg
from vitlab.model import ViT, ViTConfig
from vitlab.utils.errors import UserError

pytestmark = [
    pytest.mark.filterwarnings("ignore:xFormers is not available"),  # (DINOv2's layers, on a CPU)
    pytest.mark.filterwarnings("ignore:Default ``avg_non_ignore`` is False"),  # (mmseg's CrossEntropyLoss: its default)
]


@pytest.fixture
def ade20k(tmp_path):
    return segmentation_tree(tmp_path / "ade", classes=4)


@pytest.fixture
def refs(monkeypatch):
    return mmseg_shim.load(monkeypatch)


def _dinov2_and_ours(img_size: int = 56):
    """DINOv2's vit_small (their code, 2 blocks, random LayerScale), and ours with its weights."""
    torch.manual_seed(0)
    vits, layers = reference("dinov2", "dinov2.models.vision_transformer"), reference("dinov2", "dinov2.layers")
    theirs = vits.DinoVisionTransformer(
        patch_size=14, img_size=img_size, embed_dim=384, depth=2, num_heads=6, mlp_ratio=4, init_values=1.0,
        block_fn=partial(layers.NestedTensorBlock, attn_class=layers.MemEffAttention), block_chunks=0,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ours = ViT(config_from_timm("vit_small_patch14_dinov2", depth=2, num_classes=0, img_size=img_size)).eval()
    ours.load_state_dict(from_dinov2(theirs.state_dict()))
    return theirs, ours


@pytest.mark.parametrize("n", [1, 2])
def test_the_probe_is_dinov2s_bnhead_on_dinov2s_patch_tokens(refs, n):
    """The features (the last n blocks' patch tokens after the final norm, concatenated), the head's logits in
    training (batch statistics) and after it (running statistics), and the loss are DINOv2's and mmseg's own."""
    theirs, ours = _dinov2_and_ours()
    x, k = torch.randn(3, 3, 56, 56), 5
    with torch.no_grad():
        maps = list(theirs.get_intermediate_layers(x, n=n, reshape=True))  # (B, 384, 4, 4) each, normed
        tokens = seg.patch_tokens(ours, n)
        feats = tokens.extract(ours, x)
    assert feats.shape == (3, 384 * n, *tokens.dim(ours)[1:])
    torch.testing.assert_close(feats, torch.cat(maps, 1), atol=1e-5, rtol=1e-5)

    bn_head = refs.linear_head.BNHead(
        in_channels=[384] * n,
        in_index=list(range(n)),
        input_transform="resize_concat",
        channels=384 * n,
        dropout_ratio=0,
        num_classes=k,
        norm_cfg=dict(type="SyncBN", requires_grad=True),
        align_corners=False,
    )  # fmt: skip  (DINOv2's ade20k linear config, its "ms" head for n=4)
    head = seg.BNHead(384 * n, k, torch.Generator().manual_seed(0))
    bn_head.load_state_dict(head.state_dict())  # every parameter and buffer, by name
    labels = torch.randint(0, k, (3, 1, 56, 56))
    labels[:, :, :8] = IGNORE
    logits, expected = head.train()(feats), bn_head.train()(maps)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(seg.seg_loss(logits, labels[:, 0]), bn_head.losses(expected, labels)["loss_ce"])
    torch.testing.assert_close(head.eval()(feats), bn_head.eval()(maps))  # running statistics, updated alike


def test_the_metric_is_mmsegs_mean_iou(refs):
    """torchmetrics (vitlab's) against mmseg's eval_metrics on the same predictions: pixel accuracy, and the mean IoU
    over the classes present (class 4 in neither predictions nor labels: NaN in mmseg, left out of its nanmean)."""
    g = torch.Generator().manual_seed(0)
    preds = torch.randint(0, 4, (5, 12, 10), generator=g)
    labels = torch.where(torch.rand(5, 12, 10, generator=g) < 0.7, preds, torch.randint(0, 4, (5, 12, 10), generator=g))
    labels[torch.rand(5, 12, 10, generator=g) < 0.2] = IGNORE
    preds[labels == IGNORE] = 3  # predictions under ignored pixels count for nothing
    scores = seg.SegScores(num_classes=6)
    for p, y in zip(preds.split(2), labels.split(2), strict=True):
        scores.update(p, y)
    found = scores.compute()
    theirs = refs.metrics.eval_metrics(list(preds.numpy()), list(labels.numpy()), 6, IGNORE, metrics=["mIoU"])
    assert np.isnan(theirs["IoU"][4:]).all()
    assert found["aAcc"] == pytest.approx(float(theirs["aAcc"]), abs=1e-6)
    assert found["mIoU"] == pytest.approx(float(np.nanmean(theirs["IoU"])), abs=1e-6)


def test_the_probe_learns_what_the_features_say():
    """Features that tell each 4 x 4 patch's share of every class (what a perfect encoder at patch 4 could give) on
    the embedded canvases: the probe reaches a high mIoU on the test canvases (0.71, aAcc 0.93 measured, where
    random ViT features give 0.10 and 0.79, the background's share), its upsampling's blur at the digits' edges the
    rest."""
    import torch.nn.functional as F

    from vitlab.data import canvas

    def patch_shares(masks):
        return F.avg_pool2d(F.one_hot(masks.long(), 11).permute(0, 3, 1, 2).float(), 4)  # (N, 11, 8, 8)

    (_, train), (_, test) = canvas.make_split("train", 128, 32, 3, 0), canvas.make_split("test", 32, 32, 3, 0)
    head = seg.BNHead(11, 11, torch.Generator().manual_seed(0))
    seg.train_head(head, patch_shares(train), train, seg.SegSchedule(200, warmup_iters=20, lr=1e-2), "cpu")
    found = seg.score(head, patch_shares(test), test, 11, "cpu")
    assert found["mIoU"] > 0.6 and found["aAcc"] > 0.9, found


def test_the_schedule_is_mmcvs_poly_with_linear_warmup():
    """mmcv's PolyLrUpdaterHook (power 1, min_lr 0) and LrUpdaterHook's linear warm-up (its get_warmup_lr), at
    iterations of DINOv2's schedule (40,000, warm-up 1,500 from a ratio of 1e-6)."""
    s = seg.SegSchedule()
    for step in (0, 1, 750, 1499, 1500, 20_000, 39_999):
        regular = 1e-3 * (1 - step / 40_000)
        k = (1 - step / 1500) * (1 - 1e-6)
        assert s.lr_at(step) == pytest.approx(regular * (1 - k) if step < 1500 else regular, rel=1e-12)
    assert s.lr_at(0) == pytest.approx(1e-9)


def test_the_schedule_keeps_dinov2s_epochs_on_any_data(compose_cfg):
    """Issue 74, point 4: DINOv2's 40,000 iterations of 16 are 31.7 epochs of ADE20k's 20,210 images; on 48 images
    the same epochs are 96 iterations (not 13,000 epochs), the warm-up DINOv2's share of them; given iterations are
    kept, and a warm-up not shorter than them is refused in one line before the run starts."""
    from vitlab.cli.entry import check_config
    from vitlab.cli.schemas import SCHEMAS
    from vitlab.evaluation.seg_schedule import schedule_for

    sp = {"iterations": None, "warmup_iters": None, "batch_size": 16, "lr": 1e-3, "weight_decay": 1e-4, "seed": 0}
    found = {n: schedule_for(sp, n)[0] for n in (20_210, 48)}
    assert (found[20_210].iterations, found[20_210].warmup_iters) == (40_000, 1_500)
    assert (found[48].iterations, found[48].warmup_iters) == (96, 4)
    assert "31.7 epochs of the 48 training images" in schedule_for(sp, 48)[1]
    assert schedule_for(sp | {"batch_size": 4}, 48)[0].iterations == 381  # the epochs kept at another batch
    given = schedule_for(sp | {"iterations": 200}, 48)[0]
    assert (given.iterations, given.warmup_iters) == (200, 8)
    refused = r"^segmentation.warmup_iters 1500 is not shorter than segmentation.iterations 200: the warm-up would"
    with pytest.raises(UserError, match=refused):
        check_config(compose_cfg("eval", ["segmentation.iterations=200", "segmentation.warmup_iters=1500"]),
                     *SCHEMAS["eval"])  # fmt: skip
    with pytest.raises(UserError, match=refused):
        schedule_for(sp | {"iterations": 200, "warmup_iters": 1500}, 48)


def test_long_probes_say_their_time_and_progress_once_a_minute(monkeypatch, caplog):
    """Issue 74, point 4: a probe of 4,000 steps of 20 s each says its estimated time after its first steps, then
    a line at least once a minute (not only every 400 steps)."""
    import logging

    from vitlab.evaluation import tasks

    now = [1000.0]
    monkeypatch.setattr(tasks.time, "time", lambda: now[0])
    step_done = tasks._progress("segmentation probe", 4000)
    with caplog.at_level(logging.INFO):
        for step in range(20):
            now[0] += 20.0
            step_done(step)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "segmentation probe: 4000 steps, about 80000 s (20 s a step over the first 3)"
    assert lines[1:] == [f"segmentation probe: step {k} of 4000 ({20 * k} s)" for k in (3, 6, 9, 12, 15, 18)]


def test_probe_settings_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"the val split's masks hold label 7, above data.num_classes 5 \(labels 0..4"):
        seg.check_labels(torch.tensor([[[0, 255, 7]]], dtype=torch.uint8), 5, "val")
    seg.check_labels(torch.tensor([[[0, 255, 4]]], dtype=torch.uint8), 5, "val")
    with pytest.raises(UserError, match=r"segmentation.iterations 0 must be an integer >= 1"):
        seg.SegSchedule(iterations=0)
    _, ours = _dinov2_and_ours()
    with pytest.raises(UserError, match=r"segmentation.n_last_blocks 3 must be a block count from 1 to 2"):
        seg.patch_tokens(ours, 3)


def test_acceptance_on_an_ade20k_folder_with_timm_weights_under_ddp(ade20k, tmp_path):
    """The issue's command: task=segmentation data=segmentation data.data_dir=<ADE20k layout> model=<name>, with
    model.pretrained=<a weights file of timm's names>, in 2 processes (trainer=ddp_cpu): seg/mIoU and seg/aAcc in
    metrics.json, and the cached features those of one process."""
    from vitlab.data import SegmentationDataModule
    from vitlab.evaluation.features import split_features

    torch.manual_seed(0)
    model = ViT(ViTConfig(img_size=28, patch_size=7, in_chans=3, num_classes=0, embed_dim=48, depth=2, num_heads=4))
    torch.save(model.eval().state_dict(), tmp_path / "weights.pth")  # timm's names
    args = ["task=segmentation", "data=segmentation", f"data.data_dir={ade20k}", "data.num_classes=4",
            "model=vit_digits", "model.img_size=28", "model.patch_size=7", "model.embed_dim=48", "model.depth=2",
            f"model.pretrained={tmp_path / 'weights.pth'}", "segmentation.iterations=30",
            "segmentation.warmup_iters=5", "segmentation.batch_size=4", "data.batch_size=2", "data.num_workers=0",
            "trainer=ddp_cpu",
            f"features_dir={tmp_path / 'features'}", "progress_bar=none"]  # fmt: skip
    r = run_cli("eval", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads(next((tmp_path / "outputs").rglob("metrics.json")).read_text())
    assert 0.0 < metrics["seg/mIoU"] <= 1.0 and 0.0 < metrics["seg/aAcc"] <= 1.0
    assert metrics["seg/reported_on"] == "val"
    dm = SegmentationDataModule(data_dir=str(ade20k), num_classes=4, img_size=28, batch_size=2, num_workers=0)
    dm.setup()
    tokens = seg.PatchTokens((1,))
    feats, masks = split_features(model, dm, "val", torch.device("cpu"), None, {}, tokens, dm.seg_view("val"),
                                  ((28, 28), torch.uint8))  # fmt: skip
    np.testing.assert_allclose(np.load(tmp_path / "features" / "val.patches1.npy"), feats.numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.load(tmp_path / "features" / "val.patches1.labels.npy"), masks.numpy())


def test_a_checkpoint_on_the_embedded_default(digits_ckpt, compose_cfg, caplog, tmp_path):
    """A checkpoint's patch tokens (the shared digits run: gray, so data.channels=1) on the embedded canvases: the
    probe scores them, and a second evaluation reads the cached features instead of running the model."""
    import logging

    from vitlab.eval import evaluate

    args = [
        f"ckpt_path={digits_ckpt}",
        "task=segmentation",
        "data=segmentation",
        "data.channels=1",
        "data.canvases=[64,16,32]",
        f"features_dir={tmp_path / 'features'}",
    ]  # fmt: skip  (the shared run's folder is read, never written)
    with caplog.at_level(logging.INFO):
        first = evaluate(compose_cfg("eval", args))
    assert first["seg/reported_on"] == "test" and 0.0 < first["seg/mIoU"] <= 1.0
    # DINOv2's epochs of the 64 training canvases (issue 74, point 4), said with an estimate of their time
    assert "segmentation probe: 127 iterations of 16 (31.7 epochs of the 64 training images" in caplog.text
    assert "segmentation probe: 127 steps, about " in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = evaluate(compose_cfg("eval", args))
    assert "test.patches3 features: read from" in caplog.text
    assert again["seg/mIoU"] == first["seg/mIoU"] and again["seg/aAcc"] == first["seg/aAcc"]
    from vitlab.utils.errors import UserError  # the canvases in colour (the default) for this gray checkpoint

    with pytest.raises(UserError, match=r"^checkpoint expects 1 channels, but the data has 3: set data.channels=1$"):
        evaluate(compose_cfg("eval", [a for a in args if a != "data.channels=1"]))


def test_data_without_masks_is_refused_in_one_line(digits_ckpt, compose_cfg):
    from vitlab.eval import evaluate

    with pytest.raises(UserError, match=r"task=segmentation needs images with class masks, data=segmentation"):
        evaluate(compose_cfg("eval", [f"ckpt_path={digits_ckpt}", "task=segmentation"]))


def test_cached_features_follow_the_folder_and_its_masks(digits_ckpt, compose_cfg, tmp_path, caplog):
    """Issue 74, point 1, as typed on a checkpoint: task=knn data.data_dir=<another folder with as many images>, and
    task=segmentation after the validation masks were corrected: the features extracted anew (said) and the scores
    those of an empty cache; a mask's label above the classes then refused, not hidden by the cache."""
    import logging

    from vitlab.eval import evaluate

    a, b = (segmentation_tree(tmp_path / n, classes=4, per_split=(12, 3), seed=s) for n, s in (("a", 0), ("b", 1)))

    def run(task, data_dir, cache, key):
        args = [f"ckpt_path={digits_ckpt}", f"task={task}", "data=segmentation", f"data.data_dir={data_dir}",
                "data.channels=1", "data.num_classes=10", "data.num_workers=0", "knn.k=[10]",
                "segmentation.iterations=20", "segmentation.warmup_iters=5", "segmentation.batch_size=4",
                f"features_dir={tmp_path / cache}"]  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO):
            return evaluate(compose_cfg("eval", args))[key], caplog.text

    changed = "val features: re-extracted: the data changed"
    run("knn", a, "knn", "knn/top1_k10")
    found, said = run("knn", b, "knn", "knn/top1_k10")
    assert changed in said and "train features: re-extracted" in said
    assert found == run("knn", b, "knn-fresh", "knn/top1_k10")[0]
    first = run("segmentation", a, "seg", "seg/mIoU")[0]
    for mask in sorted((a / "annotations" / "validation").iterdir()):  # corrected: every pixel class 1
        Image.open(mask).point(lambda _: 2).save(mask)
    found, said = run("segmentation", a, "seg", "seg/mIoU")
    assert "val.patches3 features: re-extracted: the data changed (its images, labels or masks)" in said
    assert "train.patches3 features: read from" in said
    assert found == run("segmentation", a, "seg-fresh", "seg/mIoU")[0] != first
    mask = a / "annotations" / "validation" / "0.png"
    Image.fromarray(np.full((30, 30), 12, np.uint8)).resize(Image.open(mask).size).save(mask)  # label 11 after -1
    with pytest.raises(UserError, match="holds label 11"):
        run("segmentation", a, "seg", "seg/mIoU")
