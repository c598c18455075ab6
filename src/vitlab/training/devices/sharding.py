"""Sharded training (`trainer=fsdp`, `trainer=fsdp_cpu`): PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) under
Lightning's ModelParallelStrategy. Each transformer block (the encoder's and, for MAE, the decoder's) is its own
FSDP unit and the network the training step calls is the root: every parameter is a DTensor split on dim 0 across
the data-parallel processes, gathered for a block's forward and backward and freed after, its gradient
reduce-scattered; each process keeps 1/world of the parameters, gradients and optimizer state (ZeRO-3).

Checkpoints are one file by default (gathered on rank 0 and written through the Trainer's CheckpointIO plugin, so
atomically, and readable by every vitlab tool as a DDP checkpoint is), or with `save_distributed_checkpoint=true` a
directory of shards (torch.distributed.checkpoint) written beside the target and renamed into place; vitlab.export
format=ckpt consolidates one into a file. The optimizer state of every checkpoint names its parameters
(`param_names` in each group, training.optim.name_parameters), and is loaded by those names, whatever strategy and
group order wrote it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from vitlab.convert.weights import numbered_optimizer_state
from vitlab.model import ViT, ViTConfig
from vitlab.model.blocks import Block
from vitlab.model.init import init_weights_by_module
from vitlab.training.devices.full_state import load_full_state
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with the mesh vitlab trains on (every process data-parallel:
    data_parallel_size = nodes x devices, no tensor parallelism; Lightning's default would make it (dp=1, tp=all)
    and feed every process the same batches) and FSDP2's options:

    - reshard_after_forward: free a block's gathered parameters after its forward (gather again for backward),
      ZeRO-3; false keeps them until backward (ZeRO-2 style: more memory, one gather less);
    - param_dtype / reduce_dtype: FSDP2's MixedPrecisionPolicy; `auto` gathers and computes in bf16 where the
      Trainer's precision is bf16 (bf16-mixed on a bf16 GPU), else fp32; gradients reduce in fp32;
    - cpu_offload: parameters, gradients and optimizer state live in host memory between uses (GPU only);
    - save_distributed_checkpoint: a directory of shards instead of one gathered file.
    """

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        reshard_after_forward: bool = True,
        param_dtype: str = "auto",
        reduce_dtype: str = "float32",
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = False,
        **kwargs: Any,
    ):
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in (*DTYPES, "auto"):
                raise UserError(f"trainer.strategy.{key} {value!r} is not one of {['auto', *DTYPES]}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    # ---- sharding ------------------------------------------------------------------------------------------
    def policy(self) -> dict[str, Any]:
        """fully_shard's keyword arguments for this run (mesh excepted)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        param = self.param_dtype
        if param == "auto":
            bf16 = str(self.precision_plugin.precision) in BF16_PRECISIONS and self.root_device.type == "cuda"
            param = "bfloat16" if bf16 else "float32"
        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if param != "float32" or self.reduce_dtype != "float32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=DTYPES[param], reduce_dtype=DTYPES[self.reduce_dtype], output_dtype=torch.float32
            )
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs

    def shard(self, root: nn.Module) -> bool:
        """Shard `root` (the network a training step calls) over the data-parallel processes: each Block inside it,
        then the root itself (what is left: embeddings, tokens, norms, head); a ViT laid out on the meta device
        (networks_on_meta) is then materialised, each process initialising its own shards. Once: Lightning calls
        configure_model again on every fit and test. Returns whether a network was materialised."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(root, FSDPModule):
            return False
        if not self.shards:  # one process: FSDP's gathers, casts and hooks would be paid for nothing
            return materialize(root, self.parameter_device)
        mesh, kwargs = self.device_mesh["data_parallel"], self.policy()
        for module in root.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh, **kwargs)
        fully_shard(root, mesh=mesh, **kwargs)
        return materialize(root, self.parameter_device)

    def shard_module(self, module: Any) -> bool:
        """A ViTModule's networks sharded: the one its steps call (`shard`) and each one they call beside it
        (`shard_beside`: a distillation's teachers and heads). The student's forward_features and forward_head gather
        as its forward does only where the objective calls them itself (`calls_features`): our ViT's forward calls
        forward_features, which would run the root's hooks twice a step. Returns whether a network was materialised."""
        from torch.distributed.fsdp import FSDPModule

        network = module.objective.network(module.model)
        fresh = not isinstance(network, FSDPModule)
        made = self.shard(network)
        if fresh and self.shards and module.objective.calls_features:
            _gathers_in_methods(network)
        for network in module.objective.networks_beside():
            self.shard_beside(network)
        return made

    def shard_beside(self, network: nn.Module) -> None:
        """A network the steps call beside the student split as the student is, each block of its `blocks` and
        then the rest: a distillation's teacher (ours or timm's, frozen: each process holds 1/N of it and gathers a
        block at a time for its forward, with no gradient or optimizer state) or a projection head (trained: its
        optimizer steps on shards as the student's does; a plain tensor beside DTensors stops fused AdamW). Once,
        as shard."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(network, FSDPModule) or not self.shards:
            return
        mesh, kwargs = self.device_mesh["data_parallel"], self.policy()
        for block in getattr(network, "blocks", ()):
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(network, mesh=mesh, **kwargs)
        _gathers_in_methods(network)

    @property
    def shards(self) -> bool:
        """Whether the network is split at all: across several processes, or (one process) to wait in host memory
        under cpu_offload. One process without it trains the network whole, as DDP on one device does: a gather
        before each block's forward and backward and a reduce-scatter after would copy every parameter and gradient
        to itself (B/16 on one H100, batch 64: 82.5 ms a step sharded, 41.0 under DDP; check_request says so)."""
        return self.num_nodes * self.num_processes > 1 or self.cpu_offload

    @property
    def parameter_device(self) -> torch.device:
        """Where the parameters live between uses: the host under cpu_offload (FSDP2 copies each block's shards to
        the GPU to gather them, and the optimizer steps on the host), else the training device."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def model_to_device(self) -> None:
        """Lightning moves the whole model to the training device; under cpu_offload only the buffers and the metrics'
        states go (the parameters stay in host memory: moving them is refused, "Couldn't swap Conv2d.weight", H100
        2026-11-26; a metric left on the host refuses the GPU's loss, "Encountered different devices", 2026-11-27)."""
        from torchmetrics import Metric

        if not self.cpu_offload:
            return super().model_to_device()
        for module in self.model.modules():
            if isinstance(module, Metric):  # (its states are attributes that Metric._apply moves, not buffers)
                module.to(self.root_device)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.root_device)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state (rank 0; empty elsewhere) in the form a one-process optimizer writes: states
        numbered in group order, each group with its `param_names` (Lightning would renumber them in the module's
        parameter order); a directory checkpoint keeps torch's sharded form, keyed by name."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        full = not self._save_distributed_checkpoint
        state = get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=True)
        )
        if not full or self.global_rank != 0:
            return state
        return numbered_optimizer_state(state)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        load_full_state(self.model, self.optimizers, checkpoint, strict=self.lightning_module.strict_loading)
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # A directory of shards: written beside the target, then renamed into place by rank 0, so a crash mid-save
        # never leaves a half-written checkpoint where a good one was.
        target = Path(self.broadcast(str(filepath)))
        # named as every atomic write's temporary (utils.atomic): a killed save's is removed on the next start
        temporary = target.with_name(f".{target.name}.tmp-{self.broadcast(os.getpid())}")
        super().save_checkpoint(checkpoint, temporary, storage_options)
        self.barrier("sharded_checkpoint_written")
        if self.global_rank == 0:
            replace_directory(temporary, target)
        self.barrier("sharded_checkpoint_renamed")


def _gathers_in_methods(network: nn.Module) -> None:
    """The sharded root `network`'s forward_features and forward_head gather its parameters as its forward does:
    FSDP2 hooks forward alone, and a feature or token distillation calls these (the student's in its steps, the
    teacher's in every step), which met the root's shards otherwise ("got mixed torch.Tensor and DTensor")."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for method in ("forward_features", "forward_head"):
        if hasattr(network, method):
            register_fsdp_forward_method(network, method)


# ---- a ViT built on the meta device, materialised per shard -----------------------------------------------------
# Built whole on every process, a ViT-g/14 (1.0B parameters) is 4 GB of fp32 per process before it is sharded. Under
# networks_on_meta (trainer=fsdp without pretrained weights: build.build_module) the ViT is laid out on the meta
# device, sharded, then each process initialises its shards: every tensor is drawn whole on the host, one module at a
# time, in the order and from the generator state of a host build (init.init_weights_by_module), and the process keeps
# its slice. The same seed gives the same weights as a host-built model, whatever the number of processes, and only
# the largest single tensor (a block's MLP weight) is ever whole in memory. (DTensor's own random ops would draw each
# shard from an offset of one stream: the values would depend on the sharding, and differ from a host build's.)
_ON_META: ContextVar[bool] = ContextVar("networks_on_meta", default=False)


@contextlib.contextmanager
def networks_on_meta(enabled: bool = True) -> Iterator[None]:
    """Within: new_vit lays the ViT out on the meta device, for shard() to materialise."""
    token = _ON_META.set(enabled)
    try:
        yield
    finally:
        _ON_META.reset(token)


def new_vit(cfg: ViTConfig) -> ViT:
    """The ViT a ViTModule trains: built on the host, or under networks_on_meta on the meta device, keeping the
    generator's state for materialize() and leaving the generator where a host build leaves it (its draws are made
    one module at a time and dropped), so whatever is built after it (an MAE decoder) draws the same values."""
    if not _ON_META.get():
        return ViT(cfg)
    state = torch.get_rng_state()
    model = ViT(cfg, device="meta")
    init_weights_by_module(model, lambda module, whole: None)
    model.deferred_init_rng = state
    return model


def materialize(root: nn.Module, device: torch.device) -> bool:
    """Each ViT in `root` still on the meta device allocated on `device` (its shards, once sharded) and initialised
    as a host build from the same seed would be. Returns whether there was one."""
    vits = [m for m in root.modules() if getattr(m, "deferred_init_rng", None) is not None]
    for vit in vits:
        vit.to_empty(device=device)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(vit.deferred_init_rng)
            init_weights_by_module(vit, keep_shard)
        vit.deferred_init_rng = None
    return bool(vits)


@torch.no_grad()
def keep_shard(module: nn.Module, whole: nn.Module) -> None:
    """Copy the whole tensors of `whole` into `module`'s: each sharded parameter (a DTensor) takes this process's
    slice, anything else all of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    pairs = [(module._parameters, whole._parameters), (module._buffers, whole._buffers)]
    for mine, theirs in pairs:
        for name, value in theirs.items():
            target = mine[name]
            if target is None:
                continue
            if isinstance(target, DTensor):  # every process drew the same whole tensor: no communication
                value = distribute_tensor(
                    value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
                )
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)


def requests_fsdp(trainer: Mapping[str, Any]) -> bool:
    """Whether the trainer config asks for this strategy (trainer=fsdp, fsdp_cpu)."""
    strategy = trainer.get("strategy")
    return isinstance(strategy, Mapping) and str(strategy.get("_target_", "")).endswith("FSDP2Strategy")


def check_request(trainer: Mapping[str, Any], callbacks: Mapping[str, Any] | None) -> str | None:
    """A sharded run's trainer and callbacks config, checked before any process starts: a one-line UserError for
    what cannot shard; the line to log when it runs on one process (nothing to shard across; CPU offload is what
    helps there)."""
    if not requests_fsdp(trainer):
        return None
    strategy = trainer["strategy"]
    devices, nodes = trainer.get("devices", 1), int(trainer.get("num_nodes", 1) or 1)
    processes = nodes * (devices if isinstance(devices, int) and devices > 0 else len(devices or []) or 1)
    size = strategy.get("data_parallel_size", "auto")
    if size not in ("auto", processes):
        raise UserError(
            f"trainer.strategy.data_parallel_size {size} must be auto or the number of processes, {processes} "
            f"(trainer.devices x trainer.num_nodes): FSDP shards over every process"
        )
    if strategy.get("cpu_offload") and trainer.get("accelerator") == "cpu":
        raise UserError("trainer.strategy.cpu_offload=true moves GPU memory to the host; a CPU run has none to move")
    for name, node in (callbacks or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, Mapping) else ""
        if target.endswith(UNSHARDABLE):
            raise UserError(
                f"callbacks.{name} reads the whole network on every process, which trainer=fsdp does not hold: "
                "leave it out and evaluate the checkpoints with vitlab.eval (task=knn|linear|fewshot), or train "
                "with trainer=ddp"
            )
        if target.endswith(".EMA") and strategy.get("save_distributed_checkpoint"):
            raise UserError(
                f"callbacks.{name} keeps a second set of weights that a directory of shards does not hold yet: "
                "with it, leave trainer.strategy.save_distributed_checkpoint=false (one file)"
            )
    if processes == 1 and not strategy.get("cpu_offload"):
        return (
            "trainer=fsdp on one process: the network trains unsharded, as under DDP (trainer.devices=N shards over "
            "N); with trainer.strategy.cpu_offload=true the weights, gradients and optimizer state wait in host memory"
        )
    if processes == 1:
        return (
            "trainer=fsdp on one process with cpu_offload: the weights, gradients and optimizer state wait in host "
            "memory between uses"
        )
    return None


# Callbacks that read the whole network in every process (feature extraction of the representation probes).
UNSHARDABLE = ("RepresentationProbe",)


def replace_directory(new: Path, target: Path) -> None:
    """Put directory `new` where `target` is (a file, a directory or nothing), never leaving neither."""
    old = target.with_name(f".{target.name}.old")
    if target.exists() or target.is_symlink():
        os.replace(target, old) if target.is_dir() and not target.is_symlink() else target.unlink()
    os.replace(new, target)
    if old.exists():
        shutil.rmtree(old)


def is_sharded(trainer: L.Trainer | None) -> bool:
    """Whether the run trains under FSDP2Strategy (its checkpoint and averaging paths), split or not."""
    return trainer is not None and isinstance(trainer.strategy, FSDP2Strategy)


def splits_weights(trainer: L.Trainer | None) -> bool:
    """Whether the run's weights are split into shards (FSDP2Strategy.shards): what its memory estimate counts."""
    return is_sharded(trainer) and trainer.strategy.shards
