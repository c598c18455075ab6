"""The benchmark's settings (conf/benchmark.yaml `benchmark:`), validated; a test keeps the YAML and
these dataclasses equal."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vitlab.utils.errors import UserError
from vitlab.utils.kernels import SDPA_BACKENDS, compile_mode
from vitlab.utils.values import from_mapping

TASKS = ("models", "overhead", "pipeline", "end2end", "strategies")
# _ckpt: gradient checkpointing of every block; vitlab_ckpt<N>: of every N-th; vitlab_selective: selective; vitlab's
# step with one thing changed (models.STEP_VARIANTS): _cudnn attention on cuDNN's kernel, _unfused AdamW, _cudagraphs
# the forward and backward under CUDA graphs (compile mode reduce-overhead)
CONTENDERS = ("vitlab", "timm", "vitlab_ckpt", "timm_ckpt", "vitlab_ckpt<N>", "vitlab_selective", "vitlab_cudnn",
              "vitlab_unfused", "vitlab_cudagraphs")  # fmt: skip
MODES = ("train", "fwd_bwd", "infer")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMM_OPTIMIZERS = ("timm", "vitlab")


def _count(key: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"benchmark.{key} {value!r} must be an integer >= {low}")


@dataclass(frozen=True)
class OverheadConfig:
    epochs: int = 2  # timed epochs per run, after one warm-up epoch
    rounds: int = 8  # runs of each loop, alternating

    def __post_init__(self):
        _count("overhead.epochs", self.epochs, 1)
        _count("overhead.rounds", self.rounds, 1)


@dataclass(frozen=True)
class PipelineConfig:
    batches: int = 12  # timed batches per pass of a loader (with the warm-up: 15 of make_jpegs.py's 16 batches of 64)
    warmup_batches: int = 3  # untimed batches first (worker start-up, the first prefetch)
    rounds: int = 3  # passes of each loader, alternating
    shards: str | None = None  # the same training images packed by python -m vitlab.pack: adds a `streaming` loader
    # data.train_transform.auto_augment values: a `vitlab[<policy>]` loader each, the data config otherwise the same
    policies: tuple[str, ...] = ()
    # the same training images in other readers' formats, `<data=name>=<where>`: hf=<saved dataset>,
    # list=<train csv/jsonl>, wds=<brace pattern of train shards> (a loader each, the data config otherwise the same)
    readers: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "readers", tuple(self.readers or ()))
        _count("pipeline.batches", self.batches, 1)
        _count("pipeline.warmup_batches", self.warmup_batches, 0)
        _count("pipeline.rounds", self.rounds, 1)
        object.__setattr__(self, "policies", tuple(self.policies or ()))


@dataclass(frozen=True)
class EndToEndConfig:
    warmup_steps: int = 10  # untimed training steps (start-up, compilation, first batches)
    steps: int = 30  # timed training steps

    def __post_init__(self):
        _count("end2end.warmup_steps", self.warmup_steps, 1)
        _count("end2end.steps", self.steps, 1)


@dataclass(frozen=True)
class StrategiesConfig:
    names: tuple[str, ...] = ("ddp_cpu", "fsdp_cpu")  # trainer presets (conf/trainer/), each run in turn
    devices: int = 2  # processes per run
    warmup_steps: int = 5  # untimed training steps
    steps: int = 20  # timed training steps

    def __post_init__(self):
        _count("strategies.devices", self.devices, 1)
        _count("strategies.warmup_steps", self.warmup_steps, 1)
        _count("strategies.steps", self.steps, 1)
        if not self.names or len(set(self.names)) != len(self.names):
            raise UserError(f"benchmark.strategies.names {list(self.names)} must be distinct trainer presets")
        object.__setattr__(self, "names", tuple(self.names))


@dataclass(frozen=True)
class BenchmarkConfig:
    task: str = "models"
    contenders: tuple[str, ...] = ("vitlab", "timm")
    modes: tuple[str, ...] = ("train", "infer")
    batch_size: int = 64
    precision: str = "fp32"
    compile: bool | str = False  # or a torch.compile mode, as vitlab.train's compile
    sdpa_backend: str = "auto"  # attention's kernel, as vitlab.train's sdpa_backend
    device: str = "auto"
    warmup: int = 3
    repeats: int = 10
    steps: int = 1
    peak_matmul_size: int | None = None
    timm_optimizer: str = "timm"
    train_overrides: tuple[str, ...] = (
        "logger=csv",
        "progress_bar=none",
    )  # vitlab.train's, for overhead/pipeline/end2end
    overhead: OverheadConfig = field(default_factory=OverheadConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    end2end: EndToEndConfig = field(default_factory=EndToEndConfig)
    strategies: StrategiesConfig = field(default_factory=StrategiesConfig)

    def __post_init__(self):
        checked = (("task", TASKS), ("precision", PRECISIONS), ("timm_optimizer", TIMM_OPTIMIZERS),
                   ("sdpa_backend", SDPA_BACKENDS))  # fmt: skip
        for key, allowed in checked:
            if getattr(self, key) not in allowed:
                raise UserError(f"benchmark.{key} {getattr(self, key)!r} is not one of {list(allowed)}")
        for key, allowed in (("contenders", CONTENDERS), ("modes", MODES)):
            values = list(getattr(self, key))
            known = [v in allowed or (key == "contenders" and re.fullmatch(r"vitlab_ckpt[1-9]\d*", v)) for v in values]
            if not values or not all(known) or len(set(values)) != len(values):
                raise UserError(f"benchmark.{key} {values} must be distinct values from {list(allowed)}")
            object.__setattr__(self, key, tuple(values))
        for key in ("batch_size", "repeats", "steps"):
            _count(key, getattr(self, key), 1)
        _count("warmup", self.warmup, 0)
        compile_mode(self.compile)  # a bool or a mode name
        if self.peak_matmul_size is not None:
            _count("peak_matmul_size", self.peak_matmul_size, 1)
        object.__setattr__(self, "train_overrides", tuple(self.train_overrides))
        for key, cls in (
            ("overhead", OverheadConfig),
            ("pipeline", PipelineConfig),
            ("end2end", EndToEndConfig),
            ("strategies", StrategiesConfig),
        ):
            if isinstance(getattr(self, key), Mapping):
                object.__setattr__(self, key, from_mapping(cls, getattr(self, key), f"benchmark.{key}"))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> BenchmarkConfig:
        return from_mapping(cls, values, "benchmark")


def check_benchmark(cfg: Any) -> None:
    """`vitlab.benchmark`'s checks before any work (its entry point's): the benchmark group as BenchmarkConfig (ranges
    included), its device, and the model's geometry. `cfg`: the command's composed config."""
    from omegaconf import OmegaConf

    from vitlab.model.config import vit_config
    from vitlab.utils.cuda import check_device

    b = BenchmarkConfig.from_dict(OmegaConf.to_container(cfg.benchmark, resolve=True))
    check_device("benchmark.device", b.device, auto=True)
    vit_config(cfg.model)
