"""A folder of JPEG photos in ImageNet's layout (root/{train,val}/<class>/*.jpg) for timm's train.py against
vitlab.train on the same files (experiments/gpu/README.md, point timm_train).

    python experiments/gpu/jpeg_folder.py --out /tmp/jpegs --train 5120 --val 512 --classes 10 --size 500x375

The images are smooth random colour fields with some noise, at ImageNet's typical size (500x375), encoded at
quality 90: decoding and cropping them costs what a photo costs, which is what a loader comparison needs. Written
by every CPU at once; the same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def write(job: tuple[Path, int, int, int]) -> None:
    path, seed, width, height = job
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 25 + 1, width // 25 + 1, 3), dtype=np.uint8))
    field = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.int16)
    noisy = np.clip(field + rng.integers(-12, 13, field.shape), 0, 255).astype(np.uint8)
    Image.fromarray(noisy).save(path, quality=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=5120, help="training images, over all classes")
    p.add_argument("--val", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", default="500x375", help="WIDTHxHEIGHT")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    width, height = (int(x) for x in a.size.split("x"))
    jobs = []
    for split, count in (("train", a.train), ("val", a.val)):
        for c in range(a.classes):
            (a.out / split / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            path = a.out / split / f"class_{i % a.classes:03d}" / f"{i:06d}.jpg"
            jobs.append((path, a.seed * 10_000_019 + len(jobs), width, height))
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(write, jobs, chunksize=64))
    print(f"wrote {len(jobs)} JPEGs ({width}x{height}, {a.classes} classes) under {a.out}", flush=True)
    print(json.dumps({"jpegs": len(jobs), "train": a.train, "val": a.val, "classes": a.classes, "size": a.size}))


if __name__ == "__main__":
    main()
