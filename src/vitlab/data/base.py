"""What every DataModule shares (`DataModule`): a dataset's facts, its splits' loaders (the global batch size split over
processes, seeded and resumable samplers, the workers), and its batches' move to the device. What the datasets of
images add (per-image transforms, data held on the device, NaFlex, decoding on the device) is data/image_module.py's.

`data.batch_size` is the *global* batch: under DDP with N processes each loads batch_size / N (it must divide).
The loaders' workers decode and augment each image on uint8 and batches stay uint8 (pinned for a GPU, moved without
blocking); `device_transform` makes normalised float32 of them on the device, with random erasing in training
(data/transforms.py). Or the device decodes and augments them too (`data.decode=device`, data/decoding.py); or
datasets that fit are held on the device as uint8, augmented there a batch at a time (`data.on_device`,
data/resident.py). Training's workers run on into the next epoch (data/lookahead.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import Dataset, IterableDataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from vitlab.data import decoding, lookahead, sizes
from vitlab.data.resident import ResidentImages, already_batched
from vitlab.data.seeded import GlobalOrder, Rows, TransformDataset, batch_rows, init_worker
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError


class DataModule(L.LightningDataModule):
    """A dataset's facts (classes, channels, normalisation), its splits, and their loaders; what its batches become
    on the device is the subclass's `device_transform`."""

    # Per-dataset facts; subclasses set them (ImageFolder/fake take some from the config).
    num_classes: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str]
    size_schedule: sizes.SizeSchedule | None = None  # training at several sizes (ImageDataModule)

    def __init__(
        self,
        img_size: int | Sequence[int],
        batch_size: int = 128,
        num_workers: int | None = None,  # None: the CPUs this process may use per device, less one, at most 16
        pin_memory: bool | None = None,  # None: when training on a CUDA device
        persistent_workers: bool = True,  # keep the workers between epochs (validation's too)
        prefetch_factor: int | None = None,  # batches each worker prepares ahead; None: PyTorch's 2
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        data_dir: str | None = None,
        num_classes: int | None = None,
        channels: int | None = None,
        labels: bool = True,  # false: the run learns from the images alone (objective.Objective.read_no_labels)
    ):
        super().__init__()
        self.labels = labels
        # The config states these so the model can be wired to them; datasets with fixed values check them.
        for name, value in (("num_classes", num_classes), ("channels", channels)):
            fixed = getattr(type(self), name, None)
            if value is not None and fixed is not None and value != fixed:
                raise UserError(f"data.{name} {value} does not match {type(self).__name__}'s {fixed}")
            if value is not None:
                setattr(self, name, value)
        if batch_size == "auto":
            raise UserError(
                "data.batch_size=auto is chosen by vitlab.train from the memory estimate; give a number here"
            )
        if batch_size < 1:
            raise UserError(f"data.batch_size {batch_size} must be >= 1")
        if num_workers is not None and num_workers < 0:
            raise UserError(f"data.num_workers {num_workers} must be >= 0")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise UserError(f"data.prefetch_factor {prefetch_factor} must be >= 1, or null")
        self.img_size = list(img_size) if isinstance(img_size, (list, tuple)) else img_size
        self.img_hw = as_hw(img_size, "data.img_size")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.persistent_workers, self.prefetch_factor = persistent_workers, prefetch_factor
        self.data_dir = data_dir
        self.mean = tuple(mean) if mean is not None else self.mean
        self.std = tuple(std) if std is not None else self.std
        if any(not s > 0 for s in self.std):
            raise UserError(f"data.std {list(self.std)} must be positive (images are divided by it), or null")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise UserError(
                f"data.mean {list(self.mean)} and data.std {list(self.std)} need one value per channel "
                f"({self.channels})"
            )
        # The shuffling seed is the run's, in every process. The on-device augmentation draws from a generator of
        # its own (one per process: rank_state.seed_process), checkpointed: a resumed run augments as it would have.
        self.shuffle_seed = torch.initial_seed()
        self.rng = torch.Generator().manual_seed(self.shuffle_seed + 1)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None  # None after setup: the data has no test split (nothing is tested)
        self.splits: dict[str, str] = {}  # what each split is, where a dataset's layout leaves it open
        self.placement: torch.device | None = None  # data_device without a Trainer
        # Training's order is global (seeded.GlobalOrder) unless a sampler deals per process; resumed on another
        self.global_order, self.resume_at = False, None  # count, the loader starts at (epoch, batches) = resume_at

    @property
    def per_device_batch_size(self) -> int:
        world = self.trainer.world_size if self.trainer is not None else 1
        refuse_indivisible_batch(self.batch_size, world)
        return self.batch_size // world

    def _loader(self, dataset: Dataset | None, train: bool, **kwargs) -> StatefulDataLoader:
        """A torchdata StatefulDataLoader: its position and its shuffling generator are saved in
        checkpoints, so a run resumed mid-epoch sees exactly the batches it would have seen."""
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        if train and self.size_schedule is None:  # a schedule's batch sizes are timm's to check (data/sizes.py)
            self._check_enough_images(len(dataset))
        if isinstance(dataset, ResidentImages):  # on the device already: whole batches gathered there, nothing pinned
            kwargs.update(num_workers=0, collate_fn=already_batched, pin_memory=False)
        elif isinstance(dataset, decoding.EncodedImages):  # data.decode=device: bytes and draws, not pixels
            kwargs.setdefault("collate_fn", decoding.collate)
        if "num_workers" not in kwargs:
            kwargs["num_workers"] = self.num_workers if self.num_workers is not None else self._auto_workers()
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        kwargs.setdefault("pin_memory", self.pin_memory if self.pin_memory is not None else on_cuda)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        # Every loader draws its workers' base seed from a generator of its own: drawn from the training generator
        # (dropout, MixUp) it would leave a resumed run one draw off wherever a loader starts anew.
        kwargs.setdefault("generator", torch.Generator())
        if train:
            # One permutation per epoch, decided by the run's seed and the epoch, and each process's share of it
            # (all of it in one process): a position resumes by its count alone. The epoch is set here as Lightning
            # will set it (epochs processed), before a resumed loader skips to its position: Lightning sets it only
            # after it has made the iterator. Under DDP Lightning leaves a DistributedSampler as it is.
            if self.size_schedule is None:
                sampler = self._train_sampler(dataset, world, rank, self.per_device_batch_size)
            else:  # whole batches, each of one size: the schedule cuts the whole set's order (data/sizes.py)
                sampler, dataset = sizes.scheduled_loading(self, self._train_sampler(dataset, 1, 0, 1), dataset, world)
                kwargs["batch_size"] = None
            sampler.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed if self.trainer is not None else 0)
            kwargs["sampler"] = sampler
        if kwargs["num_workers"] > 0:
            kwargs.setdefault("persistent_workers", self.persistent_workers)
            kwargs.setdefault("prefetch_factor", self.prefetch_factor)
            kwargs.setdefault("worker_init_fn", init_worker)
        kwargs.setdefault("batch_size", self.per_device_batch_size)
        global_order = train and isinstance(kwargs["sampler"], GlobalOrder | sizes.ScheduledBatches)
        if train:
            self.global_order = global_order
        start = self.resume_at if train else None  # (kept: Lightning may build the loader twice, and counts its epoch)
        if train and kwargs["batch_size"] is not None and kwargs.get("persistent_workers"):  # data/lookahead.py:
            loader = lookahead.LookaheadLoader(dataset, **kwargs)  # its workers run on into the next epoch (no refill)
            loader._resume = start  # (the global position: the same batches whatever the count of processes)
            return loader
        if start is not None and global_order:
            kwargs["sampler"].start = start
        return StatefulDataLoader(dataset, drop_last=train and kwargs["batch_size"] is not None, **kwargs)

    def _train_sampler(self, dataset: Dataset, world: int, rank: int, batch_size: int) -> GlobalOrder:
        """The epoch's order of process `rank` of `world`, in global batches of `batch_size` x `world` (1, 0, 1: the
        whole set's order, which a size schedule cuts)."""
        keyed = isinstance(dataset, TransformDataset)
        return GlobalOrder(dataset, world, rank, self.shuffle_seed, batch_size, keyed=keyed)

    def batch_draws(self, n: int) -> Rows | torch.Generator:
        """What a training batch of `n` images on this process draws its augmentation from, on the device: in a fit,
        the Rows of its global batch (seeded.batch_rows: the same draws for an image in the same place of the same
        global batch, however many processes share it); without a Trainer, the module's generator."""
        trainer = self.trainer
        if trainer is None or not self.global_order:
            return self.rng
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # (counted once it is on the device)
        return batch_rows(self.shuffle_seed, trainer.current_epoch, batch, trainer.global_rank, n, trainer.world_size)

    def seed_process(self, seed: int) -> None:
        """This process's own augmentation draws (rank_state.seed_process: one stream per rank)."""
        self.rng.manual_seed(seed + 1)

    def _auto_workers(self) -> int:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        devices = self.trainer.num_devices if self.trainer is not None else 1
        return max(1, min(16, cpus // max(1, devices) - 1))

    def _check_enough_images(self, n: int) -> None:
        """Training takes full batches only (drop_last): fewer images than a batch would train nothing."""
        world = self.trainer.world_size if self.trainer is not None else 1
        if n // world < self.per_device_batch_size:
            per = f" ({n // world} per process)" if world > 1 else ""
            most = n // world * world
            raise UserError(
                f"data.batch_size {self.batch_size} is larger than the {n} training images{per}, and training "
                f"uses full batches only, so nothing would be trained; set data.batch_size to at most {most}"
            )

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader(self._served("train"), train=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return self._evaluated("val")

    def test_dataloader(self) -> StatefulDataLoader:
        return self._evaluated("test")

    def _evaluated(self, split: str) -> StatefulDataLoader:
        """Each process evaluates its own share, no image twice (Lightning's sampler would repeat some to even the
        shares out), so the synced metrics are those of one process evaluating them all, on any count of processes.
        Testing runs outside DDP's wrapper; validation runs inside it, whose forward without gradients syncs the
        buffers at the first batch only, so shares that differ by a batch cannot stall it where every process has
        one. A sharded model gathers its weights at every forward: validated with FSDP, or with fewer images than
        processes, the shares stay Lightning's (evened out by repeating a few)."""
        world = self.trainer.world_size if self.trainer is not None else 1
        data = self._served(split)
        if world == 1 or data is None or isinstance(data, IterableDataset):  # (a stream shares itself out)
            return self._loader(data, train=False)
        if split == "val" and (not isinstance(self.trainer.strategy, DDPStrategy) or len(data) < world):
            return self._loader(data, train=False)
        share = UnrepeatedDistributedSampler(data, num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        return self._loader(data, train=False, sampler=share)

    def _served(self, split: str) -> Dataset | None:
        """The dataset `split`'s loader reads (ImageDataModule: a copy held on the device, data/resident.py)."""
        return getattr(self, f"{split}_set")

    @property
    def data_device(self) -> torch.device:
        """The training device (each process's own), or without a Trainer `placement` (a plain loop sets it)."""
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return self.placement if self.placement is not None else torch.device("cpu")

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """(images, labels) straight to the device, without Lightning's generic walk over the batch (a
        tenth of a millisecond per step, as much as a small model's data path); pinned uint8 batches are
        copied without blocking, so the next step queues while the copy runs."""
        if isinstance(batch, decoding.EncodedBatch):  # the bytes stay on the host, for the decoder (data/decoding.py)
            return batch._replace(labels=batch.labels.to(device, non_blocking=device.type == "cuda"))
        if isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in batch):
            return type(batch)(t.to(device, non_blocking=device.type == "cuda") for t in batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        return self.device_transform(batch, train=self.trainer is not None and self.trainer.training)

    def device_transform(self, batch, train: bool):  # a batch on the device -> the model's input (Lightning calls it)
        raise NotImplementedError

    def predict_tensor(self, img) -> torch.Tensor:  # one image (PIL or tensor) -> the batch test images are made into
        raise NotImplementedError

    def first_images(self, split: str, n: int) -> torch.Tensor:
        """The first `n` images of `split` as the model takes them at evaluation (B, C, H, W), on the CPU."""
        self.setup("test")
        dataset = self.eval_view(split)
        batch = next(iter(self._loader(Subset(dataset, range(min(n, len(dataset)))), train=False)))
        return self.device_transform(batch, train=False)[0]

    def eval_view(self, split: str) -> Dataset:
        """`split`'s images as evaluation sees them (no augmentation; the training split's too): frozen-feature
        evaluations read the training split this way. Here the in-memory datasets, augmented on the device only."""
        dataset = getattr(self, f"{split}_set")
        if dataset is None:
            raise UserError(f"the data has no {split} split")
        return dataset

    def state_dict(self) -> dict:
        return {"augment_rng": self.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "augment_rng" in state:
            self.rng.set_state(state["augment_rng"])


def refuse_indivisible_batch(batch_size: int, world: int) -> None:
    """data.batch_size is the global batch: `world` processes must divide it (cli/node_checks.py asks before any
    process starts, a data module again as it deals its loaders)."""
    if batch_size % world:
        counts = [n for n in range(1, min(batch_size, 4 * world) + 1) if batch_size % n == 0]
        raise UserError(
            f"data.batch_size {batch_size} is global and must be divisible by the {world} processes "
            f"(trainer.devices x trainer.num_nodes); counts that divide it: {', '.join(map(str, counts))}"
        )
