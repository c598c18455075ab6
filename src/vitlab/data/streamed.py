"""Splits read as streams of shards (WebDataset tars, a Hugging Face iterable dataset): `StreamedSplit`, an
IterableDataset whose every image's place and augmentation follow from the run's seed, the epoch and the reader's
place (process, loader worker), so that a run stopped mid-epoch resumes exactly.

Training: each epoch the shards are put in an order drawn from (seed, epoch) and dealt out to the G = processes x
loader workers readers (shard k to reader k mod G; with fewer shards than readers, every reader reads them all and
keeps every G-th sample: no sample twice, at a cost in reading). A reader goes round its shards, in a new order each
pass, through a shuffle buffer (timm's `shuffle_size`), until it has given its share of the epoch, `data.num_train`
samples in all: whole batches, the same number for every process (DDP steps together). Each sample is augmented with
a seed made of (seed, epoch, reader, its place in the reader's stream).

Training at several sizes or sequence lengths (data/sizes.py: `data.train_img_sizes`, NaFlex's `data.naflex.seq_lens`):
the reader yields whole batches (`batched`). The epoch's schedule of (size choice, batch size) is drawn from (seed,
epoch) over a process's share of the epoch's samples, the same in every process; batch j of a process is made by its
loader worker j mod W (the order the loader takes its workers' items in) of the next samples of that worker's stream,
each through its choice's transform, and collated (padded, for NaFlex) there. Its state counts batches given.

Resume: a reader's state is (epoch, samples taken from the buffer, samples given); torchdata's StatefulDataLoader
keeps it for every worker at every batch, so a resumed reader replays its stream from the start of the epoch without
decoding (tar members read, not decoded) and goes on from the same sample: exact, at the cost of re-reading its
share so far.

Evaluation: every shard in order, once; batch j to process j mod P and, within it, to worker (j // P) mod W, the
order the loader takes its workers' batches in: in one process the batches come in the data's own order.

A held-out slice (`Holdout`): a sample whose (shard, place) hashes below a fraction validates instead of training,
decided by the split seed alone: a validation split made from a stream without a list of it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data.dataloader import _InfiniteConstantSampler

from vitlab.data.seeded import mix, seeded
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


class Source(Protocol):
    """A split's shards: how many, and the (name, image bytes, label) samples of one, in order."""

    n_shards: int

    def read(self, shard: int) -> Iterator[tuple[str, Any, int]]: ...


@dataclass(frozen=True)
class Holdout:
    fraction: float
    seed: int
    held: bool  # True: the held-out samples only (validation); False: all but them (training)

    def keeps(self, shard: int, place: int) -> bool:
        return (mix(self.seed, shard, place) / 2**63 < self.fraction) == self.held


class EpochSampler(_InfiniteConstantSampler):
    """The iterable loader's sampler: Lightning calls `set_epoch` on it at every epoch's start, as on a
    DistributedSampler; the epoch reaches the loader workers (persistent) through a shared value."""

    def __init__(self, split: StreamedSplit):
        super().__init__()
        self.split = split

    def set_epoch(self, epoch: int) -> None:
        self.split.epoch.value = epoch


class StreamedSplit(IterableDataset):
    """One split of (uint8 image, label) samples read from `source`'s shards; `decode(data, name)` makes an image of
    a sample's bytes in the loader workers. `num_samples`: the epoch's samples (training; all processes together),
    or the split's size where known (evaluation). `corrupt`: skip (a sample that cannot be decoded is left out and
    counted, as timm does) or error (the run stops naming it)."""

    def __init__(
        self,
        source: Source,
        transform: Callable,
        decode: Callable[[Any, str], torch.Tensor],
        train: bool,
        num_samples: int | None,
        shuffle_buffer: int = 0,
        corrupt: str = "skip",
        holdout: Holdout | None = None,
    ):
        self.source, self.transform, self.decode, self.train = source, transform, decode, train
        self.num_samples, self.shuffle_buffer = num_samples, shuffle_buffer
        self.corrupt, self.holdout = corrupt, holdout
        self.seed, self.rank, self.world, self.batch_size = 0, 0, 1, 1  # set by place() when a loader is made
        self.epoch = multiprocessing.Value("q", 0)  # set by EpochSampler in the main process, read in the workers
        self.skipped = 0
        self._position = {"epoch": -1, "taken": 0, "given": 0}
        self._resume: dict | None = None
        self.schedule: Any = None  # training in whole batches of a size schedule (batched); None: of batch_size
        self.transforms: list[Callable] = []  # per size choice, with its collate
        self.collates: list[Callable] = []

    def place(self, seed: int, rank: int, world: int, batch_size: int) -> StreamedSplit:
        self.seed, self.rank, self.world, self.batch_size = seed, rank, world, batch_size
        return self

    def batched(self, schedule: Any, transforms: list[Callable], collates: list[Callable]) -> StreamedSplit:
        """Training in whole batches: `schedule` (data/sizes.py's ScheduledBatches over range(this process's share of
        the epoch's samples)) says each batch's size choice and batch size; a batch's images go through its choice's
        transform and collate. The loader takes each item as it is (`whole`)."""
        self.schedule, self.transforms, self.collates = schedule, list(transforms), list(collates)
        return self

    def as_eval(self, transform: Callable) -> StreamedSplit:
        """The same samples in evaluation's order (every one once, in order), through `transform`."""
        return StreamedSplit(self.source, transform, self.decode, False, None, 0, self.corrupt, self.holdout)

    def count_all(self) -> int:
        """The samples of the split's shards, held out or not."""
        return sum(1 for shard in range(self.source.n_shards) for _ in self.source.read(shard))

    def count(self) -> int:
        """The split's samples, counted by reading its shards once without decoding them (a split whose size no
        description gives: frozen-feature evaluations need the size of the bank they extract)."""
        return sum(1 for shard in range(self.source.n_shards) for _ in self._kept(shard))

    def __len__(self) -> int:
        """This process's samples (training: whole batches; Lightning counts the steps by it)."""
        if self.num_samples is None:
            raise TypeError("the split's size is not known")  # (Lightning then reads until it ends)
        if self.train and self.schedule is not None:  # batches, not samples
            return len(self.schedule)
        if self.train:
            return self.num_samples // self.world // self.batch_size * self.batch_size
        batches = -(-self.num_samples // self.batch_size)
        mine = len(range(self.rank, batches, self.world))
        last = self.num_samples - (batches - 1) * self.batch_size  # the last batch may be short
        return mine * self.batch_size - (self.batch_size - last if (batches - 1) % self.world == self.rank else 0)

    def state_dict(self) -> dict:
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if not self.train:
            yield from self._evaluation(worker, workers)
            return
        reader, readers = self.rank * workers + worker, self.world * workers
        epoch = int(self.epoch.value)
        if self.schedule is not None:
            yield from self._batches(epoch, worker, workers, reader, readers)
            return
        batches = self.num_samples // self.world // self.batch_size  # this process's, dealt out to its workers
        quota = (batches // workers + (worker < batches % workers)) * self.batch_size
        resume, self._resume = self._resume, None
        skip = resume["taken"] if resume is not None and resume["epoch"] == epoch else 0
        given = resume["given"] if skip else 0
        self._position = {"epoch": epoch, "taken": skip, "given": given}
        if given >= quota:
            return
        stream = self._shuffled(self._cycle(epoch, reader, readers), mix(self.seed, epoch, reader))
        for taken, (name, data, label) in enumerate(stream, start=1):
            if given >= quota:
                return  # (the sample drawn is not counted: a resumed reader draws it again)
            if taken <= skip:
                continue  # replayed to the resumed position, not decoded
            image = self._decoded(data, name)
            self._position["taken"] = taken
            if image is None:
                continue
            given += 1
            self._position["given"] = given
            yield seeded(mix(self.seed, epoch, reader, taken), self.transform, image), label

    def _batches(self, epoch: int, worker: int, workers: int, reader: int, readers: int) -> Iterator[Any]:
        """This worker's whole batches of the epoch's schedule: the process's j-th when j mod `workers` is `worker`,
        filled with the next samples of its stream; its position counts the batches given."""
        self.schedule.set_epoch(epoch)
        mine = [(pairs[0][1], len(pairs)) for pairs in self.schedule][worker::workers]  # (size choice, batch size)
        resume, self._resume = self._resume, None
        taken, given = (resume["taken"], resume["given"]) if resume is not None and resume["epoch"] == epoch else (0, 0)
        self._position = {"epoch": epoch, "taken": taken, "given": given}
        stream = self._shuffled(self._cycle(epoch, reader, readers), mix(self.seed, epoch, reader))
        for _ in itertools.islice(stream, taken):
            pass  # replayed to the resumed position, not decoded
        for choice, size in mine[given:]:
            items = []
            while len(items) < size:
                name, data, label = next(stream)
                taken += 1
                image = self._decoded(data, name)
                if image is not None:
                    items.append((seeded(mix(self.seed, epoch, reader, taken), self.transforms[choice], image), label))
            given += 1
            self._position = {"epoch": epoch, "taken": taken, "given": given}
            yield self.collates[choice](items)

    def _evaluation(self, worker: int, workers: int) -> Iterator[tuple[torch.Tensor, int]]:
        i = 0
        for shard in range(self.source.n_shards):
            for name, data, label in self._kept(shard):
                batch = i // self.batch_size
                i += 1
                if batch % self.world != self.rank or (batch // self.world) % workers != worker:
                    continue
                image = self._decoded(data, name)
                if image is not None:
                    yield self.transform(image), label
        if i == 0 and self.holdout is not None:  # (a few samples may hold none out: validation would score nothing)
            raise UserError(
                f"the validation slice held out of the training data is empty: data.val_fraction "
                f"{self.holdout.fraction:g} of its {self.count_all()} samples (drawn with data.split_seed "
                f"{self.holdout.seed}) picked none; give validation data of its own (data.val_urls for data=wds) or a "
                "larger data.val_fraction"
            )

    def _kept(self, shard: int) -> Iterator[tuple[str, Any, int]]:
        for place, sample in enumerate(self.source.read(shard)):
            if self.holdout is None or self.holdout.keeps(shard, place):
                yield sample

    def _cycle(self, epoch: int, reader: int, readers: int) -> Iterator[tuple[str, Any, int]]:
        """This reader's samples, round its shards (dealt once an epoch) again and again, each pass in a new order."""
        n = self.source.n_shards
        order = _permuted(list(range(n)), mix(self.seed, epoch))
        mine = order[reader::readers] if n >= readers else order
        for turn in itertools.count():
            found = 0
            for shard in mine if turn == 0 else _permuted(mine, mix(self.seed, epoch, reader, turn)):
                for sample in self._kept(shard):
                    if n >= readers or found % readers == reader:
                        yield sample
                    found += 1
            if found == 0:
                raise UserError(f"the training shards hold no samples for reader {reader} of {readers} to read")

    def _shuffled(self, stream: Iterator, seed: int) -> Iterator:
        """timm's (and WebDataset's) shuffle buffer: each sample out is drawn at random from the last `size` in."""
        if self.shuffle_buffer <= 1:
            yield from stream
            return
        rng, buffer = random.Random(seed), []
        for sample in stream:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(sample)
                continue
            j = rng.randrange(len(buffer))
            yield buffer[j]
            buffer[j] = sample

    def _decoded(self, data: Any, name: str) -> torch.Tensor | None:
        try:
            return self.decode(data, name)
        except UserError as e:
            if self.corrupt == "error":
                raise UserError(f"{e} (data.corrupt=skip leaves such samples out, counted)") from None
            self.skipped += 1
            log.warning("skipped sample %s, which cannot be decoded (%d skipped in this reader): %s", name,
                        self.skipped, e)  # fmt: skip
            return None


def _permuted(items: list, seed: int) -> list:
    return [items[i] for i in torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()]


def whole(items: list) -> Any:
    """The loader's collate of a split that yields whole batches (`batched`), taken one at a time: the batch itself.
    (A loader of batch_size None would do the same without the batch sampler whose sampler Lightning sets the epoch
    on.)"""
    return items[0]
