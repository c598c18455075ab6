"""benchmark.task=models: vitlab's ViT and timm's VisionTransformer of the same config and weights, in
one process, on one fixed synthetic batch. Each mode (`train`: forward, backward, AdamW step;
`fwd_bwd`: no optimizer; `infer`: forward under inference_mode) is warmed up, then timed over `repeats`
rounds that interleave the contenders (order alternating per round, so drift hits both alike). Reports
medians, vitlab/timm throughput ratios (of the medians, and the spread of the per-round ratios),
analytic FLOPs, achieved FLOP/s, MFU against a large matmul timed on the same device in the same dtype,
and peak memory. Contenders `vitlab_ckpt` / `timm_ckpt` turn on gradient checkpointing of every block,
`vitlab_ckpt<N>` of every N-th block, `vitlab_selective` selective checkpointing (model.grad_checkpointing).
`vitlab_cudnn`, `vitlab_unfused` and `vitlab_cudagraphs` are vitlab's step with one thing changed (STEP_VARIANTS), each
timed in the same rounds as the step it changes: what each is worth."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.benchmark.config import PRECISIONS, BenchmarkConfig
from vitlab.benchmark.measure import MB, peak_matmul_flops, step_peak_bytes, summarise, tensor_bytes, time_once
from vitlab.convert.timm_args import create_timm_model
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT, ViTConfig
from vitlab.model.vit import recompute_region
from vitlab.training.devices.hardware import use_sdpa_backend
from vitlab.training.optim import OptimConfig, make_optimizer
from vitlab.utils.kernels import compile_mode


class Contender:
    """One model with its optimizer; `step` runs one step of a mode on a fixed batch."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, autocast):
        self.name, self.model, self.optimizer, self.autocast = name, model, optimizer, autocast

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return F.cross_entropy(self.model(x), y)

    def step(self, mode: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if mode == "infer":
            with torch.inference_mode(), self.autocast():
                self.model(x)
            return
        self.loss(x, y).backward()
        if mode == "train":
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self, mode: str) -> int:
        """What lives between steps: weights and buffers, plus AdamW's moments when training."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if mode != "infer":
            tensors += [t for s in self.optimizer.state.values() for t in s.values()]
        return tensor_bytes(tensors)


def timm_optimizer(model: nn.Module, optim: OptimConfig, which: str) -> torch.optim.Optimizer:
    """`timm`: what timm's own train.py builds (create_optimizer_v2 from the model: optim.name, no decay on norms
    and biases, PyTorch's default implementation for the device). `vitlab`: exactly vitlab's optimizer."""
    if which == "vitlab":
        return make_optimizer(model, optim)
    from timm.optim import create_optimizer_v2

    o = optim
    given = {k: v for k, v in (("betas", o.betas), ("eps", o.eps)) if v is not None}
    return create_optimizer_v2(model, o.name, lr=o.lr, weight_decay=o.weight_decay, **given)


# vitlab's step with one thing changed: attention on cuDNN's kernel alone (on a GPU; a CPU has its own kernels), AdamW
# without its fused kernel (torch's foreach one), the compiled forward and backward replayed as CUDA graphs.
STEP_VARIANTS = ("vitlab_cudnn", "vitlab_unfused", "vitlab_cudagraphs")


def sdpa_kernel_of(name: str, device: torch.device):
    """The attention kernels a contender's steps may use (all of torch's but for vitlab_cudnn on a GPU)."""
    if name != "vitlab_cudnn" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def build_contenders(cfg: ViTConfig, b: BenchmarkConfig, optim: OptimConfig, device: torch.device) -> list[Contender]:
    """The contenders of `b.contenders`, all starting from the same weights (vitlab's init, ported)."""
    base = ViT(cfg)
    dtype = PRECISIONS[b.precision]

    def autocast(name: str = ""):
        @contextlib.contextmanager
        def both():
            precision = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
            with precision, sdpa_kernel_of(name, device):  # (compile traces under it: its graph keeps that kernel)
                yield

        return both

    out = []
    for name in b.contenders:
        if name.startswith("vitlab"):
            model = copy.deepcopy(base).to(device)
            unfused = dataclasses.replace(optim, fused=False) if name == "vitlab_unfused" else optim
            optimizer = make_optimizer(model, unfused)
        else:
            model = create_timm_model(cfg)
            model.load_state_dict(check_state_dict(base.state_dict(), cfg))
            model = model.to(device)
            optimizer = timm_optimizer(model, optim, b.timm_optimizer)
        model.set_grad_checkpointing(checkpointing(name))
        mode = "reduce-overhead" if name == "vitlab_cudagraphs" else compile_mode(b.compile)
        if mode:  # in place, as vitlab.train's compile does: the model, or each block
            for region in model.blocks if b.compile == "regional" else [model]:
                region.compile(mode=mode)
                if b.compile == "regional" and name.startswith("vitlab"):
                    recompute_region(region).compile(mode=mode)
        out.append(Contender(name, model, optimizer, autocast(name)))
    return out


def checkpointing(contender: str) -> bool | int | str:
    """A contender's gradient checkpointing (model.grad_checkpointing's value): `_ckpt` every block, `_ckpt<N>` every
    N-th, `_selective` selective, none otherwise."""
    _, _, mode = contender.partition("_")
    if mode == "selective":
        return "selective"
    return (int(mode[4:]) if mode[4:] else True) if mode.startswith("ckpt") else False


def bench_models(cfg: ViTConfig, b: BenchmarkConfig, optim: OptimConfig, device: torch.device) -> dict[str, Any]:
    use_sdpa_backend(b.sdpa_backend)
    torch.manual_seed(0)
    contenders = build_contenders(cfg, b, optim, device)
    x = torch.randn(b.batch_size, cfg.in_chans, *cfg.img_hw, device=device)
    y = torch.randint(0, max(cfg.num_classes, 1), (b.batch_size,), device=device)
    batch_bytes = tensor_bytes([x, y])
    flops_fwd = cfg.flops_per_image()
    peak = peak_matmul_flops(device, PRECISIONS[b.precision], b.peak_matmul_size)  # and again at the end
    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, Any]] = {}
    for mode in b.modes:
        for c in contenders:
            c.model.train(mode != "infer")
            for _ in range(b.warmup):
                c.step(mode, x, y)
        times: dict[str, list[float]] = {c.name: [] for c in contenders}
        for r in range(b.repeats):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                times[c.name].append(time_once(functools.partial(c.step, mode, x, y), device, b.steps))
        flops = flops_fwd * (1 if mode == "infer" else 3)  # backward ~ 2x forward
        results[mode] = {}
        for c in contenders:
            row = summarise(times[c.name])
            row["images_per_s"] = b.batch_size / (row["median_ms"] / 1e3)
            row["achieved_flops_per_s"] = flops * row["images_per_s"]
            row["mfu"] = row["achieved_flops_per_s"] / peak["flops_per_s"]
            state = c.state_bytes(mode) + batch_bytes
            step = step_peak_bytes(functools.partial(c.step, mode, x, y), device)
            row.update(state_memory_mb=state / MB, step_memory_mb=step / MB, peak_memory_mb=(state + step) / MB)
            results[mode][c.name] = row
        first = contenders[0].name
        ratios[mode] = {}
        for c in contenders[1:]:
            ours, theirs = results[mode][first], results[mode][c.name]
            paired = [o / f for f, o in zip(times[first], times[c.name], strict=True)]
            ratios[mode][f"{first}/{c.name}"] = {
                "throughput": theirs["median_ms"] / ours["median_ms"],
                "throughput_paired_min": min(paired),
                "throughput_paired_max": max(paired),
                "peak_memory": ours["peak_memory_mb"] / theirs["peak_memory_mb"],
                "step_memory": ours["step_memory_mb"] / max(theirs["step_memory_mb"], 1e-9),
            }
    again = peak_matmul_flops(device, PRECISIONS[b.precision], b.peak_matmul_size)
    if again["flops_per_s"] > peak["flops_per_s"]:
        peak = again
        for rows in results.values():
            for row in rows.values():
                row["mfu"] = row["achieved_flops_per_s"] / peak["flops_per_s"]
    return {
        "flops": {
            "forward_per_image": flops_fwd,
            "forward_gflops_per_image": flops_fwd / 1e9,
            "train_gflops_per_image": 3 * flops_fwd / 1e9,
        },
        "peak": peak,
        "results": results,
        "ratios": ratios,
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    b, peak = report["benchmark"], report["peak"]
    table = Table(
        title=f"{report['model']} batch {b['batch_size']} {b['precision']}{' compiled' if b['compile'] else ''} on "
        f"{report['environment'].get('gpu', report['environment']['device'])}: "
        f"{report['flops']['forward_gflops_per_image']:.3f} GFLOPs/img forward, peak {peak['flops_per_s'] / 1e12:.3f} "
        f"TFLOP/s ({peak['dtype']} {peak['size']}^3 matmul)"
    )
    for col in ("mode", "model", "median ms", "img/s", "TFLOP/s", "MFU", "peak MB", "step MB", "ratio"):
        table.add_column(col, justify="right" if col not in ("mode", "model") else "left")
    for mode, rows in report["results"].items():
        first = next(iter(rows))
        for name, r in rows.items():
            ratio = report["ratios"][mode].get(f"{first}/{name}")
            shown = ""
            if ratio:
                low, high = ratio["throughput_paired_min"], ratio["throughput_paired_max"]
                shown = f"{ratio['throughput']:.3f} [{low:.3f}, {high:.3f}]"
            table.add_row(
                mode,
                name,
                f"{r['median_ms']:.2f}",
                f"{r['images_per_s']:.1f}",
                f"{r['achieved_flops_per_s'] / 1e12:.3f}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['peak_memory_mb']:.0f}",
                f"{r['step_memory_mb']:.0f}",
                shown,
            )
    console.print(table)
    console.print(
        f"ratio: {first}'s throughput over each other's (of the medians) [min, max of the per-round ratios]",
        markup=False,
    )
