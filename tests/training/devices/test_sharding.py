"""vitlab.training.devices.sharding (and full_state, what it loads with): the request checks made before any process
starts, the optimizer state's two forms (one process's, numbered in group order with names; torch's, keyed by name),
the directory swap that puts a sharded checkpoint in place, and (on two gloo processes) a ViT built on the meta device
and initialised per shard, a whole state dict loaded into it and one missing a tensor refused."""

import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.configs import tiny
from vitlab.convert.weights import numbered_optimizer_state
from vitlab.model import ViT
from vitlab.training.devices.full_state import keyed_by_name
from vitlab.training.devices.sharding import FSDP2Strategy, check_request, replace_directory
from vitlab.training.optim import name_parameters, param_groups, states_by_name
from vitlab.utils.errors import UserError


def _trainer(compose_cfg, *overrides):
    cfg = compose_cfg("train", ["trainer=fsdp_cpu", *overrides])
    return cfg.trainer, cfg.get("callbacks")


def test_two_processes_shard_without_a_word(compose_cfg):
    assert check_request(*_trainer(compose_cfg)) is None
    assert check_request(*_trainer(compose_cfg, "trainer=ddp_cpu")) is None  # not sharded: nothing to check


def test_one_process_runs_and_says_it_trains_unsharded(compose_cfg):
    said = check_request(*_trainer(compose_cfg, "trainer.devices=1"))
    assert said.startswith("trainer=fsdp on one process: the network trains unsharded, as under DDP")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.strategy.data_parallel_size=3"], "data_parallel_size 3 must be auto or the number of processes, 2"),
        (["trainer.strategy.cpu_offload=true"], "cpu_offload=true moves GPU memory to the host; a CPU run has none"),
        (["callbacks=representation"], "callbacks.representation reads the whole network on every process"),
    ],
)
def test_what_cannot_shard_is_one_line(compose_cfg, overrides, message):
    with pytest.raises(UserError, match=message):
        check_request(*_trainer(compose_cfg, *overrides))


def test_cpu_offload_keeps_the_parameters_on_the_host_and_moves_only_the_buffers():
    """Under cpu_offload the parameters are made and kept on the host (FSDP2 copies them to the GPU per use; moving
    them with the model fails on a GPU, 'Couldn't swap Conv2d.weight'); the buffers and the metrics' states go to the
    training device ('meta' here stands for the GPU: a metric left on the host refused the GPU's loss on an H100).
    Without offload Lightning moves the whole model."""
    from torchmetrics import MeanMetric

    for offload, params, buffers in ((True, "cpu", "meta"), (False, "meta", "meta")):
        strategy = FSDP2Strategy(cpu_offload=offload)
        strategy.parallel_devices = [torch.device("meta")]
        strategy.model = module = torch.nn.ModuleDict({"model": ViT(tiny(depth=2, drop_path_rate=0.1))})
        module["loss"] = MeanMetric()
        assert strategy.parameter_device.type == ("cpu" if offload else "meta")
        strategy.model_to_device()
        assert {p.device.type for p in module.parameters()} == {params}
        assert {b.device.type for b in module.buffers()} == {buffers}
        assert module["loss"].mean_value.device.type == "meta" and module["loss"].device.type == "meta"


def _optimizer(order):
    model = ViT(tiny(depth=2))
    groups = param_groups(model, 1e-3, 0.05, layer_decay=0.75)
    optimizer = torch.optim.AdamW([{k: v for k, v in groups[i].items() if k != "names"} for i in order])
    name_parameters(optimizer, {id(p): f"model.{n}" for n, p in model.named_parameters()})
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return optimizer


def test_the_two_forms_of_an_optimizer_state_name_the_same_moments():
    optimizer = _optimizer(range(6))
    numbered = optimizer.state_dict()
    by_name = keyed_by_name(numbered, optimizer)  # what set_optimizer_state_dict takes under FSDP
    assert set(by_name["state"]) == set(states_by_name(numbered))
    assert [g["params"] for g in by_name["param_groups"]] == [g["param_names"] for g in numbered["param_groups"]]
    back = numbered_optimizer_state(by_name)  # what an FSDP checkpoint holds: the one-process form
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in numbered["param_groups"]]
    for name, state in states_by_name(back).items():
        assert torch.equal(state["exp_avg"], states_by_name(numbered)[name]["exp_avg"])
    # written before groups carried names: numbered in this optimizer's own group order
    unnamed = {
        **numbered,
        "param_groups": [{k: v for k, v in g.items() if k != "param_names"} for g in numbered["param_groups"]],
    }
    assert keyed_by_name(unnamed, optimizer)["state"].keys() == by_name["state"].keys()


def test_a_sharded_checkpoint_replaces_the_old_one_whole(tmp_path):
    target, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.1.tmp"
    target.write_bytes(b"a one-file checkpoint")
    new.mkdir()
    (new / ".metadata").write_text("shards")
    replace_directory(new, target)
    assert (target / ".metadata").read_text() == "shards" and not new.exists()
    newer = tmp_path / ".last.ckpt.2.tmp"
    newer.mkdir()
    (newer / ".metadata").write_text("newer")
    replace_directory(newer, target)
    assert (target / ".metadata").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_every_preset_composes(compose_cfg):
    for preset in ("fsdp", "fsdp_cpu"):
        strategy = OmegaConf.to_container(compose_cfg("train", [f"trainer={preset}"]).trainer.strategy)
        assert strategy["_target_"] == "vitlab.training.devices.sharding.FSDP2Strategy"


# ---- a ViT built on the meta device, materialised per shard (issue 40) ------------------------------------------
META_CONFIGS = [
    dict(reg_tokens=1, init_values=1e-5, fix_init=True, embed_dim=36, num_heads=3),  # rows split unevenly: 108 / 2
    dict(block_fn="res_post", attn_layer="diff", init_values=1e-5, class_token=False, global_pool="avg"),
    dict(block_fn="parallel_scaling", qkv_bias=False, pos_embed="sincos2d", global_pool="map", class_token=False),
]


def _materialise_sharded(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` gloo processes: each META_CONFIGS ViT from seed 0 on the meta device, sharded as trainer=fsdp
    shards it, materialised; rank 0 saves the gathered weights, its local shapes, and the generator's next draws."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vitlab.training.devices.sharding import materialize, networks_on_meta, new_vit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh, results = init_device_mesh("cpu", (world,)), []
    for overrides in META_CONFIGS:
        torch.manual_seed(0)
        with networks_on_meta():
            model = new_vit(tiny(**overrides))
        after = torch.rand(4)  # what is built next (an MAE decoder) draws as after a host build
        assert all(p.is_meta for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(rank + 1)  # materialising does not depend on the generator's state by then
        assert materialize(model, torch.device("cpu")) and not materialize(model, torch.device("cpu"))
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        local = {k: list(v.to_local().shape) for k, v in model.state_dict().items() if isinstance(v, DTensor)}
        results.append({"state": state, "local": local, "after": after, "refused": _refused_without(model, state)})
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _refused_without(model: torch.nn.Module, state: dict) -> str:
    """What loading the whole `state` less its first tensor into the sharded `model` (as a run's module holds it,
    under model.) says: torch's full-state load alone would keep the model's own value for it without a word."""
    from vitlab.training.devices.full_state import load_full_module_state

    holder = torch.nn.Module()
    holder.model = model
    full = {f"model.{k}": v for k, v in state.items()}
    load_full_module_state(holder, full)  # (whole: loads)
    try:
        load_full_module_state(holder, dict(list(full.items())[1:]))
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_vit_built_on_meta_is_initialised_per_shard_as_on_the_host(tmp_path):
    """trainer=fsdp's build: on 2 CPU processes, the ViT laid out on the meta device, sharded and materialised holds
    the weights a host build from the same seed draws (every tensor, bit for bit), each process only its half; a
    whole state dict loads back into it, and one missing a tensor is refused."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawned, not forked: a fork of a pytest worker whose earlier tests ran torch's OpenMP pool hangs in its first
    # parallel op (libgomp's threads are not carried over; CI's make test stopped there)
    mp.start_processes(_materialise_sharded, args=(2, port, str(tmp_path / "out.pt")), nprocs=2, start_method="spawn")
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    for overrides, got in zip(META_CONFIGS, results, strict=True):
        torch.manual_seed(0)
        host = ViT(tiny(**overrides))
        torch.testing.assert_close(got["state"], host.state_dict(), atol=0, rtol=0)
        torch.testing.assert_close(got["after"], torch.rand(4), atol=0, rtol=0)
        w = (
            host.blocks[0].mlp_out_proj.weight
            if hasattr(host.blocks[0], "mlp_out_proj")
            else host.blocks[0].mlp.fc2.weight
        )
        key = "blocks.0.mlp_out_proj.weight" if hasattr(host.blocks[0], "mlp_out_proj") else "blocks.0.mlp.fc2.weight"
        assert got["local"][key] == [math.ceil(w.shape[0] / 2), w.shape[1]]  # this process's half
        assert f"missing keys ['model.{next(iter(host.state_dict()))}']" in got["refused"]  # a tensor missing


CHECKPOINTING = [False, True, 2, "selective", "regional compile"]


def _checkpointed_gradients(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` gloo processes: a ViT (stochastic depth and dropout on) sharded as trainer=fsdp shards it, each
    CHECKPOINTING mode's gradients of this process's batch (the last: no checkpointing, compile=regional's blocks,
    compiled before sharding as ViTModule.setup does, with Dynamo's eager backend); rank 0 saves the gathered
    gradients per mode and the graphs Dynamo captured."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh, grads = init_device_mesh("cpu", (world,)), {}
    for mode in CHECKPOINTING:
        torch.manual_seed(0)
        regional = mode == "regional compile"
        model = ViT(tiny(depth=4, drop_path_rate=0.2, proj_drop_rate=0.1, grad_checkpointing=not regional and mode))
        if regional:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            for block in model.blocks:
                block.compile(backend="eager")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(10 + rank)  # each process its own images and dropout draws, the same for every mode
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        grads[str(mode)] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(10 + rank)
    model = ViT(tiny(depth=8, drop_path_rate=0.2, proj_drop_rate=0.1))  # twice as deep: the same graphs
    for block in model.blocks:
        block.compile(backend="eager")
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    grads["graphs"] = [*graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


def test_every_checkpointing_mode_and_regional_compile_compose_with_fsdp2_and_give_the_same_gradients(tmp_path):
    """model.grad_checkpointing (every block, every 2nd, selective) inside FSDP2's block units, as trainer=fsdp runs
    them on 2 CPU processes: the recomputation gathers the block's shards again and the gradients, reduce-scattered,
    are those of no checkpointing (≤ 1e-6). compile=regional's blocks, sharded: the same gradients, from the same
    three graphs at depth 4 and 8."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_checkpointed_gradients, args=(2, port, str(tmp_path / "g.pt")), nprocs=2, start_method="spawn")
    grads = torch.load(tmp_path / "g.pt", weights_only=True)
    assert grads.pop("graphs") == [3, 3]  # block 0 (no stochastic depth), the others, the last one's class rows
    for mode in CHECKPOINTING[1:]:
        for name, g in grads[str(mode)].items():
            torch.testing.assert_close(g, grads["False"][name], atol=1e-6, rtol=1e-5, msg=f"{mode} {name}")
