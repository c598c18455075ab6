"""The learning rate scaled by the global batch (timm's, DeiT's and MAE's rule, `optim.lr_base`): the global batch a
run's settings make (data.batch_size over every process, a schedule's average, gradient accumulation), and the
optimiser settings with the learning rate it gives, decided when a run is planned (vitlab.cli.plans) or when
data.batch_size=auto chose its batch (run/auto_batch.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from vitlab.training.optim import OptimConfig

log = logging.getLogger(__name__)


def scaled_lr(o: OptimConfig, batch_size: int) -> float:
    """The learning rate of `o` for a global batch of `batch_size` (o.global_batch when set): lr_base * (batch /
    lr_base_size), or its square root with lr_base_scale=sqrt (timm's train.py); `o.lr` when lr_base is not set."""
    if o.lr_base is None:
        return o.lr
    ratio = (o.global_batch or batch_size) / o.lr_base_size
    return o.lr_base * (math.sqrt(ratio) if o.lr_base_scale == "sqrt" else ratio)


def scaled_optim(optim: Mapping[str, Any], data: Mapping[str, Any], trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The optimiser settings `optim` with optim.lr_base set: optim.lr becomes lr_base scaled by the global batch
    (timm's, DeiT's and MAE's rule), the batch being data.batch_size (already global: per device x devices x nodes) x
    trainer.accumulate_grad_batches. Both are logged and kept in the settings, so config.yaml and the checkpoints
    say which learning rate ran. Without lr_base, `optim` as it is."""
    given = OptimConfig.from_dict(dict(optim))
    if given.lr_base is None:
        return dict(optim)
    batch, how = global_batch(data, trainer)
    lr = scaled_lr(given, batch)
    log.info(
        "optim.lr %.4g: optim.lr_base %g x %s(global batch %d / optim.lr_base_size %d); global batch %s",
        lr,
        given.lr_base,
        "sqrt" if given.lr_base_scale == "sqrt" else "",
        given.global_batch or batch,
        given.lr_base_size,
        f"{given.global_batch} (optim.global_batch)" if given.global_batch else how,
    )
    return {**optim, "lr": lr, "global_batch": given.global_batch or batch}


def global_batch(data: Mapping[str, Any], trainer: Mapping[str, Any]) -> tuple[int, str]:
    """The images per optimizer step over every process (MAE's eff_batch_size), and how it was counted."""
    t = trainer or {}
    accumulate, devices, nodes = t.get("accumulate_grad_batches", 1) or 1, t.get("devices", 1), t.get("num_nodes", 1)
    batch, how = data["batch_size"], f"= data.batch_size {data['batch_size']}"
    from vitlab.data.sizes import SizeSchedule  # (torch's: reading a config needs none)

    schedule = SizeSchedule.from_data(data)
    if schedule is not None and schedule.batch_sizes:  # as timm's train.py: the schedule's average batch
        average = schedule.average_batch(batch, t.get("max_epochs"))
        batch, how = round(average), f"= {average:.2f}, data.train_batch_sizes averaged over their schedule,"
    elif isinstance(devices, int) and devices > 0 and isinstance(nodes, int) and nodes > 0:
        per = data["batch_size"] / (devices * nodes)
        how += f" ({per:g} per device x {devices} devices x {nodes} nodes)"
    batch *= accumulate
    return batch, how + f" x trainer.accumulate_grad_batches {accumulate}"
