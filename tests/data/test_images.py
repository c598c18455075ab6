"""data.images.read_image / load_image: every kind of file a photo folder holds comes out as the right
pixels, and the fast JPEG decoder agrees with PIL's."""

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import images
from vitlab.data.images import load_image, read_image
from vitlab.utils.errors import MissingFileError, UserError

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 255, (6, 10, 3), dtype=np.uint8)


def _save(tmp_path, name, img, **kwargs):
    path = tmp_path / name
    img.save(path, **kwargs)
    return path


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "LA", "CMYK"])
def test_every_8_bit_mode_becomes_rgb_of_the_same_picture(tmp_path, mode):
    src = Image.fromarray(RGB)
    img = src.convert(mode) if mode != "P" else src.quantize(256)
    path = _save(tmp_path, f"x.{'tiff' if mode == 'CMYK' else 'png'}", img)
    out = load_image(path)
    assert out.mode == "RGB" and out.size == (10, 6)
    assert np.array_equal(np.asarray(out), np.asarray(img.convert("RGB")))
    assert load_image(path, channels=1).mode == "L"


def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    path = _save(tmp_path, "g16.png", Image.fromarray(values))
    assert np.asarray(load_image(path, channels=1)).tolist() == [[0, 1, 128, 255]]
    assert np.asarray(load_image(path)).shape == (1, 4, 3)


def test_float_images_are_scaled(tmp_path):
    path = _save(tmp_path, "f.tiff", Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)))
    assert np.asarray(load_image(path, channels=1)).tolist() == [[0, 128, 255]]


@pytest.mark.parametrize("orientation, size", [(1, (10, 6)), (3, (10, 6)), (6, (6, 10)), (8, (6, 10))])
def test_exif_orientation_is_applied(tmp_path, orientation, size):
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = _save(tmp_path, "o.png", Image.fromarray(RGB), exif=exif)
    out = load_image(path)
    assert out.size == size
    if orientation == 6:  # displayed rotated 90 degrees clockwise: the stored left column is the top row
        assert np.array_equal(np.asarray(out)[0], RGB[::-1, 0])


def test_files_that_cannot_be_read_are_named(tmp_path):
    with pytest.raises(MissingFileError, match="image file '.*nope.png' does not exist"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(MissingFileError, match="is a directory; give image files"):
        load_image(tmp_path)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(UserError, match="image file '.*text.png' cannot be decoded .UnidentifiedImageError"):
        load_image(tmp_path / "text.png")


def _photo() -> np.ndarray:
    from sklearn.datasets import load_sample_images

    return load_sample_images().images[0][100:160, 200:290]  # a real photo (60 x 90): smooth areas and edges


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("orientation", [1, 6])
def test_jpegs_decode_to_the_same_pixels_as_pil(tmp_path, mode, orientation, monkeypatch):
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = _save(tmp_path, "p.jpg", Image.fromarray(_photo()).convert(mode), quality=90, exif=exif)
    for channels in (3, 1):  # (1 channel reads through PIL: a grayscale model sees PIL's L of a colour photo)
        fast = read_image(path, channels)
        assert fast.dtype == torch.uint8 and fast.shape[0] == channels
        assert fast.shape[1:] == ((60, 90) if orientation == 1 else (90, 60))
        pil = np.asarray(load_image(path, channels)).reshape(*fast.shape[1:], channels)
        assert np.array_equal(fast.permute(1, 2, 0).numpy(), pil)
    calls = []
    monkeypatch.setattr(images, "load_image", lambda *a: calls.append(a) or Image.new("RGB", (1, 1)))
    read_image(path)
    assert not calls  # the JPEG went through torchvision's decoder, not PIL


@pytest.mark.parametrize("mode", ["RGBA", "P", "LA", "I;16"])
def test_other_files_go_through_pil_and_come_out_as_uint8_tensors(tmp_path, mode):
    img = (
        Image.fromarray(np.array([[0, 257, 32896, 65535]], dtype=np.uint16))
        if mode == "I;16"
        else (Image.fromarray(RGB).convert(mode) if mode != "P" else Image.fromarray(RGB).quantize(256))
    )
    path = _save(tmp_path, "x.png", img)
    out = read_image(path)
    assert out.dtype == torch.uint8 and out.shape == (3, *np.asarray(img).shape[:2])
    assert np.array_equal(out.permute(1, 2, 0).numpy(), np.asarray(load_image(path)))


def test_a_truncated_jpeg_is_named_not_decoded_in_part(tmp_path):
    path = _save(tmp_path, "t.jpg", Image.fromarray(_photo()), quality=90)
    path.write_bytes(path.read_bytes()[:600])
    with pytest.raises(UserError, match="image file '.*t.jpg' cannot be decoded"):
        read_image(path)
