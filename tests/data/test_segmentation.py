"""data=segmentation (issue 68, point 1): the embedded canvases, ADE20k's and VOC's folders, masks read as mmseg reads
them and prepared with their images, and the folders whose masks do not fit refused in one line."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.images import segmentation_tree
from vitlab.data import SegmentationDataModule
from vitlab.data.masks import IGNORE, MaskResizeCrop, image_label, read_mask
from vitlab.utils.errors import MissingFileError, UserError


def _module(**kwargs) -> SegmentationDataModule:
    dm = SegmentationDataModule(**{"img_size": 32, "batch_size": 4, "num_workers": 0} | kwargs)
    dm.setup()
    return dm


def test_the_embedded_canvases_are_fixed_and_labelled_by_their_digits():
    """The same canvases in every build; each split's own; 11 classes; a digit's pixels are bright (its ink), the
    background dark; an image's label its mask's most frequent digit (background aside)."""
    a, b = _module(canvases=[16, 8, 8]), _module(canvases=[16, 8, 8])
    images, masks = a.bases["train"].images, a.bases["train"].masks
    assert (
        images.shape == (16, 3, 32, 32) and masks.shape == (16, 32, 32) and images.dtype == masks.dtype == torch.uint8
    )
    assert torch.equal(images, b.bases["train"].images) and torch.equal(masks, b.bases["train"].masks)
    assert not torch.equal(a.bases["val"].images, a.bases["test"].images)
    assert int(masks.max()) <= 10 and a.num_classes == 11 and a.class_names[0] == "background"
    gray = images.float().mean(1)
    assert gray[masks > 0].mean() > gray[masks == 0].mean() + 100
    labels = [a.train_set[i][1] for i in range(16)]
    assert labels == [int(torch.bincount(m[m > 0].long(), minlength=11).argmax()) for m in masks]
    gray_module = _module(canvases=[4, 2, 2], channels=1)
    image, mask = gray_module.seg_view("test")[0]
    assert image.shape == (1, 32, 32) and mask.shape == (32, 32)


def test_masks_are_read_as_mmseg_reads_them(tmp_path):
    """ADE20k's reduce_zero_label: 0 ignored, k -> k - 1 (255 stays ignored); a VOC palette PNG's indices."""
    labels = np.array([[0, 1, 2], [150, 255, 3]], np.uint8)
    Image.fromarray(labels).save(tmp_path / "gray.png")
    assert read_mask(tmp_path / "gray.png").tolist() == labels.tolist()
    assert read_mask(tmp_path / "gray.png", reduce_zero_label=True).tolist() == [[255, 0, 1], [149, 255, 2]]
    palette = Image.fromarray(labels, mode="P")
    palette.putpalette([v for i in range(256) for v in (i, 255 - i, 7)])
    palette.save(tmp_path / "voc.png")
    assert read_mask(tmp_path / "voc.png").tolist() == labels.tolist()
    Image.fromarray(np.zeros((2, 3, 3), np.uint8)).save(tmp_path / "rgb.png")
    with pytest.raises(UserError, match=r"mask .*rgb.png' is of mode RGB: a mask holds one class index a pixel"):
        read_mask(tmp_path / "rgb.png")
    assert image_label(torch.tensor([[0, 0, 0, 2], [2, 255, 255, 255]]), background=0) == 2
    assert image_label(torch.tensor([[0, 0, 0, 2]]), background=None) == 0


@pytest.mark.parametrize("crop_mode", ["center", "border"])
def test_a_mask_is_resized_and_cropped_as_its_image(crop_mode):
    """The mask takes its image's geometry: PIL's nearest neighbour at the size the image is resized to (the image's
    resize is PIL's too), the same centre crop; padded with 255 where the image is padded (border). An image made of
    its mask's labels (x 50) comes out as its mask does, pixel for pixel."""
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(0, 5, (30, 45), generator=g, dtype=torch.uint8)
    image = mask[None].repeat(3, 1, 1) * 50
    prepare = MaskResizeCrop(
        (16, 16), {"crop_pct": 1.0, "crop_mode": crop_mode, "interpolation": "nearest"}, (0.5,) * 3
    )
    out_image, out_mask = prepare(image, mask)
    assert out_image.shape == (3, 16, 16) and out_mask.shape == (16, 16)
    if crop_mode == "center":  # shorter side 30 -> 16: (16, 24), then the centre 16 columns
        pil = np.array(Image.fromarray(mask.numpy()).resize((24, 16), Image.Resampling.NEAREST))
        assert out_mask.tolist() == pil[:, 4:20].tolist()
    else:  # longer side 45 -> 16: (11, 16), padded to 16 rows
        assert (out_mask[:2] == IGNORE).all() and (out_mask[-3:] == IGNORE).all()
    kept = out_mask != IGNORE
    assert torch.equal(out_image[0][kept], out_mask[kept] * 50)


def test_an_ade20k_folder(tmp_path):
    root = segmentation_tree(tmp_path / "ade", classes=3, per_split=(3, 2))
    dm = _module(data_dir=str(root), num_classes=3)
    assert dm.layout == "ade20k" and dm.reduce_zero_label and dm.test_set is None
    assert len(dm.seg_view("train")) == 3 and len(dm.seg_view("val")) == 2
    image, mask = dm.seg_view("val")[1]
    raw = np.array(Image.open(root / "annotations" / "validation" / "1.png"))
    assert image.shape == (3, 32, 32) and set(mask.unique().tolist()) <= {0, 1, 2, IGNORE}
    assert (mask == IGNORE).any() and (raw == 0).any()  # ADE20k's "other" (0) is ignored
    x, y = dm.device_transform(next(iter(dm._loader(dm.seg_view("train"), train=False))), train=False)
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (3, 32, 32)


def test_a_voc_folder(tmp_path):
    root = tmp_path / "VOC2012"
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("2007_000032", "2007_000039", "2007_000063"):
        Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(root / "JPEGImages" / f"{name}.jpg")
        labels = rng.integers(0, 21, (20, 30), dtype=np.uint8)
        labels[0] = 255  # the objects' borders
        Image.fromarray(labels, mode="P").save(root / "SegmentationClass" / f"{name}.png")
    (root / "ImageSets/Segmentation/train.txt").write_text("2007_000032\n2007_000039\n")
    (root / "ImageSets/Segmentation/val.txt").write_text("2007_000063\n")
    dm = _module(data_dir=str(root), num_classes=21)
    assert dm.layout == "voc" and not dm.reduce_zero_label
    assert [len(dm.seg_view(s)) for s in ("train", "val")] == [2, 1]
    (root / "ImageSets/Segmentation/val.txt").write_text("2007_000063\n2007_000099\n")
    with pytest.raises(UserError, match=r"val.txt lists 2007_000099, but .*2007_000099.jpg does not exist"):
        _module(data_dir=str(root), num_classes=21)


def _broken(tmp_path, how: str):
    root = segmentation_tree(tmp_path / "ade", classes=3, per_split=(3, 2))
    train = root / "annotations" / "training"
    if how == "names":
        (train / "1.png").rename(train / "1b.png")
    elif how == "size":
        Image.fromarray(np.ones((5, 7), np.uint8)).save(train / "2.png")
    elif how == "labels":
        Image.fromarray(np.full((30, 30), 9, np.uint8)).save(root / "annotations" / "validation" / "0.png")
        Image.fromarray(np.zeros((30, 30, 3), np.uint8)).save(root / "images" / "validation" / "0.jpg")
    return root


@pytest.mark.parametrize(
    "how, message",
    [
        ("names", r"the masks of .*annotations/training do not match the images of .*images/training by name: "
                  r"1 images without a mask \(first: 1.jpg\); 1 masks without an image \(first: 1b.png\)$"),
        ("size", r"mask '.*2.png' is 7x5 pixels but its image '.*2.jpg' is \d+x\d+: a mask must have its image's size"),
        ("labels", r"mask '.*validation/0.png' holds label 8 \(after data.reduce_zero_label's shift by -1\), above "
                   r"data.num_classes 3 \(labels 0..2, 255 ignored\): set data.num_classes to the data's class count"),
    ],
)  # fmt: skip
def test_masks_that_do_not_fit_are_refused_in_one_line(tmp_path, how, message):
    root = _broken(tmp_path, how)
    with pytest.raises(UserError, match=message) as e:
        _module(data_dir=str(root), num_classes=3)
    assert "\n" not in str(e.value)


def test_other_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match=r"data.data_dir '.*' is neither ADE20k's layout \(images/training"):
        _module(data_dir=str(tmp_path))
    with pytest.raises(MissingFileError, match=r"data.data_dir '.*nowhere' does not exist"):
        _module(data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"data.num_classes 5: the embedded canvases have 11"):
        _module(num_classes=5)
    with pytest.raises(UserError, match=r"data.layout 'coco' is not one of \['auto', 'ade20k', 'voc'\]"):
        _module(layout="coco")
