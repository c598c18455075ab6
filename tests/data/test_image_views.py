"""objective=dino's views cut in the loader's workers from each whole image (data/image_views.py) are DINO's own
(main_dino.py DataAugmentationDINO, vendored verbatim under tests/reference/dino/) on a non-square photo, with the same
random draws: the same boxes, crop for crop, and pixels within the rounding of PIL's colour operations and the blur
(DINO's PIL radius, computed by box filters, against the kernel of 9 DINOv2 and the on-device path use)."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_sample_image
from torchvision import transforms as T1

from tests.helpers.references import reference
from vitlab.data.image_views import ImageViews
from vitlab.data.multicrop import MultiCropConfig

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # DataAugmentationDINO's normalisation


@pytest.fixture(scope="module")
def photo():
    """A real photo of 427 x 640 (scikit-learn's china.jpg) as DINO reads it (PIL) and as vitlab decodes it."""
    array = load_sample_image("china.jpg").copy()
    return Image.fromarray(array), torch.from_numpy(array).permute(2, 0, 1).contiguous()


@pytest.fixture
def boxes(monkeypatch):
    """Every RandomResizedCrop box drawn (torchvision's get_params, which DINO's transform and ours both call)."""
    drawn = []
    get_params = T1.RandomResizedCrop.get_params

    def record(img, scale, ratio):
        drawn.append(tuple(get_params(img, scale, ratio)))
        return drawn[-1]

    monkeypatch.setattr(T1.RandomResizedCrop, "get_params", staticmethod(record))
    return drawn


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def test_the_views_are_data_augmentation_dinos_with_the_same_draws(photo, boxes):
    pil, img = photo
    dino = reference("dino", "main_dino").DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 8)
    ours = ImageViews(MultiCropConfig(), 224)  # DINO's defaults (main_dino.py's argparse, DataAugmentationDINO)
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in (MEAN, STD))
    worst, means = 0.0, []
    for seed in range(3):
        _seed(seed)
        theirs = dino(pil)
        their_boxes = boxes[:]
        boxes.clear()
        _seed(seed)
        mine = [(v.float() / 255 - mean) / std for v in ours(img)]
        assert boxes == their_boxes and len(boxes) == 10  # the same crops of the whole photo, in the same order
        boxes.clear()
        assert [v.shape for v in mine] == [v.shape for v in theirs] == [(3, 224, 224)] * 2 + [(3, 96, 96)] * 8
        for a, b in zip(theirs, mine, strict=True):
            levels = ((a - b) * std * 255).abs()  # in 8-bit levels
            worst, means = max(worst, float(levels.max())), means + [float(levels.mean())]
    # measured: at most 41 levels (a blurred view, PIL's box-filter blur against a 9-tap kernel), 0.0-0.9 on average
    assert worst <= 48 and max(means) < 1.5, (worst, max(means))


def test_the_crop_alone_is_dinos_resized_crop_of_the_whole_photo(photo, boxes):
    """Colour and blur off: the first view is DINO's RandomResizedCrop (PIL, bicubic, antialiased) of the same box."""
    pil, img = photo
    crop = reference("dino", "main_dino").DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 0).global_transfo1.transforms[0]
    bare = MultiCropConfig(local_crops=0, hflip=0, color_jitter_prob=0, grayscale_prob=0, blur_prob=(0, 0, 0),
                           solarize_prob=(0, 0, 0))  # fmt: skip
    worst, means = 0.0, []
    for seed in range(4):
        _seed(seed)
        theirs = torch.from_numpy(np.array(crop(pil))).permute(2, 0, 1).float()
        _seed(seed)
        (view, info), _ = ImageViews(bare, 224).cut(img)
        top, left, h, w = boxes[0]
        assert boxes[1] == boxes[0] and info["box"] == [left, top, left + w, top + h]
        boxes.clear()
        diff = (theirs - view.float()).abs()
        worst = max(worst, float(diff.max()))
        means.append(float(diff.mean()))
    # PIL's and torchvision's antialiased bicubic on uint8: measured at most 5 levels, 0.003-0.19 on average
    assert worst <= 6 and max(means) < 0.25, (worst, max(means))
