"""data.images.load_image: every kind of file a photo folder holds comes out as the right pixels."""

import numpy as np
import pytest
from PIL import Image

from vitlab.data.images import load_image
from vitlab.errors import MissingFileError, UserError

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
