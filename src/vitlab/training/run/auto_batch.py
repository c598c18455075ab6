"""The run's batch and memory, planned: its memory estimate per process (`checked`: logged as the run starts; with
memory_check, the one line that refuses a run that would not fit, before anything is built), and
`data.batch_size=auto`: the largest global batch whose estimated memory per process (training.devices.memory, the
estimate logged at every start, held to the profiler's peak in tests) fits `AUTO_HEADROOM` of the device's memory (or
of `memory_budget_gb`), a multiple of the processes, at most the training images. Chosen as the run is planned
(vitlab.cli.plans), before anything of the run is built, from the devices its trainer settings run on
(hardware.Devices): the plan's batch, from which the learning rate is scaled (optim.lr_base) and which config.yaml
records. A run resumed from a checkpoint keeps the checkpoint's batch (the same steps, the same schedule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from vitlab.data.naflex import training_schedule
from vitlab.training.batch_lr import scaled_optim
from vitlab.training.devices import memory
from vitlab.training.devices.hardware import Devices, devices_of
from vitlab.training.run.build import build_datamodule, build_module
from vitlab.training.run.plan import TrainPlan
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

AUTO_HEADROOM = 0.9  # of the memory: what the estimate leaves out (allocator slack, the loss, workspaces)


def planned(plan: TrainPlan) -> TrainPlan:
    """The plan at the batch data.batch_size=auto stands for (`with_batch`: the learning rate scaled from it, what was
    chosen and why kept for the log and metrics.json), a batch given as it is; its memory estimate `checked`. Both
    read the module laid out on the meta device (nothing allocated) and the devices the trainer settings run on."""
    devices, probe = devices_of(plan.trainer), build_module(plan, None, probe=True)
    if plan.data.get("batch_size") == "auto":
        chosen = choose(plan, devices, probe)
        plan = with_batch(plan, chosen["batch_size"], chosen)
    return checked(plan, devices, probe)


def checked(plan: TrainPlan, devices: Devices, probe: Any) -> TrainPlan:
    """The plan with the memory estimate per process of its module `probe` at its batch and training sizes (the line
    the run logs as it starts) and, with memory_check, the line that refuses a run that would not fit (the run stops
    on it before anything is built: vitlab/train.py; a plan is still made, to be read, on a machine it does not fit)."""
    schedule = training_schedule({**plan.data, **plan.views})
    estimate = memory.for_run(probe, devices, plan.optim["name"], plan.data["batch_size"], schedule)
    refused = memory.refusal(estimate, devices, plan.model.grad_checkpointing) if plan.memory_check else None
    return dataclasses.replace(plan, memory=estimate, memory_refusal=refused)


def with_batch(plan: TrainPlan, batch: int, chosen: dict[str, Any] | None = None) -> TrainPlan:
    """The plan at the global batch `batch` (data.batch_size; `chosen`: what data.batch_size=auto chose, and why), its
    learning rate scaled from optim.lr_base by it (scaled_optim), config.yaml's data and optim with them."""
    data = plan.data | {"batch_size": batch}
    optim = scaled_optim(plan.optim, data, plan.trainer)
    config = plan.config | {"data": data, "optim": optim}
    return dataclasses.replace(plan, data=data, optim=optim, config=config, batch_size_auto=chosen)


def choose(plan: TrainPlan, devices: Devices, probe: Any) -> dict[str, Any]:
    """The batch `auto` stands for, and why: the batch of the checkpoint ckpt_path names, else the most that fits."""
    n = devices.processes
    if plan.resume is not None and plan.resume.given:  # (ckpt_path's; a restarted job's own is chosen anew)
        chosen = int(plan.resume.hparams["data"]["batch_size"])
        log.info("data.batch_size=auto: %d, the batch of the checkpoint this run resumes", chosen)
        return {"batch_size": chosen, "from": "the resumed checkpoint"}
    per_image, fixed, px = costs(plan, devices, probe)
    if plan.memory_budget_gb is not None:
        budget, whose = float(plan.memory_budget_gb) * 1e9, "memory_budget_gb's"
    else:
        budget, whose = memory.budget(devices)
    per_process = int((AUTO_HEADROOM * budget - fixed) // per_image)
    if per_process < 1:
        raise UserError(
            f"data.batch_size=auto: not one image per process fits {AUTO_HEADROOM:.0%} of {whose} "
            f"{memory.size(budget)} (weights, gradients and optimizer state {memory.size(fixed)}, "
            f"{memory.size(per_image)} per image); bring it down with model.grad_checkpointing, trainer=fsdp, "
            "trainer.precision=bf16-mixed"
        )
    chosen, images = per_process * n, training_images(plan, n)
    capped = images is not None and chosen > images // n * n
    if capped:
        chosen = images // n * n
    est = memory.estimate(*probe_args(plan, devices, probe, chosen // n), px=px)
    why = f"the training images ({images})" if capped else f"{AUTO_HEADROOM:.0%} of {whose} {memory.size(budget)}"
    log.info(
        "data.batch_size=auto: %d (%d per process x %d), estimated %s per process; the most that fits %s",
        chosen, chosen // n, n, memory.size(est.total), why,
    )  # fmt: skip
    return {"batch_size": chosen, "per_process": chosen // n, "estimate_bytes": est.total,
            "budget_bytes": budget, "limited_by": "training images" if capped else "memory"}  # fmt: skip


def probe_args(plan: TrainPlan, devices: Devices, probe: Any, per_process: int) -> tuple:
    """memory.estimate's arguments for this run's module `probe` at `per_process` images per process."""
    return probe, plan.optim["name"], per_process, devices.processes, devices.precision, devices.sharded, devices.device


def costs(plan: TrainPlan, devices: Devices, probe: Any) -> tuple[float, float, Any]:
    """(bytes per image per process, bytes that do not grow with the batch, the image size they are for: with a
    schedule of training sizes, the one whose images keep the most activations, which every batch must fit at)."""
    args = probe_args(plan, devices, probe, 1)
    schedule = training_schedule({**plan.data, **plan.views})  # data.train_img_sizes, NaFlex's lengths
    sizes = list(schedule.img_sizes) if schedule is not None else [None]
    est = max((memory.estimate(*args, px=px) for px in sizes), key=lambda e: e.activations)
    return est.activations, est.total - est.activations, est.px


def training_images(plan: TrainPlan, processes: int) -> int | None:
    """The training split's images, from a data module of the plan's settings set up for fit (its own lines are the
    run's to say, when the run's data module is set up)."""
    with _quiet("vitlab.data"):
        datamodule = build_datamodule(plan.data | {"batch_size": processes}, **plan.views)
        datamodule.setup("fit")
    train = getattr(datamodule, "train_set", None)
    return len(train) if train is not None and hasattr(train, "__len__") else None


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level, logger.level = logger.level, logging.WARNING
    try:
        yield
    finally:
        logger.setLevel(level)
