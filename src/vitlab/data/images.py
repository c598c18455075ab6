"""The one way vitlab turns an image file into pixels: training, evaluation, `vitlab.predict` and
`vitlab.visualize` all call `read_image` (a uint8 (C, H, W) tensor; `load_image` is the PIL image it
falls back to), so a model never sees a file differently at prediction time than it did in training.

- JPEGs, most photos, are decoded by `torchvision.io.decode_image` (libjpeg-turbo, straight into a
  tensor); this gives the same pixels as PIL's decoder, EXIF orientation and CMYK included (a test
  holds them equal). Every other file, any JPEG that decoder refuses, and 1-channel reads go through PIL.
  (torchvision 0.29 marks its decoders deprecated in favour of TorchCodec; they still ship and work.)

- EXIF orientation is applied (a portrait photo tagged Orientation=6 comes out upright).
- 16-bit and 32-bit grayscale (PIL modes I;16, I, F) are scaled to 8 bit, not clipped to white.
- Palette, grayscale+alpha, RGBA and CMYK files become RGB (alpha is dropped), or L for 1-channel models.
- A file that cannot be decoded, is a directory, or is too large to decode safely is a one-line
  `UserError` naming it.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from vitlab.utils.errors import MissingFileError, UserError

JPEG_MAGIC = b"\xff\xd8\xff"
# The image formats vitlab reads, everywhere: image folders (files of other kinds there are skipped, and counted),
# predict and visualize. torchvision's ImageFolder formats, and GIF (its first frame).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")


def read_image(path: str | Path, channels: int = 3) -> torch.Tensor:
    """Decode `path` to an upright uint8 (channels, H, W) tensor (1: grayscale, 3: RGB)."""
    path = Path(path)
    _check_file(path)
    return decode_image(path.read_bytes(), str(path), channels)


def is_image_file(path: str | Path) -> bool:
    """A file of a kind vitlab reads (IMAGE_EXTENSIONS), by its name."""
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def check_image_file(path: str | Path) -> None:
    """What can be known of `path` without decoding it: the header PIL reads before decoding (format and size),
    and, for a PNG, its end (IEND). A file that is not an image, or a PNG cut short, is named in one line."""
    path = Path(path)
    _check_file(path)
    _open(path, str(path), None)
    if path.suffix.lower() == ".png":
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 64))
            if b"IEND" not in f.read():
                raise UserError(f"image file {str(path)!r} is cut short (a PNG without its end); remove or replace it")


def decode_image(data: bytes, name: str, channels: int = 3) -> torch.Tensor:
    """Decode an image file's bytes (`name` says where they came from, in errors) as `read_image` decodes the file:
    an upright uint8 (channels, H, W) tensor."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as decode_tensor

    if channels == 3 and data.startswith(JPEG_MAGIC):  # (its grayscale is the JPEG's Y channel, not PIL's L)
        try:
            return decode_tensor(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB, apply_exif_orientation=True
            )
        except RuntimeError:  # truncated, corrupt or a JPEG flavour it lacks: PIL decodes it or names the problem
            pass
    img = _open(io.BytesIO(data), name, channels)
    return torch.from_numpy(np.array(img, dtype=np.uint8)).view(img.height, img.width, -1).permute(2, 0, 1).contiguous()


def load_image(path: str | Path, channels: int = 3) -> Image.Image:
    """Decode `path` to an upright 8-bit PIL image with `channels` channels (1: L, 3: RGB)."""
    path = Path(path)
    _check_file(path)
    return _open(path, str(path), channels)


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise MissingFileError(f"image {str(path)!r} is a directory; give image files (for example {path}/<name>.jpg)")
    if not path.exists():
        raise MissingFileError(f"image file {str(path)!r} does not exist")
    if path.suffix.lower() not in IMAGE_EXTENSIONS:
        raise UserError(
            f"image file {str(path)!r} is of a kind vitlab does not read; it reads {' '.join(IMAGE_EXTENSIONS)}"
        )


def _open(source, name: str, channels: int | None) -> Image.Image:
    """The upright 8-bit image, or (channels None) just the header read, as a check."""
    try:
        with Image.open(source) as img:
            if channels is None:
                return img
            img = ImageOps.exif_transpose(img)
            return to_channels(to_8bit(img), channels)
    except Image.DecompressionBombError as e:
        raise UserError(f"image file {name!r} is too large to decode safely ({e}); downscale it first") from e
    except (OSError, ValueError, SyntaxError) as e:  # PIL's errors for truncated, corrupt or non-image files
        said = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))  # bytes, not a file: the name says which
        raise UserError(
            f"image file {name!r} cannot be decoded ({type(e).__name__}: {said}); remove or replace it"
        ) from e


def to_8bit(img: Image.Image) -> Image.Image:
    """High-bit-depth grayscale to 8-bit L: 16-bit values (I;16*, or I holding them) divided by 257,
    float images (F) in [0, 1] or [0, 255] scaled likewise. Other modes are returned as they are."""
    if img.mode not in ("I", "F") and not img.mode.startswith("I;16"):
        return img
    a = np.asarray(img, dtype=np.float64)
    if img.mode == "F":
        a = a * 255.0 if a.max(initial=0.0) <= 1.0 else a
    elif img.mode.startswith("I;16") or a.max(initial=0.0) > 255:
        a = a / 257.0  # 65535 -> 255
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")


def to_channels(img: Image.Image, channels: int) -> Image.Image:
    if channels == 1:
        return img.convert("L")
    if img.mode in ("P", "PA", "LA", "La", "RGBa"):
        img = img.convert("RGBA")  # palette transparency and premultiplied alpha resolved before dropping alpha
    return img.convert("RGB")
