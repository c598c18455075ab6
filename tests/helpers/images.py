"""Folders of small random images in the layouts the data modules read."""


def image_tree(root, classes=("a", "b"), per_class=3, size=(8, 8), splits=("train", "val"), seed=0):
    """data_dir/<split>/<class>/<i>.png of random RGB images; returns root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split in splits:
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
    return root


def segmentation_tree(root, classes=4, per_split=(4, 3), seed=0):
    """An ADE20k-layout folder: images/{training,validation}/<name>.jpg of random RGB pixels and sizes, each with its
    annotations/.../<name>.png of labels 0..classes (0: ADE20k's "other", ignored by reduce_zero_label); returns
    root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in zip(("training", "validation"), per_split, strict=True):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = (int(v) for v in rng.integers(24, 48, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "images" / split / f"{i}.jpg")
            labels = rng.integers(0, classes + 1, (h, w), dtype=np.uint8)
            Image.fromarray(labels).save(root / "annotations" / split / f"{i}.png")
    return root
