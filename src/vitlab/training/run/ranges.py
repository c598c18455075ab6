"""The ranges vitlab holds Lightning's Trainer and the data modules' batch size to, declared without importing either
(the commands check them before torch and Lightning are imported: a bad value is refused at once), and checked again
with the rest of the node against its target (vitlab.cli.node_checks)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

from annotated_types import Ge, Interval

from vitlab.utils.arguments import Fraction, NonNegativeInt, NonNegativeNumber, PositiveInt
from vitlab.utils.cuda import cuda_available
from vitlab.utils.errors import UserError


class TrainerValues(TypedDict):
    """Lightning's Trainer arguments with the ranges its documentation gives and its constructor leaves unchecked
    (accumulate_grad_batches=0 divides by zero in estimated_stepping_batches, log_every_n_steps=0 at the first
    logging step, once a run directory and processes exist) or checks in a sentence of its own; the types are
    Lightning's (precision: node_checks.TrainerRanges, which needs Lightning's import). Checked before torch and
    Lightning are imported (cli/schemas.py), and with the rest against Lightning's Trainer (cli/node_checks.py)."""

    num_nodes: PositiveInt
    fast_dev_run: bool | NonNegativeInt
    max_epochs: Annotated[int, Ge(-1)] | None  # -1: no limit
    min_epochs: NonNegativeInt | None
    max_steps: Annotated[int, Ge(-1)]  # -1: no limit
    min_steps: NonNegativeInt | None
    limit_train_batches: NonNegativeInt | Fraction | None  # a count of batches, or a fraction of them
    limit_val_batches: NonNegativeInt | Fraction | None
    limit_test_batches: NonNegativeInt | Fraction | None
    limit_predict_batches: NonNegativeInt | Fraction | None
    overfit_batches: NonNegativeInt | Fraction
    val_check_interval: PositiveInt | Annotated[float, Interval(gt=0, le=1)] | str | dict[str, int] | None
    check_val_every_n_epoch: PositiveInt | None
    num_sanity_val_steps: Annotated[int, Ge(-1)] | None  # -1: every validation batch
    log_every_n_steps: PositiveInt | None
    accumulate_grad_batches: PositiveInt
    gradient_clip_val: NonNegativeNumber | None
    gradient_clip_algorithm: Literal["value", "norm", "agc"] | None  # agc: training.callbacks.health
    reload_dataloaders_every_n_epochs: NonNegativeInt


class DataRanges(TypedDict):
    batch_size: PositiveInt | Literal["auto"]  # auto: vitlab.train chooses it (training.run.auto_batch)


def check_devices(t: Any) -> None:
    """Several devices with accelerator=auto on a machine without a GPU would start that many CPU processes, each
    as slow as the machine is small: say so, and how to ask for CPU processes on purpose. (Before torch is imported
    where the machine has no GPU's device files: utils.cuda.no_cuda_here.)"""
    devices, accelerator = t.get("devices", 1), t.get("accelerator", "auto")
    if isinstance(devices, bool) or (isinstance(devices, int) and devices < -1 or devices == 0):
        raise UserError(
            f"trainer.devices={devices} must be a number of devices >= 1, -1 (every GPU), auto, or a list of GPU "
            "indices"
        )
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda_available())
    if devices in (-1, "-1") and on_cpu:
        raise UserError(
            "trainer.devices=-1 means every GPU, and this run is on the CPU (no GPU here, or trainer.accelerator=cpu): "
            "give a number of CPU processes (trainer=ddp_cpu trainer.devices=2), or trainer.devices=1"
        )
    many = (isinstance(devices, int) and devices > 1) or (not isinstance(devices, (int, str)) and len(devices) > 1)
    if accelerator == "auto" and many and not cuda_available():
        raise UserError(
            f"trainer.devices={devices} asks for {devices} devices and this machine has no GPU: that would train in "
            f"{devices} CPU processes; ask for them with trainer=ddp_cpu trainer.devices={devices}, or train on the "
            "CPU in one process with trainer.devices=1"
        )
