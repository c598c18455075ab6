"""How much memory a training process needs, estimated before it starts (vitlab.train logs it; the README's table of
which model fits how many GPUs under DDP and FSDP comes from it):

- weights, gradients and optimizer state: counted from the module and the optimizer (fp32 master weights; the
  optimizer's state per parameter found by stepping it once on a small tensor: AdamW 2, SGD with momentum 1, ...);
  under DDP every process holds all of them, plus DDP's gradient buckets (one more copy of the gradients); under
  FSDP each holds 1/world, plus the units gathered in flight: the root's own parameters (embeddings, norms, head)
  and two blocks (the one computing and the one prefetched), and their unsharded gradients;
- activations: what autograd saves for backward, per image, dominated by the blocks: (8 + 2 x mlp_ratio) x width
  values per token per block, more with LayerScale, SwiGLU and RoPE (model/cost.py: activation_values; measured on
  this CPU with saved-tensor hooks), 4 bytes each in fp32; under bf16 autocast 4.5 bytes on a CPU (measured: CPU
  autocast keeps some tensors in both precisions) and 2.2 on a GPU (from the H100's measured peak: ViT-B/16, batch
  256, bf16, 16.7 GB; experiments/throughput); with gradient checkpointing a block keeps only its input (one value
  per token per width), and one block is recomputed at a time. MAE's encoder sees its kept patches only and its
  decoder all of them (Objective.activation_shapes).

Left out: the allocator's fragmentation and caching, CUDA's context (~0.5 GB), temporary buffers inside a kernel,
the data loader. tests/training/devices/test_memory.py checks the activation term against autograd's saved tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vitlab.model.blocks import Block

if TYPE_CHECKING:
    from vitlab.training.devices.hardware import Devices

# Bytes per saved activation value, by the Trainer's precision, on a CPU (measured:
# tests/training/devices/test_memory.py) and on a GPU (half-precision autocast: from the H100's measured peak,
# experiments/throughput).
ACTIVATION_BYTES = {
    "cpu": {"32-true": 4.0, "64-true": 8.0, "bf16-mixed": 4.5, "16-mixed": 4.5, "bf16-true": 2.0},
    "cuda": {"32-true": 4.0, "64-true": 8.0, "bf16-mixed": 2.2, "16-mixed": 2.2, "bf16-true": 2.0},
}
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per process."""

    weights: float
    gradients: float
    optimizer: float
    in_flight: float  # DDP's gradient buckets, or FSDP's gathered units and their gradients
    activations: float
    batch: int  # images per process
    strategy: str  # e.g. "ddp over 4 processes", "fsdp over 8 processes"
    px: int | None = None  # the batch's image size, where data.train_img_sizes trains at several
    notes: tuple[str, ...] = ()  # start-up lines on what the settings cost (checkpointing_note)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.in_flight + self.activations

    def line(self) -> str:
        extra = "DDP's gradient buckets" if self.strategy.startswith("ddp") else "gathered blocks"
        parts = [
            f"weights {size(self.weights)}",
            f"gradients {size(self.gradients)}",
            f"optimizer state {size(self.optimizer)}",
            *([f"{extra} {size(self.in_flight)}"] if self.in_flight else []),
            f"activations {size(self.activations)} ({self.batch} images{f' of {self.px} px' if self.px else ''})",
        ]
        return f"memory per process, estimated for {self.strategy}: {', '.join(parts)}: {size(self.total)}"


def size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def budget(devices: Devices) -> tuple[float, str]:
    """The bytes one process on `devices` may use, and whose they are: the smallest of its GPUs' (each process has one),
    or this host's (the smaller of its memory and its cgroup's limit) shared by the processes it runs."""
    if devices.gpus:
        i = min(devices.gpus, key=lambda i: torch.cuda.get_device_properties(i).total_memory)
        return torch.cuda.get_device_properties(i).total_memory, f"{torch.cuda.get_device_name(i)}'s"
    return _host_share(devices.local)


def _host_share(local: int) -> tuple[float, str]:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        host = min(host, int(limit.read_text()))
    local = max(1, local)  # the processes on this host
    return host / local, "this host's" + (f" (shared by {local} processes)" if local > 1 else "")


def check_fits(est: Estimate, devices: Devices, checkpointing: bool | int | str) -> None:
    """A run estimated to need more memory per process than there is: refused in one line (`refusal`)."""
    from vitlab.utils.errors import UserError

    if said := refusal(est, devices, checkpointing):
        raise UserError(said)


def refusal(est: Estimate, devices: Devices, checkpointing: bool | int | str) -> str | None:
    """The one line that refuses a run estimated to need more memory per process than `devices` have, naming the
    estimate, the memory, and the settings that bring it down (those not set already); None where it fits.
    `memory_check=false` starts it anyway."""
    have, whose = budget(devices)
    if est.total <= have:
        return None
    fixes = [
        "data.batch_size",
        *(["model.grad_checkpointing=true"] if checkpointing is not True else []),
        *(["trainer=fsdp (over several devices)"] if not est.strategy.startswith("fsdp") else []),
        *(["trainer.precision=bf16-mixed"] if devices.precision in ("32-true", "64-true") else []),
    ]
    return (
        f"the run needs about {size(est.total)} per process (activations {size(est.activations)} for {est.batch} "
        f"images, {est.strategy}), more than {whose} {size(have)}: bring it down with {', '.join(fixes)}; "
        "or start anyway with memory_check=false"
    )


def checkpointing_note(checkpointing: bool | int | str, compiled: bool) -> str | None:
    """The start-up line of an eager run with selective checkpointing: what it costs and what to use instead."""
    if checkpointing != "selective" or compiled:
        return None
    return (
        "model.grad_checkpointing=selective without compile: torch's selective policy sends every op of every block "
        "through Python twice (2.1x the step of no checkpointing on the CPU benchmark, 2.3x on ViT-L/16 on an H100; "
        "experiments/checkpointing); compile=true or compile=regional compiles it (1.0x), or eager "
        "model.grad_checkpointing=N (every N-th block) saves memory at less cost"
    )


@functools.cache
def optimizer_states(name: str) -> float:
    """Values of optimizer state per trainable parameter value (AdamW 2, SGD with momentum 1, Lion 1, ...): timm's
    optimizer `name` stepped once on a small tensor."""
    from timm.optim import create_optimizer_v2

    p = nn.Parameter(torch.zeros(64, 64))
    p.grad = torch.ones_like(p)
    optimizer = create_optimizer_v2([p], name, lr=1e-3)
    optimizer.step()
    values = sum(v.numel() for v in optimizer.state[p].values() if torch.is_tensor(v) and v.ndim)
    return values / p.numel()


def activation_bytes(precision: str, device: str = "cpu") -> float:
    """Bytes per saved activation value under the Trainer's `precision` on `device` (cpu, cuda)."""
    return ACTIVATION_BYTES["cuda" if device == "cuda" else "cpu"].get(str(precision), 4.0)


def activations_per_image(
    shapes: list[tuple[int, int, int, float]], precision: str, checkpointing: bool | int | str, device: str = "cpu"
) -> float:
    """Bytes autograd keeps per image for blocks of (tokens, width, blocks, values per token and width), under
    model.grad_checkpointing: none; every block (true) or every N-th (each such block's fp32 input, the others whole);
    selective (each block's matmul and attention outputs, 6 + mlp_ratio values, and its input). Rows of 8 or more
    values are transformer blocks (8 + 2 x mlp_ratio); the rest (the image, heads, a class-row last block) are kept
    whole. The block being recomputed lives in the backward pass (`recomputed`)."""
    per_value = activation_bytes(precision, device)
    if not checkpointing:
        return sum(tokens * width * values * n * per_value for tokens, width, n, values in shapes)
    if checkpointing == 1:  # every block (true, 1): every row's input only
        return sum(tokens * width * 4 * n for tokens, width, n, _ in shapes) + recomputed(shapes, precision, device)
    total = 0.0
    for tokens, width, n, values in shapes:
        whole, inputs = tokens * width * values * per_value, tokens * width * 4
        if values < 8:
            total += n * whole
        elif checkpointing == "selective":
            total += n * (tokens * width * (6 + (values - 8) / 2) * per_value + inputs)
        else:
            saved = n // checkpointing
            total += saved * inputs + (n - saved) * whole
    return total + recomputed(shapes, precision, device)


def recomputed(shapes: list[tuple[int, int, int, float]], precision: str, device: str = "cpu") -> float:
    """Bytes per image of the one block that gradient checkpointing recomputes at a time, in the backward pass."""
    return max(tokens * width * values for tokens, width, _, values in shapes) * activation_bytes(precision, device)


def for_run(module: Any, devices: Devices, optimizer: str, batch: int, schedule: Any = None) -> Estimate:
    """The estimate for a run of `module` on `devices` (hardware.Devices: its processes, precision and strategy), the
    global `batch` (data.batch_size) split over the processes; with a `schedule` of training sizes (data/sizes.py) its
    batch of the most activations, each size with its own batch size."""
    processes = devices.processes
    args = (optimizer, processes, devices.precision, devices.sharded, devices.device)
    note = checkpointing_note(module.model.cfg.grad_checkpointing, bool(getattr(module, "compile_mode", None)))
    if schedule is None:
        est = estimate(module, args[0], max(1, batch // processes), *args[1:])
        return dataclasses.replace(est, notes=(note,) if note else ())
    per_size = zip(schedule.img_sizes, schedule.global_batch_sizes(batch), strict=True)
    est = max(
        (estimate(module, args[0], max(1, b // processes), *args[1:], px=px) for px, b in per_size),
        key=lambda e: e.activations,
    )
    return dataclasses.replace(est, notes=(note,) if note else ())


def estimate(
    module: Any,
    optimizer: str,
    batch: int,
    processes: int,
    precision: str,
    sharded: bool,
    device: str = "cpu",
    px: int | None = None,
) -> Estimate:
    """The memory of one process training `module` (a ViTModule) with `optimizer` (timm's name) on `batch` images
    per process (of `px` pixels a side; None: the model's size), over `processes` processes, sharded (FSDP) or not
    (DDP, or one process), on `device` (cpu, cuda)."""
    params = [p for name, p in module.named_parameters() if name.startswith(module.network_prefixes)]
    total = sum(p.numel() for p in params) * 4
    trainable = sum(p.numel() for p in params if p.requires_grad) * 4
    states = trainable * optimizer_states(optimizer)
    cfg = module.model.cfg if px is None else dataclasses.replace(module.model.cfg, img_size=px)
    shapes = module.objective.activation_shapes(cfg)
    activations = batch * activations_per_image(shapes, precision, cfg.grad_checkpointing, device)
    if not sharded:
        in_flight = trainable if processes > 1 else 0
        kind = f"ddp over {processes} processes" if processes > 1 else "one process"
        return Estimate(total, trainable, states, in_flight, activations, batch, kind, px)
    blocks = [b for b in module.modules() if isinstance(b, Block)]
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0) * 4
    root = total - sum(sum(p.numel() for p in b.parameters()) * 4 for b in blocks)
    gathered = root + 2 * block  # weights gathered whole (fp32 here; bf16 halves it) and their gradients
    kind = f"fsdp over {processes} processes"
    return Estimate(
        total / processes, trainable / processes, states / processes, 2 * gathered, activations, batch, kind, px
    )
