"""Make a folder of 500x375 JPEG photos, offline, for the input-pipeline benchmarks:

    python experiments/throughput/make_jpegs.py /tmp/jpegs [--train 1024] [--val 256] [--classes 4]

writes <out>/{train,val}/class_<k>/<i>.jpg (data=imagefolder's layout). The pictures are random crops,
zooms, flips and colour shifts of the two photos that ship inside scikit-learn (china.jpg and
flower.jpg, 427x640), resized to 500x375 (landscape) or 375x500 (portrait, one in four) and saved at
JPEG quality 90: what a folder of camera photos costs to decode and augment, with nothing downloaded.
The same arguments give the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance
from sklearn.datasets import load_sample_images


def photo(sources: list[Image.Image], rng: np.random.Generator) -> Image.Image:
    src = sources[rng.integers(len(sources))]
    portrait = rng.random() < 0.25
    w, h = src.size
    zoom = rng.uniform(0.5, 1.0)
    cw, ch = int(w * zoom), int(h * zoom)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = src.crop((left, top, left + cw, top + ch)).resize((375, 500) if portrait else (500, 375), Image.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    img = ImageEnhance.Color(img).enhance(rng.uniform(0.6, 1.4))
    return ImageEnhance.Brightness(img).enhance(rng.uniform(0.7, 1.3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=1024, help="training images (default 1024)")
    parser.add_argument("--val", type=int, default=256, help="validation images (default 256)")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty; give a new folder")
    rng = np.random.default_rng(args.seed)
    sources = [Image.fromarray(a) for a in load_sample_images().images]
    for split, n in (("train", args.train), ("val", args.val)):
        for i in range(n):
            folder = args.out / split / f"class_{i % args.classes}"
            folder.mkdir(parents=True, exist_ok=True)
            photo(sources, rng).save(folder / f"{i:05d}.jpg", quality=90)
    print(f"wrote {args.train} + {args.val} JPEGs (500x375) in {args.classes} classes under {args.out}")


if __name__ == "__main__":
    main()
