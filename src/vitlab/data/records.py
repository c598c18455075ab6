"""What the readers of other people's formats share (data=hf, data=wds, data=list): `RecordsDataModule` takes the
splits a reader found, as map-style datasets of (uint8 image, label) (a Hugging Face dataset on disk, a CSV's files),
which then train as an image folder does (the same sampler, exact resume, DDP share-out, the on-device path), or as
streams (data/streamed.py: WebDataset shards, a Hugging Face iterable dataset), which have loaders of their own.

A split the data lacks: no validation split, and `data.val_fraction` of train (10% when it is null) validates,
held out with `data.split_seed`, said in the log; no test split, and nothing is tested (the result is val's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from vitlab.data import sizes
from vitlab.data.folds import describe as describe_folds
from vitlab.data.folds import describe_splits, kept_and_held
from vitlab.data.image_module import ImageDataModule
from vitlab.data.seeded import TransformDataset, init_worker
from vitlab.data.streamed import EpochSampler, Holdout, StreamedSplit, whole
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

MISSING_VAL_FRACTION = 0.1  # the share of train that validates where the data has no validation split


class RecordsDataModule(ImageDataModule):
    channels = 3
    mean = (0.485, 0.456, 0.406)  # ImageNet
    std = (0.229, 0.224, 0.225)

    def __init__(self, num_classes: int, val_fraction: float | None = None, split_seed: int = 0, **kwargs: Any):
        if num_classes < 0:
            raise UserError(f"data.num_classes {num_classes} must be >= 0 (0: unlabeled, objective=mae)")
        super().__init__(num_classes=num_classes, **kwargs)
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.class_names: list[str] = []

    def _check_classes(self, class_names: list[str], where: str) -> None:
        if self.num_classes and len(class_names) != self.num_classes:  # (an image folder's refusal too)
            raise UserError(
                f"data.num_classes {self.num_classes} does not match the {len(class_names)} classes of {where}; "
                "leave data.num_classes out to take the data's count"
            )
        self.class_names = class_names

    def _set_map_splits(self, train: Dataset, val: Dataset | None, test: Dataset | None, names: dict) -> None:
        """Map-style splits of (uint8 image, label); `names` says what each is called in the data (the log)."""
        if val is not None:
            self._assign_splits(train, val, test, self.val_fraction or 0.0, self.split_seed)
            self.splits = {k: names.get(v.rstrip("/"), v) for k, v in self.splits.items()}
        else:
            fraction = self._missing_val_fraction(names)
            count = max(1, round(fraction * len(train)))
            kept, held = kept_and_held(train, count, self.split_seed, self.folds, self.fold)
            self.train_set = TransformDataset(train, self.train_tf, kept)
            self.val_set = TransformDataset(train, self.eval_tf, held)
            self.test_set = TransformDataset(test, self.eval_tf) if test is not None else None
            self.splits = {"train": f"{names['train']} less the held-out {fraction:g}",
                           "val": f"{len(held):,} images of {names['train']} held out"}  # fmt: skip
            if self.folds:
                self.splits |= describe_folds(self.folds, self.fold, len(held), self.split_seed, names["train"])
            self.splits |= {"test": names["test"]} if test is not None else {}
        log.info("%s", describe_splits(self.splits))

    def _missing_val_fraction(self, names: dict) -> float:
        if self.folds:  # (the held-out fold validates)
            return 0.0
        fraction = self.val_fraction if self.val_fraction else MISSING_VAL_FRACTION
        if not 0.0 < fraction < 1.0:
            raise UserError(f"data.val_fraction {fraction} must be in (0, 1): the share of train held out")
        log.info("the data has no validation split: %g of %s validates (data.val_fraction, held out with "
                 "data.split_seed %d)", fraction, names["train"], self.split_seed)  # fmt: skip
        return fraction

    def _set_streamed_splits(self, make, names: dict, num_train: int, sizes: dict) -> None:
        """Streamed splits: `make(split, train, holdout)` builds one (a StreamedSplit) of the data's split `split`."""
        if self.folds:
            raise UserError(f"data.folds {self.folds}: streamed data takes no folds; k-fold splits map-style data")
        holdout = None
        if names.get("val") is None or self.val_fraction:
            fraction = self._missing_val_fraction(names)
            holdout = (Holdout(fraction, self.split_seed, held=False), Holdout(fraction, self.split_seed, held=True))
        self.train_set = make(names["train"], True, holdout and holdout[0])
        self.val_set = make(names["train"], False, holdout[1]) if holdout else make(names["val"], False, None)
        test = names.get("test") or (names.get("val") if holdout else None)
        self.test_set = make(test, False, None) if test else None
        self.splits = {"train": names["train"], "val": f"{names['train']} held out" if holdout else names["val"]}
        self.splits |= {"test": test} if test else {}
        log.info("%s; an epoch is data.num_train %d samples", describe_splits(self.splits), num_train)

    def _loader(self, dataset: Dataset | None, train: bool, **kwargs) -> StatefulDataLoader:
        if not isinstance(dataset, StreamedSplit):
            return super()._loader(dataset, train, **kwargs)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        batched = train and self.size_schedule is not None  # several sizes or NaFlex's lengths: whole batches
        dataset.place(self.shuffle_seed, rank, world, self.per_device_batch_size)
        if batched:  # (timm's schedule refuses an epoch without a full batch)
            sizes.streamed_loading(self, dataset, world)
        elif train:
            self._check_enough_images(dataset.num_samples)
        workers = self.num_workers if self.num_workers is not None else self._auto_workers()
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        extra = {"prefetch_factor": self.prefetch_factor, "worker_init_fn": init_worker} if workers else {}
        extra |= {"collate_fn": whole} if batched else {}
        # persistent workers in training: their readers keep the epoch they are told through a shared value
        loader = StatefulDataLoader(
            dataset, batch_size=1 if batched else self.per_device_batch_size, num_workers=workers,
            generator=torch.Generator(), pin_memory=self.pin_memory if self.pin_memory is not None else on_cuda,
            persistent_workers=workers > 0 and (train or self.persistent_workers), **extra,
        )  # fmt: skip
        if train:  # Lightning sets the epoch on it at every epoch's start; set here as it will be (epochs processed)
            loader.batch_sampler.sampler = EpochSampler(dataset)
            loader.batch_sampler.sampler.set_epoch(
                self.trainer.fit_loop.epoch_progress.current.processed if self.trainer is not None else 0
            )
        return loader

    def test_dataloader(self) -> StatefulDataLoader:
        if isinstance(self.test_set, StreamedSplit):  # (each process its own batches, none twice)
            return self._loader(self.test_set, train=False)
        return super().test_dataloader()

    def eval_view(self, split: str) -> Dataset:
        dataset = getattr(self, f"{split}_set")
        if isinstance(dataset, StreamedSplit):
            view = dataset.as_eval(self.eval_tf)
            if view.num_samples is None:  # (the training split: its epoch's count is no size)
                counted = self.__dict__.setdefault("_counted", {})
                if split not in counted:
                    counted[split] = view.count()
                    log.info("%s split: %d samples (counted: its shards read once, nothing decoded)", split,
                             counted[split])  # fmt: skip
                view.num_samples = counted[split]
            return view
        return super().eval_view(split)

    def first_images(self, split: str, n: int) -> torch.Tensor:
        self.setup("test")
        dataset = self.eval_view(split)
        if not isinstance(dataset, StreamedSplit):
            return super().first_images(split, n)
        images = [image for (image, _), _ in zip(dataset.place(0, 0, 1, 1), range(n), strict=False)]
        return self.device_transform((torch.stack(images), None), train=False)[0]
