"""`data.batch_size=auto`: the largest global batch whose estimated memory per process (training.devices.memory, the
estimate logged at every start, held to the profiler's peak in tests) fits `AUTO_HEADROOM` of the device's memory (or of
`memory_budget_gb`), a multiple of the processes, at most the training images; chosen before the data module and the
module are built, so the learning rate is scaled from it (optim.lr_base) and config.yaml records the number. A run
resumed from a checkpoint keeps the checkpoint's batch (the same steps, the same schedule).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from omegaconf import DictConfig, open_dict

from vitlab.convert.weights import read_checkpoint
from vitlab.training.devices import memory, sharding
from vitlab.training.run.build import build_module
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

AUTO_HEADROOM = 0.9  # of the memory: what the estimate leaves out (allocator slack, the loss, workspaces)


def processes(trainer: L.Trainer) -> int:
    return max(1, trainer.num_devices * trainer.num_nodes)


def provisional(cfg: DictConfig, trainer: L.Trainer) -> bool:
    """Whether the batch is `auto`; if so, a batch the data module can be built with (one image per process) until
    `choose` sets the real one."""
    if cfg.data.get("batch_size") != "auto":
        return False
    with open_dict(cfg):
        cfg.data.batch_size = processes(trainer)
    return True


def choose(cfg: DictConfig, trainer: L.Trainer, datamodule: L.LightningDataModule) -> dict[str, Any]:
    """Sets cfg.data.batch_size (and the data module's) to the batch `auto` stands for; returns what was chosen and
    why, for the log and metrics.json."""
    n = processes(trainer)
    if cfg.get("ckpt_path"):
        chosen = int(read_checkpoint(cfg.ckpt_path, weights=False)["hyper_parameters"]["data"]["batch_size"])
        _set(cfg, datamodule, chosen)
        log.info("data.batch_size=auto: %d, the batch of the checkpoint this run resumes", chosen)
        return {"batch_size": chosen, "from": "the resumed checkpoint"}
    schedule = getattr(datamodule, "size_schedule", None)  # data.train_img_sizes: the size of the most activations
    per_image, fixed, px = _costs(cfg, trainer, n, schedule)
    if cfg.get("memory_budget_gb") is not None:
        budget, whose = float(cfg.memory_budget_gb) * 1e9, "memory_budget_gb's"
    else:
        budget, whose = memory.available(trainer)
    per_process = int((AUTO_HEADROOM * budget - fixed) // per_image)
    if per_process < 1:
        raise UserError(
            f"data.batch_size=auto: not one image per process fits {AUTO_HEADROOM:.0%} of {whose} "
            f"{memory.size(budget)} (weights, gradients and optimizer state {memory.size(fixed)}, "
            f"{memory.size(per_image)} per image); bring it down with model.grad_checkpointing, trainer=fsdp, "
            "trainer.precision=bf16-mixed"
        )
    chosen, images = per_process * n, _training_images(datamodule)
    capped = images is not None and chosen > images // n * n
    if capped:
        chosen = images // n * n
    _set(cfg, datamodule, chosen)
    est = memory.estimate(*_probe_args(cfg, trainer, n, chosen // n), px=px)
    why = f"the training images ({images})" if capped else f"{AUTO_HEADROOM:.0%} of {whose} {memory.size(budget)}"
    log.info(
        "data.batch_size=auto: %d (%d per process x %d), estimated %s per process; the most that fits %s",
        chosen, chosen // n, n, memory.size(est.total), why,
    )  # fmt: skip
    return {"batch_size": chosen, "per_process": chosen // n, "estimate_bytes": est.total,
            "budget_bytes": budget, "limited_by": "training images" if capped else "memory"}  # fmt: skip


def _set(cfg: DictConfig, datamodule: L.LightningDataModule, batch: int) -> None:
    with open_dict(cfg):
        cfg.data.batch_size = batch
    datamodule.batch_size = batch


def _probe_args(cfg: DictConfig, trainer: L.Trainer, processes: int, per_process: int) -> tuple:
    """memory.estimate's arguments for this run at `per_process` images per process: the module laid out on the
    meta device (nothing allocated)."""
    module = build_module(cfg, None, probe=True)
    device = "cuda" if type(trainer.accelerator).__name__ == "CUDAAccelerator" else "cpu"
    sharded = sharding.splits_weights(trainer)
    return module, cfg.optim.name, per_process, processes, str(trainer.precision), sharded, device


def _costs(cfg: DictConfig, trainer: L.Trainer, processes: int, schedule: Any = None) -> tuple[float, float, Any]:
    """(bytes per image per process, bytes that do not grow with the batch, the image size they are for: with a
    schedule of training sizes, the one whose images keep the most activations, which every batch must fit at)."""
    args = _probe_args(cfg, trainer, processes, 1)
    sizes = list(schedule.img_sizes) if schedule is not None else [None]
    est = max((memory.estimate(*args, px=px) for px in sizes), key=lambda e: e.activations)
    return est.activations, est.total - est.activations, est.px


def _training_images(datamodule: L.LightningDataModule) -> int | None:
    datamodule.setup("fit")  # (once: fit's own setup finds it done)
    train = getattr(datamodule, "train_set", None)
    return len(train) if train is not None and hasattr(train, "__len__") else None
