"""A stand-in for the Trainer a DataModule reads in a fit: its process, the epoch and the batch on the device."""

from types import SimpleNamespace

import torch


def fake_trainer(
    world: int = 1, rank: int = 0, epoch: int = 0, device: str = "cpu", max_epochs: int | None = None
) -> SimpleNamespace:
    """What data/base.py reads of a Trainer as process `rank` of `world` in `epoch`; `next_batch` counts the batches
    on the device as Lightning's batch progress does (data/seeded.py's Rows are keyed on it)."""
    batches = SimpleNamespace(current=SimpleNamespace(ready=0))
    trainer = SimpleNamespace(
        world_size=world, global_rank=rank, num_devices=world, training=True, current_epoch=epoch,
        max_epochs=max_epochs,
        strategy=SimpleNamespace(root_device=torch.device(device)),
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=epoch)),
                                 epoch_loop=SimpleNamespace(batch_progress=batches)),
    )  # fmt: skip
    trainer.next_batch = lambda: setattr(batches.current, "ready", batches.current.ready + 1)
    return trainer
