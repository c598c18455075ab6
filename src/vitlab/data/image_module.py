"""What the datasets of images add to a DataModule (`ImageDataModule`, data/base.py): each image decoded and augmented
on uint8 by the loaders' workers and normalised on the device; the splits of a dataset given as train, val and test;
training at several sizes (data/sizes.py) or NaFlex's sequence lengths (data/naflex.py); the splits held on the device
(data/resident.py) or decoded there (data/decoding.py); objective=dino's views (data/image_views.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from vitlab.data import balanced, decoding, image_views, resident, sizes, transforms
from vitlab.data import folds as folds_module
from vitlab.data import naflex as naflex_loading
from vitlab.data.base import DataModule
from vitlab.data.resident import ResidentImages
from vitlab.data.seeded import GlobalOrder, RepeatOrder, Rows, TransformDataset
from vitlab.utils.errors import UserError
from vitlab.utils.values import from_mapping


class ImageDataModule(DataModule):
    """Datasets of images (files, or images in memory): each decoded and augmented on uint8 by the loaders' workers
    (`train_tf`, `eval_tf`), normalised on the device (`to_input`, with random erasing in training); or, when they
    fit (`data.on_device`), all held on the device as uint8 and augmented there a batch at a time
    (data/resident.py)."""

    # data.eval_transform.crop_pct when null (and no pretrained weights set it): at 224 px, DINOv2's Resize(256) of the
    # shorter side and CenterCrop(224) (crop_mode's default, center, keeps the aspect ratio)
    eval_crop_pct: float = 0.875
    can_reside = True  # its splits may be held on the device (not streamed shards)
    native_hw: tuple[int, int] | None = None  # the size every image has, where they share one (CIFAR's 32x32)
    decodes_files = False  # its images are decoded from files (by loader workers, also to hold them on the device)
    takes_folds = False  # data.folds: a map-style reader whose labels are known before the split (data/folds.py)

    def __init__(
        self,
        train_transform: dict | None = None,
        eval_transform: dict | None = None,
        repeated_aug: int = 0,  # copies of each training image an epoch (timm's RepeatAugSampler; DeiT: 3); 0: off
        on_device: bool | str = "auto",  # hold the splits on the training device: true, false, auto (when they fit)
        on_device_gb: float = 4.0,  # auto's budget: the splits as uint8, in GB
        multicrop: dict | None = None,  # objective=dino's views of each batch (training.objectives.dino.data_views)
        train_img_sizes: list[int] | None = None,  # several training sizes, one a batch (data/sizes.py); None: one
        train_batch_sizes: list[int] | None = None,
        train_size_probs: list[float] | None = None,
        train_size_schedule: str = "constant",
        train_size_schedule_spread: float = 0.65,
        train_size_random_mix: float = 0.1,
        folds: int = 0,  # k-fold: the training split cut into this many class-stratified folds (data/folds.py)
        fold: int = 0,  # ...of which this one validates
        naflex: dict | None = None,  # images at their own aspect ratio, batches of variable length (data/naflex.py)
        decode: str = "workers",  # workers | device: decoded and augmented a batch at a time there (data/decoding.py)
        sampler: str = "uniform",  # uniform | class_balanced (a long tail's classes drawn alike: data/balanced.py)
        sampler_balance: str = "sqrt",  # class_balanced: sqrt | inverse (of the class's count)
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        folds_module.check_folds(folds, fold, type(self).__name__ if not self.takes_folds else None)
        self.folds, self.fold = folds, fold
        if multicrop is not None:  # objective=dino: its views are the training augmentation (data/image_views.py)
            train_transform = {"random_resized_crop": None, "hflip": 0.0}
        if on_device is not True and on_device is not False and on_device != "auto":
            raise UserError(f"data.on_device {on_device!r} must be true, false or auto")
        if isinstance(on_device_gb, bool) or not isinstance(on_device_gb, (int, float)) or not on_device_gb > 0:
            raise UserError(f"data.on_device_gb {on_device_gb!r} must be a number of GB > 0")
        self.repeated_aug, self.on_device, self.on_device_gb = repeated_aug, on_device, on_device_gb
        self.sampler, self.sampler_balance = balanced.check_samplers(sampler, sampler_balance, repeated_aug)
        self.resides: bool | None = None  # decided when a loader is first asked for (resident.decide)
        self._stores: dict[str, ResidentImages] = {}
        self.size_schedule = sizes.SizeSchedule.from_keys(
            train_img_sizes, train_batch_sizes, train_size_probs, train_size_schedule, train_size_schedule_spread,
            train_size_random_mix,
        )  # fmt: skip
        if self.size_schedule is not None and multicrop is not None:
            raise UserError("data.train_img_sizes and objective=dino's crops both set the training sizes: choose one")
        self.train_transform_args = dict(train_transform or {})
        self.train_tf = transforms.train_transform(self.img_size, self.mean, **self.train_transform_args)
        # null eval settings: this dataset's defaults (pretrained.take_preprocessing fills them from the weights first)
        self.eval_settings = {"crop_pct": self.eval_crop_pct} | {
            k: v for k, v in (eval_transform or {}).items() if v is not None
        }
        self.eval_tf = transforms.eval_transform(self.img_size, self.mean, **self.eval_settings)
        self.train_settings = from_mapping(transforms.TrainTransform, train_transform or {}, "data.train_transform")
        s = self.train_settings
        self.to_input = transforms.DeviceTransform(
            self.mean, self.std, s.random_erasing, s.erasing_mode, s.erasing_count, self.img_hw, s.interpolation
        )
        self.shift_flip = resident.ShiftFlip(s.shift, s.hflip)  # training's random ops, on the device
        self.multicrop_settings, self.views = multicrop, None
        if multicrop is not None:  # cut from each whole image in the workers, or from a square on the device
            self.views, self.train_tf = image_views.setup(self, multicrop)
        naflex_loading.setup(self, naflex)
        self.decode = decoding.check(self, decode)

    def _assign_splits(self, train: Any, val: Any, test: Any | None, val_fraction: float, split_seed: int) -> None:
        """The three splits of a dataset given as train, val and (maybe) test: with `val_fraction`, a held-out slice
        of train validates (selects the checkpoint) and val, where there is no test, is the test; without it, val
        validates and a dataset without a test split has none (nothing is tested on the split that selected).
        `self.splits` says which is which (the log, metrics.json)."""
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"data.val_fraction {val_fraction} must be in [0, 1): the share of train held out")
        if val_fraction or self.folds:
            if not 0 < (count := round(val_fraction * len(train))) < len(train) and not self.folds:
                raise UserError(
                    f"data.val_fraction {val_fraction} of {len(train)} training images holds out {count}: nothing to "
                    "validate on or nothing left to train on"
                )
            kept, held = folds_module.kept_and_held(train, count, split_seed, self.folds, self.fold)
            self.train_set = TransformDataset(train, self.train_tf, kept)
            self.val_set = TransformDataset(train, self.eval_tf, held)
            self.test_set = TransformDataset(test if test is not None else val, self.eval_tf)
            self.splits = {
                "train": f"train/ less the held-out {val_fraction:g}",
                "val": f"{len(held):,} images of train/ held out (data.val_fraction {val_fraction:g}, split_seed "
                f"{split_seed})",
                "test": "test/" if test is not None else "val/",
            } | (folds_module.describe(self.folds, self.fold, len(held), split_seed) if self.folds else {})
            return
        self.train_set = TransformDataset(train, self.train_tf)
        self.val_set = TransformDataset(val, self.eval_tf)
        self.test_set = TransformDataset(test, self.eval_tf) if test is not None else None
        self.splits = {"train": "train/", "val": "val/"} | ({"test": "test/"} if test is not None else {})

    def _served(self, split: str) -> Dataset | None:
        dataset = super()._served(split)
        if dataset is not None and self.decode == "device":
            return decoding.served(self, split, dataset)
        if dataset is None or not self._resides():
            return dataset
        if split not in self._stores:
            tf = resident.stored_transform(self.train_tf) if split == "train" else self.eval_tf
            workers = (self.num_workers if self.num_workers is not None else self._auto_workers()) * self.decodes_files
            self._stores[split] = resident.store(dataset, tf, self.data_device, workers)
        return self._stores[split]

    def _resides(self) -> bool:
        if self.resides is None:
            self.resides = self.decode != "device" and resident.decide(self)
        return self.resides

    def _train_sampler(self, dataset: Dataset, world: int, rank: int, batch_size: int) -> GlobalOrder:
        if self.sampler == "class_balanced":
            return balanced.balanced_sampler(dataset, self.sampler_balance, world, rank, self.shuffle_seed, batch_size)
        if self.repeated_aug:  # DeiT's copies, in a global order (data/seeded.py)
            keyed = isinstance(dataset, TransformDataset)
            return RepeatOrder(dataset, world, rank, self.shuffle_seed, batch_size, self.repeated_aug, keyed=keyed)
        return super()._train_sampler(dataset, world, rank, batch_size)

    def device_transform(self, batch, train: bool):
        """A uint8 batch, once on the device, to the model's normalised float32 input: held on the device, the training
        batch is shifted and flipped first; resized where kept at its own size; randomly erased in training."""
        if isinstance(batch, decoding.EncodedBatch):  # data.decode=device: decoded here, then as any uint8 batch
            draws = self.batch_draws(len(batch.labels)) if train else self.rng  # (its erasing: the global batch's)
            return self.to_input(decoding.augmented(self, batch, train), train, draws), batch.labels
        x, y = batch[:2]
        if train and self.views is not None and isinstance(x, list):  # objective=dino, views cut in the workers
            return self.views.normalised(x, self.batch_draws(len(x[0]))), y
        if train and self.views is not None:  # objective=dino: the views (its global batch's rows) and iBOT's masks
            return self.views(x.to(torch.float32).div_(255), self.rng, self.batch_draws(len(x))), y
        # A batch draws as its global batch (data/seeded.py's Rows), shared by this step's draws in order (NaFlex's
        # patches: its erasing).
        images = isinstance(self.to_input, transforms.DeviceTransform)
        draws = self.batch_draws(len(y)) if train else self.rng
        if train and self.resides:
            x = self.shift_flip(x, draws)
        size = self.size_schedule.batch_hw(batch) if train and self.size_schedule is not None else None
        x = self.to_input(x, train, draws, size)  # (NaFlex's patches: its Normalise, data/naflex.py)
        return (self.augment_input(x, draws) if train and images else x), y

    def augment_input(self, x: torch.Tensor, draws: Rows | torch.Generator) -> torch.Tensor:
        """A data set's own augmentation of the model's input, in training, drawing from the batch's `draws` after
        the shift, flip and erasing (digits' rotation and zoom); none here."""
        return x

    def eval_view(self, split: str) -> Dataset:
        dataset = super().eval_view(split)
        return TransformDataset(dataset.base, self.eval_tf, dataset.indices)

    def predict_tensor(self, img) -> torch.Tensor:
        """One image (PIL or uint8 tensor) -> the (1, C, H, W) float32 batch the eval loader makes of it."""
        return self.device_transform((default_collate([self.eval_tf(img)]), None), train=False)[0]

    @property
    def preprocessing(self) -> dict[str, Any]:
        """predict_tensor's (and the eval loader's) preparation in timm's pretrained_cfg names: what vitlab.export
        writes, so that timm prepares an image as vitlab does."""
        return transforms.timm_eval_cfg(self.img_size, self.channels, self.mean, self.std, **self.eval_settings)
