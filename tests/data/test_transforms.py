"""data.transforms: workers hand over uint8 images of the model's size; the device half (float,
normalisation, random erasing) gives what the old per-image CPU pipeline gave on the same crop."""

import random

import numpy as np
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
    with pytest.raises(ValueError, match=r"auto_augment 'autoaug' is not one of \['randaugment', 'trivialaugment'\]"):
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
    assert boxes.shape == (64, 1, 4)
    x = DeviceTransform(MEAN, STD)(crops, train=False)
    ours = erase(x, boxes)
    for img, out, (i, j, h, w) in zip(x, ours, boxes[:, 0].tolist(), strict=True):
        assert torch.equal(out, TF.erase(img, i, j, h, w, v=torch.tensor(0.0)) if h else img)
    # with the generator's same state, training draws those boxes
    erased = DeviceTransform(MEAN, STD, random_erasing=0.5)(crops, True, torch.Generator().manual_seed(0))
    assert torch.equal(erased, ours)
    assert torch.equal(DeviceTransform(MEAN, STD, random_erasing=0.5)(crops, train=False), x)  # eval: none


def test_erasing_boxes_follow_timms_distribution():
    boxes = erasing_boxes(4000, (32, 48), p=0.5, generator=torch.Generator().manual_seed(1))
    top, left, h, w = boxes[:, 0].T
    erased = h > 0
    assert 0.45 < erased.float().mean() < 0.55
    area = (h * w)[erased].float() / (32 * 48)
    assert area.min() > 0.01 and area.max() < 0.36  # 2-33% of the area, up to rounding
    assert (top + h <= 32).all() and (left + w <= 48).all() and (top >= 0).all() and (left >= 0).all()
    ratio = (h / w)[erased].float()
    assert ratio.min() > 0.2 and ratio.max() < 4.0  # 0.3-3.3, up to rounding of small boxes
    assert not erasing_boxes(100, (32, 48), p=0.0)[..., 2].any()


def _timm_boxes(n, hw, p, count, seed):
    """timm's RandomErasing's boxes, read off what it erases: it fills with zeros on a batch of ones."""
    from timm.data.random_erasing import RandomErasing

    random.seed(seed)
    x = torch.ones(n, 1, *hw)
    RandomErasing(p, mode="const", max_count=count, device="cpu")(x)
    return x


def test_erasing_count_shares_the_area_among_1_to_count_boxes_as_timm():
    """With erasing_count=3 an erased image gets 1-3 boxes (uniformly), whose area is 2-33% of the image over their
    number, as timm's RandomErasing draws them: the erased fraction of the image agrees with timm's in the mean."""
    n, hw = 3000, (32, 48)
    boxes = erasing_boxes(n, hw, p=1.0, generator=torch.Generator().manual_seed(2), count=3)
    assert boxes.shape == (n, 3, 4)
    k = (boxes[..., 2] > 0).sum(1)
    assert set(k.tolist()) == {1, 2, 3} and all(abs((k == i).float().mean() - 1 / 3) < 0.04 for i in (1, 2, 3))
    ours = erase(torch.ones(n, 1, *hw), boxes)
    theirs = _timm_boxes(n, hw, 1.0, 3, seed=2)
    frac_ours, frac_timm = (1 - ours).mean(), (1 - theirs).mean()
    assert abs(frac_ours - frac_timm) < 0.01, (frac_ours, frac_timm)
    one = erase(torch.ones(n, 1, *hw), erasing_boxes(n, hw, 1.0, torch.Generator().manual_seed(3)))
    assert abs((1 - one).mean() - (1 - _timm_boxes(n, hw, 1.0, 1, seed=3)).mean()) < 0.01


@pytest.mark.parametrize("mode", ["const", "rand", "pixel"])
def test_erasing_modes_fill_as_timms(mode):
    """const: zeros; rand: one standard-normal colour per box and channel; pixel: standard-normal noise. The same
    generator state gives the same fill (a resumed run erases alike)."""
    crops = torch.randint(0, 256, (256, 3, 24, 20), dtype=torch.uint8)
    t = DeviceTransform(MEAN, STD, random_erasing=1.0, mode=mode, count=1)
    x = DeviceTransform(MEAN, STD)(crops, train=False)
    out = t(crops, True, torch.Generator().manual_seed(0))
    assert torch.equal(out, t(crops, True, torch.Generator().manual_seed(0)))
    boxes = erasing_boxes(256, (24, 20), 1.0, torch.Generator().manual_seed(0))
    inside = erase(torch.zeros(256, 1, 24, 20), boxes, "const") == 0  # everything: the zeros stay zeros
    mask = erase(torch.ones(256, 1, 24, 20), boxes, "const") == 0
    assert inside.all() and mask.any()
    mask = mask.expand_as(x)
    assert torch.equal(out[~mask], x[~mask])  # outside the boxes: untouched
    filled = out[mask]
    if mode == "const":
        assert not filled.any()
    else:
        assert abs(filled.mean()) < 0.1 and abs(filled.std() - 1) < 0.15
        values = [out[i, c][mask[i, c]].unique().numel() for i in range(256) for c in range(3) if mask[i, c].any()]
        if mode == "rand":
            assert set(values) == {1}  # one colour a box and channel
        else:
            assert sum(v > 1 for v in values) > 0.9 * len(values)  # noise


def test_erasing_settings_are_checked():
    with pytest.raises(ValueError, match=r"erasing_mode 'noise' is not one of \['const', 'rand', 'pixel'\]"):
        train_transform(32, erasing_mode="noise")
    with pytest.raises(ValueError, match=r"erasing_count 0 must be a number of boxes >= 1"):
        train_transform(32, erasing_count=0)


TIMM_POLICIES = ["rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd0.5", "augmix-m5-w4-d2", "3a", "v0", "original"]


@pytest.mark.parametrize("policy", TIMM_POLICIES)
def test_timm_policies_are_timms_own_transform_on_the_same_seeds(policy):
    """A timm policy string runs timm's own code in the workers: on the same seeds (torch, Python, numpy, as
    TransformDataset seeds them) our uint8 output equals what timm's create_transform's policy stage makes of the
    same image, with the same fill (the data's mean), translation (45% of img_size) and interpolation."""
    from timm.data import create_transform

    img = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    ours = train_transform(32, MEAN, random_resized_crop=None, hflip=0.0, auto_augment=policy)
    _, theirs, _ = create_transform(
        32, is_training=True, auto_augment=policy, interpolation="bicubic", mean=MEAN, std=STD,
        color_jitter=None, hflip=0.0, separate=True,
    )  # fmt: skip
    for seed in range(8):
        seed_all(seed)
        a = ours(img)
        seed_all(seed)
        b = theirs(TF.to_pil_image(img))
        assert a.dtype == torch.uint8 and a.shape == (3, 32, 32)
        assert torch.equal(a, TF.pil_to_tensor(b)), (policy, seed)


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_a_bad_timm_policy_is_one_line():
    for bad in ("rand-x9", "v9", "augmix-q3", "deit"):
        with pytest.raises(ValueError, match=rf"auto_augment {bad!r} is not one of .* or a timm policy string"):
            train_transform(32, auto_augment=bad)


def test_colour_grayscale_blur_and_simple_crop_keep_uint8_of_img_size():
    """DeiT III's pieces: the simple random crop (resize, 4 px reflected crop), 3-Augment with colour jitter, and
    SimCLR's grayscale and blur probabilities, all on uint8."""
    img = torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8)
    t = train_transform(
        32, MEAN, random_resized_crop=None, simple_crop=True, auto_augment="3a", color_jitter=0.3,
        grayscale_prob=0.5, gaussian_blur_prob=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    outs = [t(img) for _ in range(6)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.uint8 for o in outs)
    assert len({o.sum().item() for o in outs}) > 1  # random
    gray = train_transform(32, random_resized_crop=None, hflip=0.0, grayscale_prob=1.0)(img)
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    with pytest.raises(ValueError, match=r"simple_crop=true replaces random-resized-crop"):
        train_transform(32, simple_crop=True)
    with pytest.raises(ValueError, match=r"color_jitter \[0.1, 0.2\] must be a number >= 0"):
        train_transform(32, color_jitter=[0.1, 0.2])


# ---- evaluation's resize and crop, as timm's (transforms_imagenet_eval) ----

# timm's pretrained configs, one of each crop mode (read from timm's registry; nothing downloaded):
TIMM_EVAL_CONFIGS = [
    "vit_base_patch16_224.augreg2_in21k_ft_in1k",  # center, crop_pct 0.9, bicubic
    "vit_base_patch16_224_miil.in21k_ft_in1k",  # center, 0.875, bilinear
    "vit_base_patch16_clip_384.openai_ft_in12k_in1k",  # squash, 0.95, bicubic
    "vit_base_patch16_sapiens2.fb",  # squash, 1.0, bilinear, 1024 x 768 (not square)
    "deepseek_vit_412m.deepseek_v4_flash_vision_exp",  # border, 1.0, bicubic, 392
]


def _photo(path, h, w):
    """A photo-like image: smooth colour ramps (a bicubic filter overshoots on their edges) and fine noise."""
    from PIL import Image

    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(h * 7 + w)
    a = np.stack([xx * 255 / w, yy * 255 / h, ((xx // 23 + yy // 17) % 2) * 200 + 20], -1)
    a = np.clip(a + rng.normal(0, 12, a.shape), 0, 255).astype(np.uint8)
    Image.fromarray(a).save(path, **({"quality": 92} if path.suffix == ".jpg" else {}))
    return path


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A 4:3 JPEG (landscape) and a 3:4 PNG (portrait), as files: both decoders of read_image are on the path."""
    folder = tmp_path_factory.mktemp("photos")
    return [_photo(folder / "wide.jpg", 300, 400), _photo(folder / "tall.png", 400, 300)]


def _ours(path, img_size, mean, std, **settings):
    """Our whole evaluation path: the file decoded by read_image, the eval transform in a DataModule's workers,
    the normalisation on the device (predict_tensor runs both halves as the eval loader does)."""
    from vitlab.data.imagefolder import ImageFolderDataModule
    from vitlab.data.images import read_image

    dm = ImageFolderDataModule(
        data_dir=str(path.parent), num_classes=1, img_size=img_size, mean=mean, std=std, eval_transform=settings
    )
    return dm.predict_tensor(read_image(path))[0]


def _timms(path, data_config):
    from PIL import Image
    from timm.data import create_transform

    with Image.open(path) as img:
        return create_transform(**data_config)(img.convert("RGB"))


@pytest.mark.parametrize("name", TIMM_EVAL_CONFIGS)
def test_eval_input_equals_timms_for_its_pretrained_configs(name, photos):
    """For a 4:3 and a 3:4 image, the tensor our eval path makes with a pretrained config's crop_mode, crop_pct,
    interpolation, mean and std (as model.pretrained fills them in) is timm's create_transform(resolve_data_config)."""
    from timm.data import resolve_data_config
    from timm.models import get_pretrained_cfg

    from vitlab.convert.timm_hub import timm_pretrained_cfg

    cfg = timm_pretrained_cfg(name)
    settings = {k: cfg[k] for k in ("crop_pct", "crop_mode", "interpolation")}
    data_config = resolve_data_config(pretrained_cfg=get_pretrained_cfg(name).to_dict())
    assert {k: data_config[k] for k in settings} == settings and data_config["input_size"] == cfg["input_size"]
    for path in photos:
        ours = _ours(path, list(cfg["input_size"][1:]), cfg["mean"], cfg["std"], **settings)
        theirs = _timms(path, data_config)
        assert ours.shape == theirs.shape == cfg["input_size"]
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("crop_mode", ["center", "squash", "border"])
@pytest.mark.parametrize("img_size", [(48, 32), (32, 48)])
def test_eval_input_equals_timms_at_a_size_not_square(crop_mode, img_size, photos):
    """Targets that are not square: timm's ResizeKeepRatio (the shorter side's ratio for center, the longer's for
    border, which pads with the mean colour on both axes' short side), at a crop_pct below 1."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    settings = {"crop_pct": 0.8, "crop_mode": crop_mode, "interpolation": "bicubic"}
    config = {"input_size": (3, *img_size), "mean": mean, "std": std} | settings
    for path in photos:
        ours = _ours(path, list(img_size), mean, std, **settings)
        torch.testing.assert_close(ours, _timms(path, config), atol=1e-6, rtol=0)


def test_eval_resize_keeps_the_aspect_ratio_by_default_as_dinov2():
    """data=imagefolder's default at 224 is DINOv2's eval transform: Resize(256) of the shorter side (bicubic, PIL),
    CenterCrop(224); squash is asked for by name, and images already of their size pass unchanged."""
    from PIL import Image
    from torchvision import transforms as tv1

    from vitlab.data.crop_modes import resized_hw
    from vitlab.data.transforms import EvalTransform

    assert EvalTransform() == EvalTransform(crop_pct=0.875, crop_mode="center", interpolation="bicubic")
    img = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    dinov2 = tv1.Compose([tv1.Resize(256, interpolation=tv1.InterpolationMode.BICUBIC), tv1.CenterCrop(224)])
    expected = torch.from_numpy(np.array(dinov2(Image.fromarray(img.numpy())))).permute(2, 0, 1)
    assert torch.equal(eval_transform(224)(img.permute(2, 0, 1)).as_subclass(torch.Tensor), expected)
    assert resized_hw((300, 400), (224, 224), 0.875, "center") == (256, 341)  # 4:3 kept
    assert resized_hw((300, 400), (224, 224), 0.875, "squash") == (256, 256)  # 4:3 made 1:1
    assert resized_hw((300, 400), (224, 224), 1.0, "border") == (168, 224)  # fits inside, padded
    native = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)  # CIFAR's, fake's at their size: unchanged
    for mode in ("center", "squash", "border"):
        assert eval_transform(32, crop_pct=1.0, crop_mode=mode)(native).data_ptr() == native.data_ptr()
    batch = torch.randint(0, 256, (3, 3, 20, 30), dtype=torch.uint8)  # images in memory: each on its own
    out = eval_transform(16, crop_pct=0.8)(batch)
    assert torch.equal(out, torch.stack([eval_transform(16, crop_pct=0.8)(x) for x in batch]))
    with pytest.raises(ValueError, match=r"crop_mode 'letterbox' is not one of \['center', 'squash', 'border'\]"):
        eval_transform(32, crop_mode="letterbox")
    with pytest.raises(ValueError, match=r"interpolation 'cubic' is not one of \['nearest', 'bilinear', 'bicubic'"):
        eval_transform(32, interpolation="cubic")


@pytest.mark.parametrize("hue", [None, 0.1])
def test_colour_jitter_is_torchvisions_pixel_for_pixel(hue):
    """The workers' ColorJitter (one float32 buffer, truncated in place) draws as torchvision's does and makes the
    same uint8 pixels, in any order of the adjustments; a batch's contrast is each image's own."""
    from torchvision import tv_tensors

    from vitlab.data.transforms import ColorJitter

    ours, theirs = ColorJitter(0.4, 0.4, 0.4, hue), T.ColorJitter(0.4, 0.4, 0.4, hue)
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 24, 20), dtype=torch.uint8, generator=g) for _ in range(12)]
    images += [torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=g)]
    for seed, img in enumerate(images):
        for kind in (torch.Tensor, tv_tensors.Image):
            x = img if kind is torch.Tensor else tv_tensors.Image(img)
            torch.manual_seed(seed)
            a = ours(x)
            torch.manual_seed(seed)
            b = theirs(x)
            assert type(a) is type(b) and a.dtype == torch.uint8 and torch.equal(a, b), (seed, kind)
    gray = torch.randint(0, 256, (1, 8, 8), dtype=torch.uint8)  # 1 channel, float: torchvision's own path
    torch.manual_seed(0)
    a = ours(gray)
    torch.manual_seed(0)
    assert torch.equal(a, theirs(gray))
    assert "ColorJitter" in repr(train_transform(32, color_jitter=0.4).transforms[-1])
