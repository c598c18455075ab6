"""DINO's multi-crop views made a batch at a time (data/multicrop.py) equal torchvision's per-image operations, with
each image's own draws: the colour jitter's four adjustments, grayscale, Gaussian blur, solarisation and the resized
crop; the crops' boxes are drawn as RandomResizedCrop.get_params draws them; the views come from the generator alone
(the same generator state, the same views), and every data module makes them for objective=dino."""

import pytest
import torch
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from tests.helpers.trainers import fake_trainer
from vitlab.data import multicrop as M
from vitlab.utils.errors import UserError


@pytest.fixture
def images():
    torch.manual_seed(0)
    return torch.rand(6, 3, 20, 24)


@pytest.mark.parametrize("op, fn", [(0, TF.adjust_brightness), (1, TF.adjust_contrast), (2, TF.adjust_saturation),
                                    (3, TF.adjust_hue)])  # fmt: skip
@pytest.mark.parametrize("channels", [3, 1])
def test_each_colour_adjustment_is_torchvisions_with_each_images_factor(images, op, fn, channels):
    x = images[:, :channels]
    factors = (
        torch.tensor([0.6, 1.4, 0.9, 1.1, 1.0, 0.75]) if op < 3 else torch.tensor([-0.1, 0.1, 0, 0.05, -0.03, 0.5])
    )
    expected = torch.stack([fn(x[i], float(factors[i])) for i in range(len(x))])
    torch.testing.assert_close(M.adjust(x, op, factors), expected, atol=1e-6, rtol=1e-6)


def test_colour_jitter_applies_the_four_in_each_images_order(images):
    factors, order = M.jitter_params(len(images), (0.4, 0.4, 0.2, 0.1), torch.Generator().manual_seed(1))
    assert order.sort(-1).values.tolist() == [[0, 1, 2, 3]] * len(images)  # a permutation each
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    expected = []
    for i, img in enumerate(images):  # torchvision's ColorJitter.forward with these draws
        for op in order[i].tolist():
            img = fns[op](img, float(factors[i, op]))
        expected.append(img)
    torch.testing.assert_close(M.color_jitter(images, factors, order), torch.stack(expected), atol=1e-5, rtol=1e-5)
    low, high = factors.min(0).values, factors.max(0).values
    assert (low >= torch.tensor([0.6, 0.6, 0.8, -0.1])).all() and (high <= torch.tensor([1.4, 1.4, 1.2, 0.1])).all()


def test_grayscale_blur_and_solarisation_are_torchvisions_and_pils(images):
    torch.testing.assert_close(M.grayscale(images), TF.rgb_to_grayscale(images), atol=1e-6, rtol=1e-6)
    sigma = torch.tensor([0.1, 0.5, 1.0, 1.5, 2.0, 0.3])
    expected = torch.stack(
        [TF.gaussian_blur(img, [9, 9], [float(s)] * 2) for img, s in zip(images, sigma, strict=True)]
    )
    torch.testing.assert_close(M.gaussian_blur(images, 9, sigma), expected, atol=1e-6, rtol=1e-6)
    as_uint8 = (images * 255).round().to(torch.uint8)  # PIL's ImageOps.solarize: values >= 128 inverted
    solarized = torch.where(as_uint8.float() / 255 >= M.SOLARIZE, 1 - as_uint8.float() / 255, as_uint8.float() / 255)
    assert torch.equal((solarized * 255).round().to(torch.uint8), TF.solarize(as_uint8, 128))


def test_the_crop_is_torchvisions_bicubic_resized_crop_away_from_its_edge():
    """torchvision repeats the crop's edge pixels, one grid_sample over the whole image reads the pixels beyond it:
    equal wherever the cubic kernel stays inside the crop (2 source pixels), and everywhere for the whole image."""
    torch.manual_seed(2)
    x = torch.rand(3, 3, 40, 40)
    boxes = torch.tensor([[4, 6, 20, 24], [0, 0, 40, 40], [10, 3, 24, 30]])
    flip = torch.tensor([False, True, False])
    ours = M.crop_resize(x, boxes, flip, 48)
    for i in range(3):
        top, left, h, w = boxes[i].tolist()
        ref = TF.resized_crop(x[i], top, left, h, w, [48, 48], InterpolationMode.BICUBIC, antialias=False).clamp(0, 1)
        ref = TF.horizontal_flip(ref) if flip[i] else ref
        margin = 0 if (h, w) == (40, 40) else 5
        inner = (slice(None), slice(margin, 48 - margin), slice(margin, 48 - margin))
        torch.testing.assert_close(ours[i][inner], ref[inner], atol=1e-5, rtol=1e-5)


def test_boxes_are_random_resized_crops_and_fall_back_to_the_centre():
    boxes = M.resized_crop_boxes(4000, (20, 24), (0.05, 0.4), (3 / 4, 4 / 3), torch.Generator().manual_seed(3))
    top, left, h, w = boxes.unbind(-1)
    assert ((top >= 0) & (left >= 0) & (top + h <= 20) & (left + w <= 24) & (h > 0) & (w > 0)).all()
    area = (h * w).float() / 480
    assert 0.03 < area.min() and area.max() < 0.45  # the scale range, give or take the rounding
    assert top.unique().numel() > 10 and left.unique().numel() > 10
    # no try fits a 1 x 30 strip at aspect 3/4..4/3 and scale ~1: torchvision's fallback, the centre crop
    strip = M.resized_crop_boxes(3, (1, 30), (0.99, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(4))
    assert strip.tolist() == [[0, 14, 1, 1]] * 3  # w = round(1 x 4/3) = 1, centred: (30 - 1) // 2


def test_the_views_come_from_the_generator_alone():
    torch.manual_seed(5)
    x = torch.rand(5, 3, 16, 16)
    cfg = M.MultiCropConfig(local_size=8, local_crops=3)
    views = M.Views(
        {"crops": {"global_size": 16, "local_size": 8, "local_crops": 3}, "masks": {}}, [0.5] * 3, [0.25] * 3
    )
    a, masks = views(x, torch.Generator().manual_seed(9))
    b, _ = views(x, torch.Generator().manual_seed(9))
    c, _ = views(x, torch.Generator().manual_seed(10))
    assert masks is None and [v.shape for v in a] == [(5, 3, 16, 16)] * 2 + [(5, 3, 8, 8)] * 3
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)) and not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])  # the two global views differ
    assert cfg.blur_prob == (1.0, 0.1, 0.5) and cfg.solarize_prob == (0.0, 0.2, 0.0)


def test_masked_views_carry_ibots_masks_on_the_patch_grid():
    x = torch.rand(4, 1, 16, 16)
    settings = {"crops": {"global_size": 16, "local_crops": 0}, "masks": {"probability": 0.5, "ratio": [0.1, 0.5],
                                                                            "patch": [4, 4]}}  # fmt: skip
    views, masks = M.Views(settings, [0.5], [0.25])(x, torch.Generator().manual_seed(0))
    assert len(views) == 2 and masks.shape == (8, 16) and masks.dtype == torch.bool
    assert (masks.sum(1) > 0).sum() == 4  # int(8 x 0.5) of the global crops


@pytest.mark.parametrize(
    "settings, said",
    [
        ({"global_scale": [0.5, 0.4]}, "objective.crops.global_scale [0.5, 0.4] must be [low, high]"),
        ({"blur_prob": [1.0, 0.1]}, "objective.crops.blur_prob [1.0, 0.1] must be three chances"),
        ({"blur_kernel": 4}, "objective.crops.blur_kernel 4 must be an odd number"),
        ({"color_jitter": [0.4, 0.4, 0.2, 0.7]}, "objective.crops.color_jitter [0.4, 0.4, 0.2, 0.7] must be"),
        ({"local_crops": -1}, "objective.crops.local_crops"),
        ({"zoom": 2}, "zoom"),
    ],
)
def test_bad_crop_settings_are_one_line_each(settings, said):
    with pytest.raises(UserError, match=None) as e:
        M.MultiCropConfig.from_dict(settings)
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("data", ["digits", "fake", "imagefolder", "streaming"])
def test_every_data_module_makes_the_views_of_its_training_batches(data, request):
    """objective=dino's data modules (training.run.build.build_datamodule passes `multicrop`): photos (a folder,
    shards) give views cut from each whole image in the workers; data held at one size gives its images squared at the
    source size, the views made on the device; validation batches as ever."""

    from vitlab.data import DigitsDataModule, FakeDataModule, ImageFolderDataModule
    from vitlab.data.streaming import StreamingDataModule

    views = {"crops": {"global_size": 16, "local_size": 8, "local_crops": 2}, "masks": {}}
    common = {"img_size": 16, "batch_size": 4, "multicrop": views}
    make = {
        "digits": lambda: DigitsDataModule(**common),
        "fake": lambda: FakeDataModule(num_train=8, num_classes=2, **common),
        "imagefolder": lambda: ImageFolderDataModule(
            data_dir=str(request.getfixturevalue("folder")), num_workers=0, num_classes=3, **common
        ),  # fmt: skip
        "streaming": lambda: StreamingDataModule(
            data_dir=str(request.getfixturevalue("shards")), num_classes=3, num_workers=0, **common
        ),  # fmt: skip
    }
    dm = make[data]()
    dm.trainer = fake_trainer()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    if data in ("imagefolder", "streaming"):  # photos: the views cut in the workers from each whole image, as uint8
        assert [(v.dtype, tuple(v.shape[-2:])) for v in x] == [(torch.uint8, (16, 16))] * 2 + [
            (torch.uint8, (8, 8))
        ] * 2
    else:  # held at one size: the images squared, the views cut on the device
        assert x.dtype == torch.uint8 and tuple(x.shape[-2:]) == (16, 16)
    (crops, masks), labels = dm.device_transform((x, y), train=True)
    assert masks is None and torch.equal(labels, y)
    assert [tuple(v.shape) for v in crops] == [(4, dm.channels, 16, 16)] * 2 + [(4, dm.channels, 8, 8)] * 2
    val, _ = dm.device_transform(next(iter(dm.val_dataloader())), train=False)
    assert isinstance(val, torch.Tensor) and val.dtype == torch.float32


def test_a_view_of_an_image_is_its_global_batch_row_s_whichever_process_holds_it():
    """Issue 78: drawn from the Rows of a global batch (data/seeded.py), two processes' views of their halves are the
    one process's views of the whole batch, row for row (crop, flip, jitter, grayscale, blur, solarisation)."""
    from vitlab.data.seeded import batch_rows

    cfg = M.MultiCropConfig.from_dict({"global_size": 16, "local_size": 8, "local_crops": 2})
    crop = M.MultiCrop(cfg, 16, (0.5,) * 3, (0.25,) * 3)
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    whole = crop(x, batch_rows(7, 1, 3, rank=0, rows=8, processes=1))
    halves = [crop(x[r * 4 : (r + 1) * 4], batch_rows(7, 1, 3, rank=r, rows=4, processes=2)) for r in range(2)]
    for view, (a, b) in zip(whole, zip(*halves, strict=True), strict=True):
        torch.testing.assert_close(view, torch.cat([a, b]), rtol=0, atol=1e-6)
    other = crop(x, batch_rows(7, 1, 4, rank=0, rows=8, processes=1))  # the next batch: other draws
    assert not torch.allclose(other[0], whole[0])
