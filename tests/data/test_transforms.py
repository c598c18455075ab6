"""data.transforms: workers hand over uint8 images of the model's size; the device half (float,
normalisation, random erasing) gives what the old per-image CPU pipeline gave on the same crop."""

import pytest
import torch
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from vitlab.data.transforms import DeviceTransform, erase, erasing_boxes, eval_transform, train_transform

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("auto_augment", [None, "randaugment", "trivialaugment"])
def test_workers_return_uint8_images_of_img_size(auto_augment):
    img = torch.randint(0, 256, (3, 40, 30), dtype=torch.uint8)
    out = train_transform(32, auto_augment=auto_augment, shift=2, random_erasing=0.5)(img)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    out = eval_transform([32, 16], crop_pct=0.875)(img)
    assert out.shape == (3, 32, 16) and out.dtype == torch.uint8
    with pytest.raises(ValueError, match="auto_augment 'autoaug' is not one of"):
        train_transform(32, auto_augment="autoaug")
    with pytest.raises(ValueError, match=r"crop_pct 1.5 must be in \(0, 1\]"):
        eval_transform(32, crop_pct=1.5)


def test_the_device_half_equals_the_cpu_pipeline_it_replaced():
    crops = torch.randint(0, 256, (8, 3, 24, 20), dtype=torch.uint8)  # what the workers' crops hand over
    old = T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(list(MEAN), list(STD))])
    expected = torch.stack([old(c) for c in crops])
    new = DeviceTransform(MEAN, STD)(crops, train=True)
    assert new.dtype == torch.float32
    torch.testing.assert_close(new, expected, atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="takes uint8 batches"):
        DeviceTransform(MEAN, STD)(expected, train=False)


def test_random_erasing_on_the_batch_equals_torchvisions_erase_per_image():
    crops = torch.randint(0, 256, (64, 3, 24, 20), dtype=torch.uint8)
    boxes = erasing_boxes(64, (24, 20), p=0.5, generator=torch.Generator().manual_seed(0))
    x = DeviceTransform(MEAN, STD)(crops, train=False)
    ours = erase(x, boxes)
    for img, out, (i, j, h, w) in zip(x, ours, boxes.tolist(), strict=True):
        assert torch.equal(out, TF.erase(img, i, j, h, w, v=torch.tensor(0.0)) if h else img)
    # with the generator's same state, training draws those boxes
    erased = DeviceTransform(MEAN, STD, random_erasing=0.5)(crops, True, torch.Generator().manual_seed(0))
    assert torch.equal(erased, ours)
    assert torch.equal(DeviceTransform(MEAN, STD, random_erasing=0.5)(crops, train=False), x)  # eval: none


def test_erasing_boxes_follow_torchvisions_distribution():
    boxes = erasing_boxes(4000, (32, 48), p=0.5, generator=torch.Generator().manual_seed(1))
    top, left, h, w = boxes.T
    erased = h > 0
    assert 0.45 < erased.float().mean() < 0.55
    area = (h * w)[erased].float() / (32 * 48)
    assert area.min() > 0.01 and area.max() < 0.36  # 2-33% of the area, up to rounding
    assert (top + h <= 32).all() and (left + w <= 48).all() and (top >= 0).all() and (left >= 0).all()
    ratio = (h / w)[erased].float()
    assert ratio.min() > 0.2 and ratio.max() < 4.0  # 0.3-3.3, up to rounding of small boxes
    assert not erasing_boxes(100, (32, 48), p=0.0)[:, 2].any()
