"""What each process's training state adds to a checkpoint, so that a run resumed with N processes continues
exactly as the uninterrupted one would have, and the run's global position (epoch, global batches, images seen), so
that one resumed on another number of processes does too where nothing it drew was a process's own (`_another_count`;
data/seeded.py keeps the data order and the augmentation's draws apart from the processes).

Under DDP every process has random generators of its own (dropout, stochastic depth, MixUp, the on-device
augmentation of `data.base.DataModule.rng`), its own loader position (in its share of the epoch's
permutation) and its own running training metrics, while Lightning writes the checkpoint of rank 0 alone. Here
each process's part is gathered to rank 0 when a checkpoint is written, and on resume each process takes its own
back: the datamodule's and the loader's before Lightning restores them, the random generators and metrics just
before the first batch (loaders and validation draw from the generators in between, exactly as the uninterrupted
run did before that batch).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)

KEY = "rank_states"
POSITION = "position"  # the run's global position (_position)


def seed_process(trainer: L.Trainer) -> None:
    """Every process draws random numbers of its own (dropout, stochastic depth, MixUp, augmentation), as timm's and
    DeiT's training scripts seed them: rank r > 0 reseeds with seed + r, and rank 0 keeps its stream. Call it
    once DDP is set up (Lightning resets every process to the run's seed there); the model's initial weights and the
    data's shuffling seed come from the run's seed in every process."""
    rank = trainer.global_rank
    if rank == 0:
        return
    seed = torch.initial_seed() + rank
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if hasattr(trainer.datamodule, "seed_process"):
        trainer.datamodule.seed_process(seed)


def save(trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any], drew: bool = False) -> None:
    """Add every process's part to `checkpoint` (a collective: Lightning builds the checkpoint on every rank), and
    the run's global position (POSITION). `drew`: whether this process has drawn from its own generators in
    training (dropout, MixUp, ...: `RankState` watches them)."""
    mine = {
        "rng": _rng_states(),
        "loader": _loader_state(checkpoint),
        "datamodule": checkpoint.get(_datamodule_key(trainer)),
        "metrics": _metric_states(module),
        "drew": drew,
    }
    checkpoint[POSITION] = _position(trainer)
    if trainer.world_size == 1 or not dist.is_initialized():
        checkpoint[KEY] = [mine]
        return
    everyone = [None] * trainer.world_size if trainer.is_global_zero else None
    dist.gather_object(mine, everyone, dst=0)
    checkpoint[KEY] = everyone  # only rank 0 writes the file


def _position(trainer: L.Trainer) -> dict[str, Any]:
    """Where the run is, whatever the number of processes: the epoch, its global batches trained, the images seen,
    and whether the order is global (data/seeded.py's GlobalOrder: a run resumes exactly on another count)."""
    loop, epochs = trainer.fit_loop, trainer.fit_loop.epoch_progress.current
    # Saved once an epoch's training is over (its end's checkpoint: processed but not yet completed), the next epoch
    # starts from its first batch; otherwise the epoch in progress goes on after its completed batches.
    batches = 0 if epochs.processed > epochs.completed else loop.epoch_loop.batch_progress.current.completed
    epoch = epochs.processed
    datamodule = trainer.datamodule
    batch = getattr(datamodule, "batch_size", None)
    return {
        "epoch": epoch,
        "batches": batches,
        "samples": loop.epoch_loop.batch_progress.total.completed * batch if isinstance(batch, int) else None,
        "processes": trainer.world_size,
        "global_order": bool(getattr(datamodule, "global_order", False)),
        "mix_groups": getattr(
            getattr(getattr(trainer, "lightning_module", None), "objective", None), "mix_groups", None
        ),
    }


def take(
    trainer: L.Trainer, checkpoint: dict[str, Any], module: L.LightningModule | None = None
) -> dict[str, Any] | None:
    """This process's part of a loaded checkpoint: its datamodule state is loaded and its loader state put where
    Lightning restores it from; the random generators and metrics are returned, for `restore` before the first
    batch. Written by another number of processes: see `_another_count`."""
    parts = checkpoint.get(KEY)
    if not parts:  # written before per-process states: rank 0's generator only
        return {"rng": {"torch": checkpoint["rng_states"]["torch"]}} if "rng_states" in checkpoint else None
    groups = (checkpoint.get(POSITION) or {}).get("mix_groups")
    if groups and hasattr(getattr(module, "objective", None), "mix_groups"):
        module.objective.mix_groups = groups  # MixUp's pairs: within the shares of the processes the run started on
    rank = trainer.global_rank
    if len(parts) != trainer.world_size:
        mine = _another_count(trainer, checkpoint, parts, module)
    else:
        mine = parts[rank]
    if mine["datamodule"] is not None:  # (Lightning has restored rank 0's before the callbacks see the checkpoint)
        checkpoint[_datamodule_key(trainer)] = mine["datamodule"]
        trainer.datamodule.load_state_dict(mine["datamodule"])
    if mine["loader"] is not None:
        checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = mine["loader"]
    else:
        checkpoint["loops"]["fit_loop"]["state_dict"].pop("combined_loader", None)
    return mine


def _another_count(
    trainer: L.Trainer, checkpoint: dict[str, Any], parts: list[dict], module: L.LightningModule | None
) -> dict[str, Any]:
    """This process's part of a checkpoint written by another number of processes. With a global order (the
    checkpoint's POSITION) the loader starts at the global position, which is the same batches on any count, and
    the run goes on as the uninterrupted one would have where it drew nothing per process since it started (its
    parts' "drew"); a checkpoint written before, or a sampler that deals per process, goes on with a warning, as
    before. Each of the new processes takes the generators of the old one of its rank (modulo their count) and its
    running metrics: those of the old ones beyond the new count are added into it (their sums), so that the epoch's
    synced training metrics stay those of every image seen."""
    old, new, rank = len(parts), trainer.world_size, trainer.global_rank
    position = checkpoint.get(POSITION)
    if position is None or not position["global_order"]:
        log.warning(
            "the checkpoint was written by %d processes and resumes with %d: the data order and random draws "
            "from here on differ from those of an uninterrupted run",
            old,
            new,
        )
        mine = dict(parts[0], loader=None)  # another number of processes shares the data out differently
        return mine
    why = []
    if any(part.get("drew") for part in parts):
        why.append("the processes drew random numbers of their own (MixUp or CutMix, the augmentation, the objective)")
    objective = getattr(module, "objective", None)
    if objective is not None and objective.per_process(new):
        why.append(objective.per_process(new))
    if trainer.is_global_zero and why:
        log.info(
            "written by %d processes, resumed on %d: the data order and each image's augmentation go on as they "
            "would have; not exact: %s (docs: Reliability)",
            old,
            new,
            "; ".join(why),
        )
    elif trainer.is_global_zero:
        log.info("written by %d processes, resumed on %d: exact", old, new)
    trainer.datamodule.resume_at = (position["epoch"], position["batches"])
    mine = dict(parts[rank % old], loader=None)
    mine["metrics"] = _merged_metrics(parts, rank, new, module) if rank < old else None
    return mine


def _merged_metrics(parts: list[dict], rank: int, new: int, module: L.LightningModule | None) -> dict | None:
    """Rank `rank`'s running metric states, with those of the old ranks beyond the new count that fall to it (j % new
    == rank) added in where the metric sums its state across processes (torchmetrics' "sum" reduction)."""
    mine = parts[rank].get("metrics")
    if not mine or module is None:
        return mine
    summed = {
        f"{name}.{key}"
        for name, child in module.named_modules()
        for key, fx in getattr(child, "_reductions", {}).items()
        if getattr(fx, "__name__", "") == "dim_zero_sum"
    }
    merged = dict(mine)
    for j in range(len(parts)):
        if j >= new and j % new == rank and parts[j].get("metrics"):
            for key in summed & merged.keys():
                merged[key] = merged[key] + parts[j]["metrics"][key]
    return merged


def restore(module: L.LightningModule, mine: dict[str, Any]) -> None:
    """Put back this process's random generators and running metrics (call just before the first batch)."""
    if "python" in mine["rng"]:
        _set_rng_states(_from_tensors(mine["rng"]))
    else:  # an older checkpoint: torch's generator only
        torch.set_rng_state(mine["rng"]["torch"])
    if mine.get(
        "metrics"
    ):  # saved on the CPU; torchmetrics keeps a loaded state as it is, so each goes where its own is
        here = {k: v.device for k, v in _metric_states(module, cpu=False).items()}
        module.load_state_dict({k: v.to(here.get(k, v.device)) for k, v in mine["metrics"].items()}, strict=False)


def _metric_states(module: L.LightningModule, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The module's state outside its networks (its running metrics), without asking a network for its state: the
    checkpoint's state dict holds them once (each process's copy here was the ViT's, an MAE decoder's, DINO's
    student and teacher, a distillation's heads again), and a sharded one (FSDP) would hand over its shards."""
    networks = tuple(getattr(module, "network_prefixes", ("model.",)))
    return {
        f"{name}.{key}": value.cpu() if cpu else value
        for name, child in module.named_children()
        if f"{name}." not in networks
        for key, value in child.state_dict().items()
    }


def _rng_states() -> dict[str, Any]:
    # CUDA's generators only when CUDA is in use: reading them would start CUDA in a CPU run on a GPU machine.
    states = _collect_rng_states(include_cuda=torch.cuda.is_available() and torch.cuda.is_initialized())
    name, keys, pos, has_gauss, gauss = states["numpy"]
    # weights_only loading takes tensors, not arrays; int64, since a uint32 tensor does not survive pickling
    states["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
    return states


def _from_tensors(states: dict[str, Any]) -> dict[str, Any]:
    states = dict(states)
    if "numpy" in states:
        name, keys, pos, has_gauss, gauss = states["numpy"]
        states["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)
    if "torch.cuda" in states and not torch.cuda.is_available():
        del states["torch.cuda"]  # resumed on a machine without a GPU
    return states


def _loader_state(checkpoint: dict[str, Any]) -> Any:
    return checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")


def _datamodule_key(trainer: L.Trainer) -> str | None:
    return type(trainer.datamodule).__qualname__ if trainer.datamodule is not None else None


def _generators() -> bytes:
    """The state of this process's own generators (torch's, CUDA's where started, Python's, numpy's), to tell whether
    training drew from them."""
    states = [
        torch.get_rng_state().numpy().tobytes(),
        repr(random.getstate()).encode(),
        np.random.get_state()[1].tobytes(),
    ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [state.numpy().tobytes() for state in torch.cuda.get_rng_state_all()]
    return b"".join(states)


class RankState(L.Callback):
    """The per-process state above, carried by every checkpoint of a fit (training.run.build adds this callback to every
    Trainer it builds): each process reseeded once DDP is set up, its part gathered when a checkpoint is written, and
    on resume taken back (datamodule and loader before Lightning restores them, the generators and metrics just
    before the first batch). It also watches whether training draws from the process's own generators (torch's and
    the others, the datamodule's), which a resume on another number of processes cannot carry over."""

    def __init__(self) -> None:
        self._mine: dict[str, Any] | None = None
        self._drew = False  # drawn from before the last resume (its checkpoint said so)
        self._before: tuple[bytes | None, bytes | None] | None = None  # (generators, datamodule's) at the start

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            seed_process(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = (None, _datamodule_generator(trainer))  # (its state resumed already)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        save(trainer, pl_module, checkpoint, drew=self._drew or self._has_drawn(trainer))

    def _has_drawn(self, trainer: L.Trainer) -> bool:
        if self._before is None or self._before[0] is None:  # no training batch yet
            return False
        return (_generators(), _datamodule_generator(trainer)) != self._before

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # (Lightning calls it before testing from a checkpoint too)
            self._mine = take(trainer, checkpoint, pl_module)
            self._drew = any(part.get("drew", True) for part in checkpoint.get(KEY) or [{}])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._mine:
            restore(pl_module, self._mine)
            self._mine = None
        if self._before is not None and self._before[0] is None:
            self._before = (_generators(), self._before[1])


def _datamodule_generator(trainer: L.Trainer) -> bytes | None:
    rng = getattr(trainer.datamodule, "rng", None)
    return rng.get_state().numpy().tobytes() if isinstance(rng, torch.Generator) else None
