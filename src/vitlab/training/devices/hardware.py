"""The trainer settings a machine decides: `trainer.precision: auto` and `trainer.strategy: auto` resolved before
Lightning sees them, so the mission's command as typed (`python -m vitlab.train model=vit_b16 trainer.devices=4`)
trains as `trainer=ddp` does on a GPU machine: bf16 autocast where every GPU in use has bf16, one DDP process per
GPU. An explicit value always wins. The choice is logged in one line and taken into the run's plan (config.yaml
says it).
`trainer.precision=float8` (and float8-rowwise) is refused here, in one line, on a machine without float8 GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import OmegaConf

from vitlab.training.devices.float8_request import check_float8, is_float8
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

GPU_ACCELERATORS = ("auto", "gpu", "cuda")
LEGACY_PRECISIONS = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true", "64": "64-true"}  # Lightning's names


@dataclasses.dataclass(frozen=True)
class Devices:
    """What settled trainer settings run on, known before a Trainer is built (the plan's: data.batch_size=auto reads
    it): the CUDA GPUs in use (their indices; none on the CPU), the processes on a node and in all, the precision as
    Lightning names it (float8's: bf16-mixed around its Linears), and whether FSDP splits the weights."""

    gpus: tuple[int, ...]
    local: int
    processes: int
    precision: str
    sharded: bool

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @classmethod
    def of_trainer(cls, trainer: Any) -> Devices:
        """The Devices of a built Trainer (what a process of it runs on: its own GPU, or the host)."""
        from vitlab.training.devices.sharding import splits_weights

        root = trainer.strategy.root_device
        gpus = (root.index or 0,) if root.type == "cuda" else ()
        local = max(1, trainer.num_devices)
        return cls(gpus, local, local * max(1, trainer.num_nodes), str(trainer.precision), splits_weights(trainer))


def devices_of(t: Mapping[str, Any]) -> Devices:
    """The Devices of the settled trainer settings `t` (resolve_trainer's): Lightning's choice of devices, made here as
    resolve_trainer makes it, the FSDP2 strategy's split as FSDP2Strategy.shards decides it."""
    accelerator = str(t.get("accelerator", "auto"))
    count = len(cuda_devices()) if accelerator in GPU_ACCELERATORS else 0
    gpus = tuple(_in_use(t.get("devices", 1), list(range(count))))
    local = len(gpus) if gpus else _cpu_processes(t.get("devices", 1)) if accelerator in ("auto", "cpu") else 1
    processes = max(1, local) * int(t.get("num_nodes", 1) or 1)
    precision = str(t.get("precision", "32-true"))
    precision = "bf16-mixed" if is_float8(precision) else LEGACY_PRECISIONS.get(precision, precision)
    strategy = t.get("strategy")
    fsdp = isinstance(strategy, Mapping) and str(strategy.get("_target_", "")).endswith("FSDP2Strategy")
    sharded = fsdp and (processes > 1 or bool(strategy.get("cpu_offload")))
    return Devices(gpus, max(1, local), processes, precision, sharded)


def cuda_devices() -> list[tuple[str, bool]]:
    """(name, has bf16) of each visible CUDA GPU: bf16 from compute capability 8.0 on (Ampere)."""
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i) >= (8, 0))
        for i in range(torch.cuda.device_count())
    ]


def cuda_capabilities() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of each visible CUDA GPU."""
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())
    ]


def _in_use(devices: Any, gpus: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The GPUs `trainer.devices` picks: a count (the first ones; -1 or 'auto': all), a list of indices, or a
    comma-separated string of them."""
    if devices in (-1, "-1", "auto", None):
        return gpus
    try:
        if isinstance(devices, str):
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
        if isinstance(devices, int):
            return gpus[:devices]
        return [gpus[int(i)] for i in devices if 0 <= int(i) < len(gpus)]
    except (TypeError, ValueError):
        return []  # not a device request: the trainer's own check names it


def resolve_trainer(t: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The trainer settings `t` with `precision: auto` and `strategy: auto` resolved (a new dict), and the line that
    says what will run: the devices, how many processes and with which strategy, the precision (and why, where it was
    auto)."""
    precision, strategy = str(t.get("precision", "32-true")), t.get("strategy", "auto")
    accelerator = str(t.get("accelerator", "auto"))
    gpus = [cuda_devices()[i] for i in devices_of(t).gpus]
    why = ""
    if is_float8(precision):  # (Lightning's bf16-mixed plus float8 Linears: built in training.run.build)
        check_float8(precision, _in_use(t.get("devices", 1), cuda_capabilities()) if gpus else [])
    if precision == "auto":
        if gpus and all(bf16 for _, bf16 in gpus):
            precision, why = "bf16-mixed", "every GPU in use has bf16"
        elif gpus:
            old = sorted({name for name, bf16 in gpus if not bf16})
            precision, why = "32-true", f"{', '.join(old)} has no bf16 (compute capability < 8.0)"
        else:
            precision, why = "32-true", "no GPU in use"
    processes = devices_of(t).processes
    if strategy == "auto" and processes > 1:
        strategy = "ddp"  # Lightning's choice, made here: one process per device, the command re-run
    t = {**t, "precision": precision} | ({"strategy": strategy} if "strategy" in t or strategy != "auto" else {})
    name = strategy.get("_target_", "").rsplit(".", 1)[-1] if isinstance(strategy, Mapping) else strategy
    many = f", {processes} process{'es' if processes > 1 else ''} ({name})" if processes > 1 or name != "auto" else ""
    if gpus:
        where = f"{len(gpus)} CUDA GPU(s) ({', '.join(sorted({n for n, _ in gpus}))}){many}"
    else:
        where = ("CPU" if accelerator in ("auto", "cpu") else accelerator) + many
    return t, f"trainer: {where}, precision {precision}" + (f" (auto: {why})" if why else "")


def _cpu_processes(devices: Any) -> int:
    """The CPU processes `trainer.devices` asks for (Lightning's CPU accelerator: 'auto' and -1 are one)."""
    try:
        return (
            len(devices) if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices) else max(1, int(devices))
        )
    except (TypeError, ValueError):
        return 1  # not a device request: the trainer's own check names it


def use_sdpa_backend(name: str) -> None:
    """`sdpa_backend`: the kernel torch's scaled_dot_product_attention runs for the whole process, `auto` leaving
    torch's own choice (flash attention on an H100 for ViT shapes); flash, efficient (memory-efficient) or cudnn the
    only fused kernel allowed, with the math kernel left as the fallback for what it cannot serve (the CPU, a mask
    the kernel lacks); math alone."""
    if name == "auto":
        return
    switches = {
        "flash": torch.backends.cuda.enable_flash_sdp,
        "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
        "cudnn": torch.backends.cuda.enable_cudnn_sdp,
        "math": torch.backends.cuda.enable_math_sdp,
    }
    if name not in switches:
        raise UserError(f"sdpa_backend {name!r} is not one of {['auto', *switches]}")
    for backend, enable in switches.items():
        enable(backend in (name, "math"))
