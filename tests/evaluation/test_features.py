"""vitlab.evaluation.features (issue 23, point 2): any block's features through forward_intermediates, DINOv2's
linear-probe inputs, and the features of a split extracted by several DDP processes: the rows one process extracts, in
the same order, written once by rank 0."""

import json

import numpy as np
import pytest
import torch

from tests.helpers.commands import run_cli
from tests.helpers.configs import tiny
from vitlab.evaluation.features import POOLED, Layers, layers_of
from vitlab.evaluation.tasks import linear_views
from vitlab.model import ViT
from vitlab.utils.errors import UserError


def dinov2_linear_input(model, x, n, avgpool):
    """DINOv2's create_linear_input, written from eval/linear.py: get_intermediate_layers(x, n, return_class_token=
    True) normed, the class tokens of the last n blocks concatenated, then the last block's mean patch token."""
    depth, prefix = len(model.blocks), model.num_prefix_tokens
    names = [f"blocks.{i}" for i in range(depth - n, depth)]
    outs = [model.norm(t) for t in model.intermediates_by_name(x, names).values()]
    feats = [t[:, 0] for t in outs]  # class tokens
    if avgpool:
        feats.append(outs[-1][:, prefix:].mean(1))  # patch tokens: registers left out
    return torch.cat(feats, dim=-1)


@torch.no_grad()
def test_layers_give_dinov2s_linear_inputs_and_the_pooled_features():
    model = ViT(tiny(depth=4, reg_tokens=2)).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    assert torch.equal(POOLED.extract(model, x), pooled)
    torch.testing.assert_close(layers_of(model, -1).extract(model, x), pooled)  # the last class token, normed
    layers, views = linear_views(None, {"n_last_blocks": [1, 4], "avgpool": [False, True]}, model)
    assert layers == Layers((0, 1, 2, 3), avgpool=True) and layers.name == "blocks0-3+avgpool"
    assert list(views) == ["last1", "last1+avgpool", "last4", "last4+avgpool"]  # DINOv2's order
    feats = layers.extract(model, x)
    assert feats.shape == (3, layers.dim(model)) == (3, 5 * 32)
    for n, avgpool in [(1, False), (1, True), (4, False), (4, True)]:
        view = feats[:, views[f"last{n}" + ("+avgpool" if avgpool else "")]]
        torch.testing.assert_close(view, dinov2_linear_input(model, x, n, avgpool), rtol=1e-5, atol=1e-6)
    two = layers_of(model, [2, -4])  # any blocks, in block order
    assert two.name == "blocks0_2"
    torch.testing.assert_close(
        two.extract(model, x), dinov2_linear_input(model, x, 4, False)[:, [*range(32), *range(64, 96)]]
    )


def test_layers_that_do_not_exist_are_named():
    model = ViT(tiny(depth=2))
    with pytest.raises(UserError, match=r"layers=5 must be block indices from -2 to 1 \(the model has 2\)"):
        layers_of(model, 5)
    with pytest.raises(UserError, match="has none"):
        layers_of(ViT(tiny(class_token=False, global_pool="avg")), [-1])
    linear = {"n_last_blocks": [1, 4], "avgpool": [False]}
    with pytest.raises(UserError, match=r"linear.n_last_blocks=\[1, 4\] must list block counts from 1 to 2"):
        linear_views(None, linear, model)
    linear["n_last_blocks"] = None  # the features `layers` picks, one configuration
    assert linear_views(None, linear, model) == (POOLED, {"pooled": slice(None)})
    linear = {"n_last_blocks": 2, "avgpool": True}  # a bare value is a list of one
    assert linear_views(-1, linear, model)[1] == {"last2+avgpool": slice(0, 3 * 32)}


def _cached(folder, stem):
    return (
        np.load(folder / f"{stem}.npy"),
        np.load(folder / f"{stem}.labels.npy"),
        json.loads((folder / f"{stem}.json").read_text()),
    )


@pytest.mark.parametrize("task", ["knn", "linear"])  # the pooled features; DINOv2's, through forward_intermediates
def test_features_are_the_same_with_one_and_two_ddp_processes(digits_ckpt, compose_cfg, tmp_path, task):
    """A batch of 157: 1,257 training images make 4 rounds of 2 x 157 and one image, in rank 0's share only. The
    pooled features' two processes go on from a cache one process left after 100 rows (the rest zeroed)."""
    import shutil

    from vitlab.eval import evaluate

    args = [
        f"ckpt_path={digits_ckpt}",
        f"task={task}",
        "data.batch_size=157",
        "linear.iterations=5",
        "linear.lrs=[0.01]",
    ]
    one = evaluate(compose_cfg("eval", [*args, f"features_dir={tmp_path / 'one'}"]))
    if task == "knn":  # as if one process had stopped after 100 training images
        shutil.copytree(tmp_path / "one", tmp_path / "two")
        stopped = np.load(tmp_path / "two" / "train.npy", mmap_mode="r+")
        stopped[100:] = 0
        stopped.flush()
        meta = json.loads((tmp_path / "two" / "train.json").read_text())
        (tmp_path / "two" / "train.json").write_text(json.dumps(meta | {"done": 100}))
        (tmp_path / "two" / "test.json").unlink()
    r = run_cli("eval", *args, "trainer=ddp_cpu", f"features_dir={tmp_path / 'two'}", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((tmp_path / "r" / "metrics.json").read_text())
    stems = {"knn": ["train", "test"], "linear": [f"{s}.blocks0-3+avgpool" for s in ("train", "val", "test")]}[task]
    for stem in stems:
        (f1, y1, meta1), (f2, y2, meta2) = _cached(tmp_path / "one", stem), _cached(tmp_path / "two", stem)
        assert meta1 == meta2 and meta2["done"] == meta2["n"] == len(f2)
        np.testing.assert_allclose(f2, f1, rtol=0, atol=1e-6)
        assert np.array_equal(y1, y2)
    if task == "knn":
        assert {k: v for k, v in two.items() if "/" in k} == pytest.approx({k: v for k, v in one.items() if "/" in k})
    else:  # DINOv2's step on both processes' batches of 128 (lr x 2 x 128 / 256), from the features one cached
        from tests.evaluation.test_linear import VIEWS64
        from vitlab.evaluation.linear import Schedule, linear_grid

        assert (
            "batch 128 x 2 processes" in two["linear/protocol"] and "lr x 1 (128 x 2 / 256)" in two["linear/protocol"]
        )
        (tr, ty, _), (va, vy, _), (te, tey, _) = (_cached(tmp_path / "one", stem) for stem in stems)
        found = linear_grid(VIEWS64, *map(torch.from_numpy, (tr, ty, va, vy, te, tey)), 10,
                            Schedule(iterations=5, world=2, lrs=(0.01,)))  # fmt: skip
        assert (two["linear/top1"], two["linear/features"]) == (pytest.approx(found["test_acc"]), found["features"])
    # Written once: rank 0 says where it cached each split; the other process caches nothing.
    assert r.stderr.count("features: ") + r.stdout.count("features: ") == len(stems)
    (child,) = (tmp_path / "r").glob("*_rank1.log")  # rank 1's log, named as README says
    assert "features: " not in child.read_text()


def test_cached_features_answer_only_for_the_data_they_were_made_from(compose_cfg, tmp_path, caplog):
    """Issue 74, point 1: task=knn on an image folder, then again with three test images moved to another class:
    the features are extracted anew (said), and the score is that of an empty cache; the same data again reads the
    cache. (Weights of timm's names in a file, random: what differs is the data.)"""
    import logging
    import shutil

    from tests.helpers.images import image_tree
    from vitlab.eval import evaluate

    torch.manual_seed(0)
    model = ViT(tiny(img_size=8, patch_size=4, num_classes=0, embed_dim=32, depth=2, num_heads=4))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    folder = image_tree(tmp_path / "a", [str(i) for i in range(4)], per_class=4)

    def knn(cache):
        args = ["task=knn", "model=vit_digits", f"model.pretrained={tmp_path / 'w.pth'}", "model.in_chans=3",
                "model.embed_dim=32", "model.depth=2", "data=imagefolder", f"data.data_dir={folder}",
                "data.num_workers=0", "knn.k=[10]", f"features_dir={tmp_path / cache}",
                f"paths.log_dir={tmp_path}"]  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO):
            found = evaluate(compose_cfg("eval", args))
        return found["knn/top1_k10"], caplog.text

    first = knn("cache")
    assert "val features: read from" in knn("cache")[1]
    for i, name in enumerate(("0.png", "1.png", "2.png")):  # three of class 0's test images into class 1's folder
        shutil.move(folder / "val" / "0" / name, folder / "val" / "1" / f"moved{i}.png")
    cached, said = knn("cache")
    assert "val features: re-extracted: the data changed (its images, labels or masks)" in said
    assert "val features: read from" not in said and "train features: read from" in said
    assert cached == knn("fresh")[0] != first
