"""Training at several resolutions (`data.train_img_sizes`), as timm's train.py `--train-img-sizes`,
`--train-batch-sizes`, `--train-size-probs`, `--train-size-schedule`, `--train-size-schedule-spread` and
`--train-size-random-mix`, with timm's own ScheduledBatchSampler deciding each batch's size:

- `constant`: a fixed composition of sizes (drawn once, with `probs` as weights, to cover an epoch's images) in a new
  order every epoch; `progressive`: each epoch's sizes drawn from a window (a Gaussian of `spread` choices) that moves
  from the first size to the last over trainer.max_epochs, with a `random_mix` share drawn uniformly.
- Every batch is one size with that size's batch size (`batch_sizes`, global like data.batch_size; default
  data.batch_size for every size). The order and the schedule are global, as data/seeded.py's GlobalOrder is (issue
  78): each epoch one permutation of the whole training set from (seed, epoch), cut into global batches by timm's
  schedule drawn from the run's seed, the epoch and the whole set's length, and each of N processes trains its
  contiguous share of each, batch / N images: the same sizes and images at every step on 1, 2 or 4 processes, so a
  run resumes on another count at its global position.
- A loader item is a whole batch (the DataLoader's batch_size is None; `ScheduledBatches` yields each batch's
  (index, size) pairs). It is also a DistributedSampler, so Lightning takes it as it is instead of trying to put its
  own sampler inside it, and the loader's position (its count of batches) resumes mid-epoch exactly as any other.
- In the loader's workers each image is cropped by the training transform made for its batch's size; data held on
  the device (`data.on_device`) is shifted and flipped there and then resized to its batch's size.
- A streamed split (data=wds, data=hf streaming; data/streamed.py) has no indices to sample: it yields whole batches
  itself (`streamed_loading`), the schedule of an epoch drawn as above over the epoch's samples, its batches (each
  process's share) dealt out to the loader's workers in turn, each filled with the next samples of a worker's stream.
- Validation and testing stay at the model's size; the model resamples its position embeddings to each batch's grid
  (model.dynamic_img_size=true, `check_model`).

No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from timm.data import ScheduledBatchSampler
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from vitlab.data import transforms
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

SCHEDULES = ("constant", "progressive")


@dataclass(frozen=True)
class SizeSchedule:
    """The data.train_* keys of a run that trains at several sizes. What the loaders, the device transform, the checks
    and evaluation's views ask of a schedule it answers itself (NaFlex's answers otherwise: data/naflex.py)."""

    key: ClassVar[str] = "data.train_img_sizes"  # the key that sets it (in refusals)
    kind: ClassVar[str] = "sizes"  # what an objective names among the schedules it trains on (Objective.schedules)
    setting: ClassVar[str] = "data.train_img_sizes"  # the setting, as a refusal of an objective names it
    not_on_device: ClassVar[str] = "data.train_img_sizes draws a size a batch in the workers"  # data.decode=device's

    img_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...] | None = None  # global, one per size; None: data.batch_size for every size
    probs: tuple[float, ...] | None = None  # the sizes' weights; None: uniform
    schedule: str = "constant"
    spread: float = 0.65
    random_mix: float = 0.1

    @classmethod
    def from_keys(
        cls,
        img_sizes: Sequence[int] | None,
        batch_sizes: Sequence[int] | None,
        probs: Sequence[float] | None,
        schedule: str,
        spread: float,
        random_mix: float,
    ) -> SizeSchedule | None:
        """The schedule of data.train_img_sizes and the keys beside it (None: one size, the model's), each bad
        value refused in one line."""
        if img_sizes is None:
            for key, value in (("train_batch_sizes", batch_sizes), ("train_size_probs", probs)):
                if value is not None:
                    raise UserError(f"data.{key} {list(value)} needs data.train_img_sizes (the sizes it is one per)")
            return None
        if not img_sizes or any(not _positive_int(s) for s in img_sizes):
            raise UserError(f"data.train_img_sizes {list(img_sizes)} must be a non-empty list of sizes in px >= 1")
        for key, value in (("train_batch_sizes", batch_sizes), ("train_size_probs", probs)):
            if value is not None and len(value) != len(img_sizes):
                raise UserError(
                    f"data.{key} {list(value)} needs one value per size of data.train_img_sizes {list(img_sizes)}"
                )
        if batch_sizes is not None and any(not _positive_int(b) for b in batch_sizes):
            raise UserError(f"data.train_batch_sizes {list(batch_sizes)} must be global batch sizes >= 1")
        if probs is not None and (any(not (math.isfinite(p) and p >= 0) for p in probs) or not sum(probs) > 0):
            raise UserError(f"data.train_size_probs {list(probs)} must be weights >= 0 with a positive sum")
        if schedule not in SCHEDULES:
            raise UserError(f"data.train_size_schedule {schedule!r} is not one of {list(SCHEDULES)}")
        if schedule == "progressive" and len(img_sizes) < 2:
            raise UserError(f"data.train_size_schedule=progressive moves between sizes: {list(img_sizes)} has one")
        if not (math.isfinite(spread) and spread >= 0):
            raise UserError(f"data.train_size_schedule_spread {spread} must be >= 0 (sizes, as index units)")
        if not 0 <= random_mix <= 1:
            raise UserError(f"data.train_size_random_mix {random_mix} must be in [0, 1]")
        as_tuple = lambda v, kind: tuple(kind(x) for x in v) if v is not None else None  # noqa: E731
        return cls(tuple(img_sizes), as_tuple(batch_sizes, int), as_tuple(probs, float), schedule, spread, random_mix)

    @classmethod
    def from_data(cls, data: Any) -> SizeSchedule | None:
        """The schedule of a data config (a mapping), its keys as ImageDataModule's defaults where absent."""
        return cls.from_keys(
            data.get("train_img_sizes"),
            data.get("train_batch_sizes"),
            data.get("train_size_probs"),
            data.get("train_size_schedule", "constant"),
            data.get("train_size_schedule_spread", 0.65),
            data.get("train_size_random_mix", 0.1),
        )

    def global_batch_sizes(self, batch_size: int) -> tuple[int, ...]:
        return self.batch_sizes or (batch_size,) * len(self.img_sizes)

    def batches(self, sampler: Sampler, batch_size: int, world: int, epochs: int | None, seed: int, rank: int = 0):
        """timm's ScheduledBatchSampler over `sampler` (each epoch's order of the whole training set) with the global
        batch sizes, as timm's create_loader makes it (drop_last in training; `epochs`: trainer.max_epochs), process
        `rank` of `world` taking its share of each batch."""
        sizes = self.global_batch_sizes(batch_size)
        if any(b % world for b in sizes):
            key = "data.train_batch_sizes" if self.batch_sizes else "data.batch_size"
            raise UserError(f"{key} {list(sizes)} are global and must each be divisible by the {world} processes")
        if self.schedule == "progressive" and not (isinstance(epochs, int) and epochs >= 1):
            raise UserError(
                f"data.train_size_schedule=progressive moves through the sizes over trainer.max_epochs, which is "
                f"{epochs}: set it"
            )
        try:
            return ScheduledBatches(
                sampler,
                batch_sizes=sizes,
                choice_weights=self.probs,
                seed=seed,
                drop_last=True,
                choice_schedule=self.schedule,
                schedule_epochs=epochs if self.schedule == "progressive" else None,
                schedule_spread=self.spread,
                schedule_random_mix=self.random_mix,
                world=world,
                rank=rank,
            )
        except ValueError as e:  # the one timm finds: not one full batch in the training images
            raise UserError(self.no_full_batch(sampler, batch_size, world, epochs, seed)) from e

    def rebatched(self, batch_size: int) -> SizeSchedule:
        """The schedule data.batch_size `batch_size` would make (its own data.train_batch_sizes, where given, stay)."""
        return self

    def sizes_said(self, sizes: Sequence[int]) -> str:
        return f"global batch sizes {list(sizes)} (one per data.train_img_sizes {list(self.img_sizes)})"

    def no_full_batch(self, sampler: Sampler, batch_size: int, world: int, epochs: int | None, seed: int) -> str:
        """Not one full batch in `sampler` (the training set's order): the key that sets the batch sizes named, with the
        largest data.batch_size that gives one where it does (the user may have set neither: NaFlex's defaults)."""
        sizes, n = self.global_batch_sizes(batch_size), len(sampler)
        share = f"the {n} training images"
        if self.batch_sizes is not None and self.rebatched(1) is self:  # data.train_batch_sizes, the user's own
            return f"data.train_batch_sizes {list(sizes)} leave no full batch in {share}: give smaller ones"

        def fits(b: int) -> bool:
            try:
                sizes = self.rebatched(b).global_batch_sizes(b)
                ScheduledBatches(range(n), sizes, self.probs, seed, drop_last=True,
                                 choice_schedule=self.schedule, schedule_spread=self.spread,
                                 schedule_random_mix=self.random_mix,
                                 schedule_epochs=epochs if self.schedule == "progressive" else None)  # fmt: skip
            except ValueError:
                return False
            return all(x and x % world == 0 for x in sizes)

        low, high = 0, batch_size - 1  # the largest that fits, by bisection (a smaller batch fits where a larger does)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        said = f"data.batch_size {batch_size} makes {self.sizes_said(sizes)}, and no full batch fits {share}"
        return f"{said}: set data.batch_size={low} or less" if low else f"{said}, even at data.batch_size=1: more data"

    def average_batch(self, batch_size: int, epochs: int | None) -> float:
        """The global batch averaged over the schedule (timm's reference for scaling the learning rate)."""
        sizes = self.global_batch_sizes(batch_size)
        if len(set(sizes)) == 1:
            return float(sizes[0])
        return self.batches(range(sum(sizes)), batch_size, 1, epochs, 0).average_batch_size

    def describe(self, batches: ScheduledBatchSampler, world: int) -> str:
        """The log line of a run's schedule (as timm's train.py logs it)."""
        said = f"training sizes {list(self.img_sizes)} px, global batch sizes {list(batches.batch_sizes)}"
        if self.schedule == "progressive":
            said += (
                f", progressive over {batches.schedule_epochs} epochs (spread {self.spread:g}, random mix "
                f"{self.random_mix:g})"
            )
        return said + f": {len(batches)} batches an epoch, average batch {batches.average_batch_size:g}"

    def loading(self, dm: Any) -> tuple[list, list | None]:
        """Each size's training transform for the data module `dm` (an ImageDataModule), and its collate (None:
        stacked)."""
        return [transforms.train_transform(s, dm.mean, **dm.train_transform_args) for s in self.img_sizes], None

    def batch_hw(self, batch: Sequence[Any]) -> tuple[int, int]:
        """The size a scheduled training batch trains at: the one it carries (held on the device), else its own."""
        return tuple(batch[2]) if len(batch) > 2 else tuple(batch[0].shape[-2:])

    def training_view(self, img: Any) -> None:
        """None: a training image's view is the one-size transform's (evaluation/views.py draws it)."""
        return None

    def check_objective(self, objective: str, trained_by: list[str]) -> None:
        """`objective` among those that train on this kind of schedule (`trained_by`: their names)."""
        if objective not in trained_by:
            raise UserError(f"{self.setting} trains objective={' or '.join(trained_by)}, not objective={objective}")

    def check_model(self, model: Any, objective: str, trained_by: list[str]) -> None:
        """A model (a ViTConfig) that can train at these sizes: one resampling its position embeddings, whose patches
        tile each size, training an objective among `trained_by`."""
        self.check_objective(objective, trained_by)
        if set(self.img_sizes) != {model.img_hw[0]} and not model.dynamic_img_size:
            raise UserError(
                f"data.train_img_sizes {list(self.img_sizes)} need position embeddings at each size: set "
                "model.dynamic_img_size=true"
            )
        patch_hw = model.patch_hw
        bad = [s for s in self.img_sizes if s % patch_hw[0] or s % patch_hw[1]]
        if bad and not model.dynamic_img_pad:
            raise UserError(
                f"data.train_img_sizes {bad} are not multiples of model.patch_size {list(patch_hw)}: choose multiples, "
                "or set model.dynamic_img_pad=true"
            )


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


class ScheduledBatches(ScheduledBatchSampler, DistributedSampler):
    """timm's ScheduledBatchSampler over the order of the whole training set, its batches global, yielding process
    `rank`'s contiguous share of each, [(index, size choice), ...] of batch / `world` pairs: the same images in the
    same rows on any count, as GlobalOrder's. A run resumed on another count starts at its global position (`start`:
    (epoch, the global batches of it already trained)). It is also a DistributedSampler (its methods are all timm's),
    so that Lightning uses it as the loader's sampler as it is rather than trying to put one of its own inside it."""

    def __init__(self, sampler, batch_sizes, *args, world: int = 1, rank: int = 0, **kwargs):
        super().__init__(sampler, batch_sizes, *args, **kwargs)
        self.world, self.rank = world, rank
        self.start: tuple[int, int] | None = None

    def __iter__(self):
        skip = self.start[1] if self.start is not None and self.start[0] == self.epoch else 0
        for k, pairs in enumerate(super().__iter__()):
            if k >= skip:
                share = len(pairs) // self.world
                yield pairs[self.rank * share : (self.rank + 1) * share]


class ScheduledImages(Dataset):
    """A training split read a whole batch at a time, by the (key, size choice) pairs of ScheduledBatches. With
    `transforms` (the loader path) each image goes through its batch's size's training transform (its random draws
    seeded as TransformDataset's); without (data held on the device) the batch is gathered there at the size it is
    stored and comes with its size, to be resized once shifted and flipped (ImageDataModule.device_transform)."""

    def __init__(
        self,
        dataset: Dataset,
        img_sizes: Sequence[int],
        transforms: Sequence[Any] | None = None,
        collates: Sequence[Any] | None = None,  # per size choice (NaFlex's padding, data/naflex.py); None: stacked
    ):
        self.dataset, self.img_sizes, self.transforms = dataset, list(img_sizes), transforms
        self.collates = collates

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, pairs: list[tuple[Any, int]]):
        keys, choice = [key for key, _ in pairs], pairs[0][1]
        if self.transforms is None:
            images, labels = self.dataset.__getitems__(keys)
            return [images, labels, (self.img_sizes[choice],) * 2]
        collate = self.collates[choice] if self.collates is not None else default_collate
        return collate([self.dataset.get(key, self.transforms[choice]) for key in keys])


def scheduled_loading(dm: Any, sampler: Sampler, dataset: Dataset, world: int) -> tuple[ScheduledBatches, Dataset]:
    """The batch sampler and the dataset of a training loader at the sizes of `dm.size_schedule` (an
    ImageDataModule), over `sampler` (each epoch's order of the whole set) and `dataset` as the one-size loader would
    read them."""
    schedule: SizeSchedule = dm.size_schedule
    if isinstance(dataset, IterableDataset):  # (streamed splits batch themselves: streamed_loading)
        raise UserError(f"{schedule.key} needs images read by index; {type(dm).__name__} streams them")
    batches = _scheduled_batches(dm, sampler, world)
    if dm.resides:  # `dataset` is the split held on the device (data/resident.py; never NaFlex's, which it reads)
        return batches, ScheduledImages(dataset, schedule.img_sizes)
    return batches, ScheduledImages(dataset, schedule.img_sizes, *schedule.loading(dm))


def streamed_loading(dm: Any, split: Any, world: int) -> None:
    """A streamed training split (data/streamed.py's StreamedSplit) made to yield whole batches of `dm.size_schedule`:
    the schedule of an epoch of the split's `num_samples` (the same in every process and on any count: the same
    lengths and global batch sizes), each process's share of each batch filled from its own stream, each image
    through its choice's transform and collate."""
    batches = _scheduled_batches(dm, range(split.num_samples), world)
    made, collates = dm.size_schedule.loading(dm)
    split.batched(batches, made, collates or [default_collate] * len(made))


def _scheduled_batches(dm: Any, sampler: Sampler | range, world: int) -> ScheduledBatches:
    schedule: SizeSchedule = dm.size_schedule
    epochs = dm.trainer.max_epochs if dm.trainer is not None else None
    rank = dm.trainer.global_rank if dm.trainer is not None else 0
    batches = schedule.batches(sampler, dm.batch_size, world, epochs, dm.shuffle_seed, rank)
    said = schedule.describe(batches, world)
    if (dm.trainer is None or dm.trainer.global_rank == 0) and said != getattr(dm, "_said", None):
        log.info(said)  # once (Lightning asks for the loader twice as a run starts)
        dm._said = said
    return batches


def check_model(schedule: SizeSchedule | None, model: Any, objective: str, schedules: dict[str, frozenset]) -> None:
    """Where there is a schedule, an objective that trains on its kind (`schedules`: each objective's name and the
    kinds it trains on, the objectives' table) and a model (a ViTConfig) that can train at its sizes."""
    if schedule is not None:
        schedule.check_model(model, objective, [name for name, kinds in schedules.items() if schedule.kind in kinds])


__all__ = [
    "SizeSchedule",
    "ScheduledBatches",
    "ScheduledImages",
    "scheduled_loading",
    "streamed_loading",
    "check_model",
]
