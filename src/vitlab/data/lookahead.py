"""No epoch-start refill: a training loader whose persistent workers run on into the next epoch.

A plain DataLoader's iterator ends with its epoch: its workers (persistent or not) wait until the next epoch's
`iter()`, then each prepares a whole batch before the first step can run, while the device waits (timm's train.py
and vitlab's loader both paid it, `epoch_starts_s` in benchmark.task=end2end). Here the loader's sampler goes on
from one epoch into the next (`EpochsSampler`: each epoch's order is known in advance, drawn from (seed, epoch) by
the DistributedSampler it wraps), so the loader's one iterator never ends: when an epoch's last batches are taken,
the workers are already preparing the next epoch's first ones (through validation too), and `LookaheadLoader`
hands the batches out an epoch at a time.

The order is the wrapped sampler's, epoch by epoch, unchanged. Resume: the loader's state is (epoch, batches given
out in it); a resumed loader starts its sampler at that epoch, past those batches (nothing read or decoded for
them), and drops what the workers had prepared ahead, as torchdata's StatefulDataLoader does. An epoch cut short
(`trainer.limit_train_batches`) or an epoch other than the one it ran into starts the iterator anew there.
No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader


class EpochsSampler(DistributedSampler):
    """`sampler` as the loader shows it (`loader.sampler`): one epoch, the one due (`set_epoch`: Lightning calls it at
    every epoch's start), of the same length. A DistributedSampler, so that Lightning leaves it as it is under DDP."""

    def __init__(self, sampler: Any):
        self.sampler, self.epoch = sampler, getattr(sampler, "epoch", 0)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator:
        return iter(at_epoch(self.sampler, self.epoch))

    def running(self, start: tuple[int, int], batch_size: int) -> Iterator:
        """Epoch after epoch from `start` = (epoch, batches to skip), each epoch's whole batches (drop_last)."""
        epoch, skip = start
        whole = len(self) // batch_size * batch_size
        while True:
            for n, key in enumerate(at_epoch(self.sampler, epoch)):
                if n >= whole:
                    break
                if n >= skip * batch_size:
                    yield key
            epoch, skip = epoch + 1, 0


def at_epoch(sampler: Any, epoch: int) -> Any:
    """A copy of `sampler` at `epoch` (Lightning's set_epoch on the one it holds changes no order drawn here)."""
    sampler = copy.copy(sampler)
    sampler.set_epoch(epoch)
    return sampler


class Running(Sampler):
    """What the loader's batch sampler reads: the EpochsSampler's keys from `start` on, never ending."""

    def __init__(self, epochs: EpochsSampler, batch_size: int):
        self.epochs, self.batch_size = epochs, batch_size
        self.start = (epochs.epoch, 0)

    def __len__(self) -> int:  # (the loader's len(): one epoch's batches)
        return len(self.epochs)

    def __iter__(self) -> Iterator:
        return self.epochs.running(self.start, self.batch_size)


class LookaheadLoader(StatefulDataLoader):
    """A StatefulDataLoader over an EpochsSampler (persistent workers, whole batches): `iter()` gives the due epoch's
    batches from the one iterator that runs across epochs."""

    def __init__(self, dataset: Any, sampler: Any, batch_size: int, **kwargs: Any):
        super().__init__(dataset, sampler=EpochsSampler(sampler), batch_size=batch_size, drop_last=True, **kwargs)
        self.batch_sampler.sampler = self._stream = Running(self.sampler, batch_size)  # (its own keys, endless)
        self._running: Iterator | None = None
        self._at: tuple[int, int] | None = None  # (epoch, batches given out in it) of the running iterator
        self._resume: tuple[int | None, int] | None = None

    def __iter__(self) -> Iterator:
        epoch = self.sampler.epoch
        skip = self._resume[1] if self._resume is not None and self._resume[0] in (epoch, None) else 0
        # the running iterator is at this epoch's start: asked again before a batch, or the last epoch given out whole
        # (Lightning takes len() batches and asks for no more)
        at_start = self._at in ((epoch, 0), (epoch - 1, len(self)))
        if self._running is None or self._resume is not None or not at_start:
            self._stream.start = (epoch, skip)
            self._running = super().__iter__()  # (persistent workers: the same workers, their queues reset)
        self._resume, self._at = None, (epoch, skip)
        return self._epoch(epoch, skip)

    def _epoch(self, epoch: int, given: int) -> Iterator:
        for k in range(given + 1, len(self) + 1):
            batch = next(self._running)
            self._at = (epoch, k)  # (on its way out: the checkpoint after this batch's step resumes after it)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        epoch, given = self._at if self._at is not None else (self.sampler.epoch, 0)
        return {"lookahead": {"epoch": epoch, "batches": given}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "lookahead" in state:
            self._resume = (state["lookahead"]["epoch"], state["lookahead"]["batches"])
        elif "_snapshot" in state:  # a checkpoint from before: torchdata's multi-worker state, batches given this epoch
            given = state["_snapshot"]["_snapshot_step"] + state.get("_steps_since_snapshot", 0)
            self._resume = (None, given)  # (in the epoch Lightning resumes in: its set_epoch says which)
