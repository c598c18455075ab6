"""`data.batch_size=auto`: the largest global batch whose estimated memory per process (training.devices.memory, the
estimate logged at every start, held to the profiler's peak in tests) fits `AUTO_HEADROOM` of the device's memory (or of
`memory_budget_gb`), a multiple of the processes, at most the training images; chosen before the data module and the
module are built (`settle`: the plan's batch), so the learning rate is scaled from it (optim.lr_base) and config.yaml
records the number. A run resumed from a checkpoint keeps the checkpoint's batch (the same steps, the same schedule).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import lightning as L

from vitlab.training.batch_lr import scaled_optim
from vitlab.training.devices import memory, sharding
from vitlab.training.run.build import build_module
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

AUTO_HEADROOM = 0.9  # of the memory: what the estimate leaves out (allocator slack, the loss, workspaces)


def processes(trainer: L.Trainer) -> int:
    return max(1, trainer.num_devices * trainer.num_nodes)


def provisional(plan: TrainPlan, trainer: L.Trainer) -> dict[str, Any]:
    """The data module's arguments until `settle` chooses the batch: with data.batch_size=auto, a batch it can be
    built with (one image per process); none otherwise."""
    return {"batch_size": processes(trainer)} if plan.data.get("batch_size") == "auto" else {}


def settle(plan: TrainPlan, trainer: L.Trainer, datamodule: L.LightningDataModule) -> TrainPlan:
    """The plan at the batch data.batch_size=auto stands for (the data module's batch set to it too, the learning
    rate scaled from it: with_batch), what was chosen and why in the plan for the log and metrics.json; the plan
    as it is with a batch given."""
    if plan.data.get("batch_size") != "auto":
        return plan
    chosen = choose(plan, trainer, datamodule)
    datamodule.batch_size = chosen["batch_size"]
    return with_batch(plan, chosen["batch_size"], chosen)


def with_batch(plan: TrainPlan, batch: int, chosen: dict[str, Any] | None = None) -> TrainPlan:
    """The plan at the global batch `batch` (data.batch_size; `chosen`: what data.batch_size=auto chose, and why), its
    learning rate scaled from optim.lr_base by it (scaled_optim)."""
    data = plan.data | {"batch_size": batch}
    optim = scaled_optim(plan.optim, data, plan.trainer)
    return dataclasses.replace(plan, data=data, optim=optim, batch_size_auto=chosen)


def choose(plan: TrainPlan, trainer: L.Trainer, datamodule: L.LightningDataModule) -> dict[str, Any]:
    """The batch `auto` stands for, and why: the batch of the checkpoint ckpt_path names, else the most that fits."""
    n = processes(trainer)
    if plan.resume is not None and plan.resume.given:  # (ckpt_path's; a restarted job's own is chosen anew)
        chosen = int(plan.resume.hparams["data"]["batch_size"])
        log.info("data.batch_size=auto: %d, the batch of the checkpoint this run resumes", chosen)
        return {"batch_size": chosen, "from": "the resumed checkpoint"}
    schedule = getattr(datamodule, "size_schedule", None)  # data.train_img_sizes: the size of the most activations
    per_image, fixed, px = _costs(plan, trainer, n, schedule)
    if plan.memory_budget_gb is not None:
        budget, whose = float(plan.memory_budget_gb) * 1e9, "memory_budget_gb's"
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
    est = memory.estimate(*_probe_args(plan, trainer, n, chosen // n), px=px)
    why = f"the training images ({images})" if capped else f"{AUTO_HEADROOM:.0%} of {whose} {memory.size(budget)}"
    log.info(
        "data.batch_size=auto: %d (%d per process x %d), estimated %s per process; the most that fits %s",
        chosen, chosen // n, n, memory.size(est.total), why,
    )  # fmt: skip
    return {"batch_size": chosen, "per_process": chosen // n, "estimate_bytes": est.total,
            "budget_bytes": budget, "limited_by": "training images" if capped else "memory"}  # fmt: skip


def _probe_args(plan: TrainPlan, trainer: L.Trainer, processes: int, per_process: int) -> tuple:
    """memory.estimate's arguments for this run at `per_process` images per process: the module laid out on the
    meta device (nothing allocated)."""
    module = build_module(plan, None, probe=True)
    device = "cuda" if type(trainer.accelerator).__name__ == "CUDAAccelerator" else "cpu"
    sharded = sharding.splits_weights(trainer)
    return module, plan.optim["name"], per_process, processes, str(trainer.precision), sharded, device


def _costs(plan: TrainPlan, trainer: L.Trainer, processes: int, schedule: Any = None) -> tuple[float, float, Any]:
    """(bytes per image per process, bytes that do not grow with the batch, the image size they are for: with a
    schedule of training sizes, the one whose images keep the most activations, which every batch must fit at)."""
    args = _probe_args(plan, trainer, processes, 1)
    sizes = list(schedule.img_sizes) if schedule is not None else [None]
    est = max((memory.estimate(*args, px=px) for px in sizes), key=lambda e: e.activations)
    return est.activations, est.total - est.activations, est.px


def _training_images(datamodule: L.LightningDataModule) -> int | None:
    datamodule.setup("fit")  # (once: fit's own setup finds it done)
    train = getattr(datamodule, "train_set", None)
    return len(train) if train is not None and hasattr(train, "__len__") else None
