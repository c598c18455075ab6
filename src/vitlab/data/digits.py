"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes): the embedded default.

It ships inside scikit-learn, so it needs no network. The split is fixed and stratified
(`split_seed`), so every run, and `vitlab.eval` later, sees the same test images. The whole set
lives in memory as one tensor and is augmented per batch on the device (random rotation, zoom and
shift at 8x8, then resized to the model's img_size): per-image transforms would cost more than the tiny model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset

from vitlab.data.base import DataModule
from vitlab.utils.errors import UserError


class TensorImages(Dataset):
    """Images and labels in two tensors; DataLoader fetches whole batches by index (`__getitems__`)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]):
        # made on the host and copied without blocking (a list turned into a GPU tensor waits for the GPU)
        idx = torch.as_tensor(indices).to(self.labels.device, non_blocking=True)
        return self.images[idx], self.labels[idx]


def _already_batched(batch):
    return batch


def random_shift(x: torch.Tensor, pixels: int, fill: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Translate each image of (B, C, H, W) by its own random offset in [-pixels, pixels]^2 (offsets drawn
    on the CPU from `generator`)."""
    B, C, H, W = x.shape
    padded = F.pad(x, (pixels,) * 4, value=fill)
    dy = torch.randint(0, 2 * pixels + 1, (B, 1), generator=generator).to(x.device, non_blocking=True)
    dx = torch.randint(0, 2 * pixels + 1, (B, 1), generator=generator).to(x.device, non_blocking=True)
    rows = (dy + torch.arange(H, device=x.device))[:, :, None]  # (B, H, 1)
    cols = (dx + torch.arange(W, device=x.device))[:, None, :]  # (B, 1, W)
    return padded[torch.arange(B, device=x.device)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)


def random_affine(
    x: torch.Tensor, degrees: float, scale: tuple[float, float], fill: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Rotate each image of (B, C, H, W) by its own angle in [-degrees, degrees] and zoom by a factor in
    `scale`, about the centre (bilinear), filling uncovered pixels with `fill`."""
    B = x.shape[0]
    angle = ((torch.rand(B, generator=generator) * 2 - 1) * math.radians(degrees)).to(x.device, non_blocking=True)
    zoom = torch.empty(B).uniform_(*scale, generator=generator).to(x.device, non_blocking=True)
    cos, sin = angle.cos() / zoom, angle.sin() / zoom  # the grid maps output to input: inverse zoom
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


class DigitsDataModule(DataModule):
    """The whole set in memory as one normalised tensor, augmented a batch at a time on the device."""

    num_classes = 10
    channels = 1
    mean = (0.3053,)  # of the images scaled to [0, 1] (pixel values 0..16)
    std = (0.3759,)
    class_names = [str(i) for i in range(10)]

    def __init__(
        self,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        shift: int = 1,
        rotate: float = 0.0,
        scale: tuple[float, float] = (1.0, 1.0),
        train_transform: dict | None = None,  # refused: the per-image settings of the other datasets
        eval_transform: dict | None = None,
        **kwargs,
    ):
        if train_transform or eval_transform:
            raise UserError(
                "digits augments whole batches on the device: use data.shift, data.rotate and "
                "data.scale instead of data.train_transform / data.eval_transform"
            )
        super().__init__(**kwargs)
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise UserError(
                f"data.val_fraction {val_fraction} and data.test_fraction {test_fraction} must be "
                "in (0, 1) and sum to less than 1"
            )
        if shift < 0:
            raise UserError(f"data.shift {shift} must be >= 0")
        if not 0 <= rotate <= 180:
            raise UserError(f"data.rotate {rotate} must be in [0, 180] degrees")
        if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
            raise UserError(f"data.scale {list(scale)} must be [min, max] with 0 < min <= max")
        self.rotate, self.scale = rotate, tuple(scale)
        self.val_fraction, self.test_fraction, self.split_seed, self.shift = (
            val_fraction,
            test_fraction,
            split_seed,
            shift,
        )
        self.black = (0.0 - self.mean[0]) / self.std[0]  # the fill for pixels moved in by augmentation

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = load_digits()
        images = self.normalize(torch.from_numpy(digits.images).float().div(16).unsqueeze(1))  # (N, 1, 8, 8)
        labels = torch.from_numpy(digits.target).long()
        idx = list(range(len(labels)))
        rest, test = train_test_split(
            idx, test_size=self.test_fraction, stratify=labels.tolist(), random_state=self.split_seed
        )
        train, val = train_test_split(
            rest,
            test_size=self.val_fraction / (1 - self.test_fraction),
            stratify=labels[rest].tolist(),
            random_state=self.split_seed,
        )
        # 1,797 tiny images: on a GPU they live there, and a batch is one gather on the device (no copy
        # from host memory per step).
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        images, labels = images.to(device), labels.to(device)
        for name, part in (("train_set", train), ("val_set", val), ("test_set", test)):
            part = torch.tensor(sorted(part), device=device)
            setattr(self, name, TensorImages(images[part], labels[part]))
        how = f"stratified, split_seed {self.split_seed}"
        self.splits = {
            "train": f"{len(train):,} digits",
            "val": f"{len(val):,} digits ({self.val_fraction:g}, {how})",
            "test": f"{len(test):,} digits ({self.test_fraction:g}, {how})",
        }

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean[0]) / self.std[0]

    def _loader(self, dataset, train: bool, **kwargs):
        pin = bool(self.pin_memory) and dataset.labels.device.type == "cpu"  # tensors on a GPU cannot be pinned
        return super()._loader(dataset, train, collate_fn=_already_batched, num_workers=0, pin_memory=pin, **kwargs)

    def device_transform(self, batch, train: bool):
        x, y = batch
        if train:
            if self.rotate or self.scale != (1.0, 1.0):
                x = random_affine(x, self.rotate, self.scale, fill=self.black, generator=self.rng)
            if self.shift:
                x = random_shift(x, self.shift, fill=self.black, generator=self.rng)
        return self.resize(x), y

    def resize(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) == self.img_hw:
            return x
        return F.interpolate(x, size=self.img_hw, mode="bicubic", align_corners=False)

    def predict_tensor(self, img) -> torch.Tensor:
        """A PIL image or tensor of a digit -> (1, 1, H, W), as the test images are prepared."""
        from torchvision.transforms.v2 import functional as TF

        x = TF.to_dtype(TF.to_image(img), torch.float32, scale=True)
        if x.shape[0] != 1:
            x = TF.rgb_to_grayscale(x[:3])
        x = TF.resize(x, [8, 8], antialias=True)
        return self.resize(self.normalize(x).unsqueeze(0))
