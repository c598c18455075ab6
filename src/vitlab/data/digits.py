"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes): the embedded default.

It ships inside scikit-learn, so it needs no network. The split is fixed and stratified
(`split_seed`), so every run, and `vitlab.eval` later, sees the same test images. The images (pixel values 0..16)
are uint8 0..255 in memory, as any other dataset's, and by default the whole set is held on the training device
and augmented there a batch at a time (`data.on_device`, data/resident.py): a random shift of up to `shift`
pixels at 8x8, then the resize to the model's img_size and, when set, a random rotation and zoom (per-image
transforms would cost more than the tiny model). `data.on_device=false` reads them through the loader instead,
shifted per image. Evaluation (val, test, vitlab.predict) is every dataset's eval transform at crop_pct 1 (the 8x8
images resized whole, in PIL; a photo's shorter side resized and its centre cropped), the one preprocessing that
vitlab.export records for timm (`ImageDataModule.preprocessing`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from vitlab.data.balanced import long_tail
from vitlab.data.folds import fold_split
from vitlab.data.image_module import ImageDataModule
from vitlab.data.resident import ArrayImages
from vitlab.data.seeded import Rows, TransformDataset, rows_of
from vitlab.utils.errors import UserError


def random_affine(
    x: torch.Tensor,
    degrees: float,
    scale: tuple[float, float],
    fill: float,
    generator: torch.Generator | Rows | None = None,
) -> torch.Tensor:
    """Rotate each image of (B, C, H, W) by its own angle in [-degrees, degrees] and zoom by a factor in
    `scale`, about the centre (bilinear), filling uncovered pixels with `fill`. The matrices are made on the host
    (the same on a CPU and a GPU) and cross in one copy that does not wait. `generator`: or the Rows of a global
    batch (data/seeded.py)."""
    B = x.shape[0]
    generator, start, n = rows_of(generator, B)
    angle = ((torch.rand(n, generator=generator) * 2 - 1) * math.radians(degrees))[start : start + B]
    zoom = torch.empty(n).uniform_(*scale, generator=generator)[start : start + B]
    cos, sin = angle.cos() / zoom, angle.sin() / zoom  # the grid maps output to input: inverse zoom
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta.to(x.device, non_blocking=True), list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


class DigitsDataModule(ImageDataModule):
    """The whole set in memory as uint8, held on the training device by default; digits' own augmentation
    settings (shift, rotate, scale) instead of data.train_transform."""

    takes_folds = True  # data.folds=K data.fold=i (data/folds.py)

    num_classes = 10
    channels = 1
    mean = (0.3053,)  # of the images scaled to [0, 1] (pixel values 0..16)
    std = (0.3759,)
    class_names = [str(i) for i in range(10)]
    eval_crop_pct = 1.0  # the test images resized whole; a photo's shorter side resized, its centre cropped
    native_hw = (8, 8)

    def __init__(
        self,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        shift: int = 1,
        rotate: float = 0.0,
        scale: tuple[float, float] = (1.0, 1.0),
        imbalance: float = 1.0,  # > 1: the training split a long tail of this ratio (data/balanced.py: long_tail)
        train_transform: dict | None = None,  # refused: the per-image settings of the other datasets
        eval_transform: dict | None = None,
        **kwargs,
    ):
        if train_transform or eval_transform:
            raise UserError(
                "digits augments whole batches on the device: use data.shift, data.rotate and "
                "data.scale instead of data.train_transform / data.eval_transform"
            )
        if shift < 0:
            raise UserError(f"data.shift {shift} must be >= 0")
        kwargs.setdefault("num_workers", 0)  # the loader path's 8x8 images cost less than a worker's start
        super().__init__(train_transform={"random_resized_crop": None, "shift": shift, "hflip": 0.0}, **kwargs)
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise UserError(
                f"data.val_fraction {val_fraction} and data.test_fraction {test_fraction} must be "
                "in (0, 1) and sum to less than 1"
            )
        if not 0 <= rotate <= 180:
            raise UserError(f"data.rotate {rotate} must be in [0, 180] degrees")
        if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
            raise UserError(f"data.scale {list(scale)} must be [min, max] with 0 < min <= max")
        self.rotate, self.scale, self.shift = rotate, tuple(scale), shift
        if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or imbalance < 1:
            raise UserError(f"data.imbalance {imbalance!r} must be >= 1 (1: every class as the data has it)")
        self.imbalance = imbalance
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.black = (0.0 - self.mean[0]) / self.std[0]  # the fill for pixels moved in by rotation and zoom

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = load_digits()
        pixels = torch.from_numpy(digits.images).long()  # 0..16
        images = ((pixels * 255 + 8) // 16).to(torch.uint8).unsqueeze(1)  # (N, 1, 8, 8), 0..255 rounded
        labels = torch.from_numpy(digits.target).long()
        idx = list(range(len(labels)))
        rest, test = train_test_split(
            idx, test_size=self.test_fraction, stratify=labels.tolist(), random_state=self.split_seed
        )
        if self.folds:  # k-fold: train and val are the folds of all but the test digits
            kept, held = fold_split(labels[rest].tolist(), self.folds, self.fold, self.split_seed)
            train, val = [rest[i] for i in kept], [rest[i] for i in held]
        else:
            train, val = train_test_split(
                rest,
                test_size=self.val_fraction / (1 - self.test_fraction),
                stratify=labels[rest].tolist(),
                random_state=self.split_seed,
            )
        if self.imbalance > 1:  # a long tail to train on; validation and test stay balanced
            train = long_tail(train, labels.tolist(), self.imbalance, self.split_seed)
        base = ArrayImages(images, labels)
        self.train_set = TransformDataset(base, self.train_tf, sorted(train))
        self.val_set = TransformDataset(base, self.eval_tf, sorted(val))
        self.test_set = TransformDataset(base, self.eval_tf, sorted(test))
        how = f"stratified, split_seed {self.split_seed}"
        share = f"fold {self.fold} of {self.folds}" if self.folds else f"{self.val_fraction:g}"
        tail = f", a long tail of ratio {self.imbalance:g}" if self.imbalance > 1 else ""
        self.splits = {
            "train": f"{len(train):,} digits{tail}",
            "val": f"{len(val):,} digits ({share}, {how})",
            "test": f"{len(test):,} digits ({self.test_fraction:g}, {how})",
        }

    def augment_input(self, x: torch.Tensor, draws) -> torch.Tensor:
        """The rotation and zoom (`data.rotate`, `data.scale`), each image's drawn from the batch's `draws`."""
        if self.rotate or self.scale != (1.0, 1.0):
            return random_affine(x, self.rotate, self.scale, fill=self.black, generator=draws)
        return x

    def predict_tensor(self, img) -> torch.Tensor:
        """A PIL image or tensor of a digit, of any size -> (1, 1, H, W): gray as uint8, then as the test images are
        prepared (a photo's shorter side resized, its centre cropped: the preprocessing vitlab.export records)."""
        from torchvision.transforms.v2 import functional as TF

        x = TF.to_image(img)
        if x.dtype != torch.uint8:
            x = TF.to_dtype(x, torch.uint8, scale=True)
        if x.shape[0] != 1:
            x = TF.rgb_to_grayscale(x[:3])
        return super().predict_tensor(x)
