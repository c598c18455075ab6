"""vitlab.training.devices.memory: the estimate's activation term against what autograd really keeps (saved-tensor
hooks, each storage counted once, parameters left out), its state terms against the tensors, and its split by
strategy."""

import pytest
import torch

from tests.helpers.configs import tiny
from vitlab.training.devices import memory
from vitlab.training.devices.hardware import Devices
from vitlab.training.module import ViTModule


def saved_bytes(module: ViTModule, x: torch.Tensor, autocast: bool = False) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=autocast):
        module.loss(x, torch.zeros(len(x), dtype=torch.long))
    return sum(seen.values())


@pytest.mark.parametrize(
    "model, objective, precision",
    [
        (dict(), {}, "32-true"),
        (dict(global_pool="avg", fc_norm=True), {}, "32-true"),  # every block whole: no class-row shortcut
        (dict(mlp_ratio=48 / 11, embed_dim=44, num_heads=4), {}, "32-true"),  # giant's MLP ratio
        (dict(), {}, "bf16-mixed"),
        (dict(grad_checkpointing=True, depth=6), {}, "32-true"),
        (  # MAE's proportions: a quarter of 256 patches in the encoder, a narrower decoder on all of them
            dict(num_classes=0, img_size=64, patch_size=4, embed_dim=96, depth=6),
            {"name": "mae", "decoder_embed_dim": 64, "decoder_depth": 4, "decoder_num_heads": 4},
            "32-true",
        ),
        # the RoPE files' blocks (conf/model: DINOv3, EVA02, RoPE-Mixed): LayerScale, SwiGLU and RoPE keep more
        (
            dict(
                rope="dinov3",
                rope_rotate_half=True,
                init_values=1e-5,
                attn_layer="eva",
                block_fn="eva",
                reg_tokens=4,
                pos_embed="none",
                global_pool="avg",
                fc_norm=False,
            ),
            {},
            "32-true",
        ),  # fmt: skip
        (
            dict(rope="axial", mlp_layer="swiglu_packed", act_layer="silu", mlp_hidden_dim=170, global_pool="avg"),
            {},
            "32-true",
        ),  # fmt: skip
        (
            dict(
                rope="mixed",
                init_values=1e-5,
                block_fn="eva",
                pos_embed="none",
                num_classes=0,
                img_size=64,
                patch_size=4,
                embed_dim=96,
                depth=6,
            ),
            {"name": "mae", "decoder_embed_dim": 64, "decoder_depth": 4, "decoder_num_heads": 4},
            "32-true",
        ),  # fmt: skip
    ],
)
def test_the_activation_estimate_is_what_autograd_keeps(model, objective, precision):
    """Within 15% at batch 4 (what it leaves out: the head, the loss, norms' statistics)."""
    module = ViTModule(model=tiny(**{"depth": 4, "embed_dim": 64, **model}).to_dict(), objective=objective or None)
    module.train()
    x = torch.randn(4, 3, *module.model.cfg.img_hw)
    measured = saved_bytes(module, x, autocast=precision == "bf16-mixed")
    shapes, checkpointing = module.objective.activation_shapes(module.model.cfg), module.model.cfg.grad_checkpointing
    estimated = 4 * memory.activations_per_image(shapes, precision, checkpointing)
    if checkpointing:  # the forward pass keeps each block's input; the recomputed block lives in the backward pass
        estimated -= 4 * memory.recomputed(shapes, precision)
    assert estimated == pytest.approx(measured, rel=0.15), (measured, estimated)


def test_a_schedule_of_sizes_is_estimated_at_its_batch_of_the_most_activations():
    """data.train_img_sizes: each size's estimate is what autograd keeps at that size (15%, as above), and the run's
    is the size whose batch keeps the most: 16 images of 32 px (65 tokens) against 48 of 16 px (17 tokens)."""
    from vitlab.data.sizes import SizeSchedule

    module = ViTModule(model=tiny(depth=4, embed_dim=64, img_size=16, dynamic_img_size=True).to_dict())
    module.train()
    for px in (16, 32):
        measured = saved_bytes(module, torch.randn(4, 3, px, px))
        at = memory.estimate(module, "adamw", batch=4, processes=1, precision="32-true", sharded=False, px=px)
        assert at.activations == pytest.approx(measured, rel=0.15), (px, measured, at.activations)
    devices = Devices(gpus=(), local=2, processes=2, precision="32-true", sharded=False)
    schedule = SizeSchedule.from_keys([16, 32], [96, 32], None, "constant", 0.65, 0.1)
    run = memory.for_run(module, devices, "adamw", 64, schedule)
    large = memory.estimate(module, "adamw", batch=16, processes=2, precision="32-true", sharded=False, px=32)
    small = memory.estimate(module, "adamw", batch=48, processes=2, precision="32-true", sharded=False, px=16)
    assert run == large and large.activations > small.activations and "(16 images of 32 px)" in run.line()
    assert memory.for_run(module, devices, "adamw", 64).px is None


@pytest.mark.parametrize("mode", [False, True, 2, 3, "selective"])
@pytest.mark.parametrize("pool", ["avg", "token"])
def test_each_checkpointing_mode_peaks_where_the_estimate_says(mode, pool):
    """The peak of a forward and backward pass (the profiler's allocation events, benchmark.measure: live tensor
    bytes, the same on a loaded machine) against the estimate's activations for each model.grad_checkpointing mode,
    at 257 tokens so the activations dwarf the weights (the peak also holds the weights' gradients). Measured (estimate
    / peak): avg pooling 0.89-1.08; a class token 0.92-1.23, its last block (class rows only) counted whole where N
    or selective recompute it."""
    from vitlab.benchmark.measure import step_peak_bytes

    extra = dict(global_pool="avg", fc_norm=True) if pool == "avg" else {}
    cfg = tiny(depth=6, embed_dim=32, num_heads=2, img_size=64, patch_size=4, grad_checkpointing=mode, **extra)
    module = ViTModule(model=cfg.to_dict())
    x, y = torch.randn(8, 3, 64, 64), torch.zeros(8, dtype=torch.long)

    def step():
        module.loss(x, y)[0].backward()
        module.zero_grad(set_to_none=True)

    step()
    peak = step_peak_bytes(step, torch.device("cpu"))
    estimate = 8 * memory.activations_per_image(module.objective.activation_shapes(cfg), "32-true", mode)
    assert 0.85 < estimate / peak < 1.3, (estimate, peak)


def test_the_states_are_counted_from_the_tensors_and_fsdp_divides_them():
    module = ViTModule(model=tiny(depth=4).to_dict())
    n = sum(p.numel() for p in module.model.parameters())
    ddp = memory.estimate(module, "adamw", batch=8, processes=4, precision="32-true", sharded=False)
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.in_flight) == (4 * n, 4 * n, 8 * n, 4 * n)
    fsdp = memory.estimate(module, "adamw", batch=8, processes=4, precision="32-true", sharded=True)
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (n, n, 2 * n)
    block = sum(p.numel() for p in module.model.blocks[0].parameters())
    assert fsdp.in_flight == 2 * 4 * ((n - 4 * block) + 2 * block)  # root + two blocks, weights and gradients
    assert fsdp.activations == ddp.activations  # the same images per process
    assert fsdp.line().startswith("memory per process, estimated for fsdp over 4 processes: weights 0.1 MB, gradients")


@pytest.mark.parametrize("name, states", [("adamw", 2), ("sgd", 1), ("lion", 1), ("lamb", 2)])
def test_the_optimizer_state_per_parameter_is_found_by_stepping_it(name, states):
    assert memory.optimizer_states(name) == states


def test_a_run_that_does_not_fit_is_refused_with_the_settings_not_yet_used():
    """check_fits against this host's memory: a small run passes; one of 10 TB per process names the estimate, the
    memory, and only the settings that would bring it down and are not set already."""
    from vitlab.utils.errors import UserError

    devices = Devices(gpus=(), local=2, processes=2, precision="bf16-mixed", sharded=True)
    have, whose = memory.budget(devices)
    assert 0 < have and whose == "this host's (shared by 2 processes)"
    small = memory.Estimate(1e6, 1e6, 2e6, 0, 1e7, 8, "ddp over 2 processes")
    memory.check_fits(small, devices, checkpointing=False)
    big = memory.Estimate(1e12, 1e12, 2e12, 0, 6e12, 8, "fsdp over 2 processes")
    with pytest.raises(UserError) as e:
        memory.check_fits(big, devices, checkpointing=True)
    assert str(e.value) == (
        f"the run needs about 10000.0 GB per process (activations 6000.0 GB for 8 images, fsdp over 2 processes), "
        f"more than this host's (shared by 2 processes) {memory.size(have)}: bring it down with data.batch_size; or "
        "start anyway with memory_check=false"
    )


def test_eager_selective_checkpointing_says_its_cost_and_what_to_use_instead():
    """The note rides with the run's estimate (vitlab.train logs it after the memory line): eager selective only."""
    from vitlab.training.devices.memory import checkpointing_note

    devices = Devices(gpus=(), local=1, processes=1, precision="32-true", sharded=False)
    for compile_mode, said in ((False, 1), ("regional", 0)):
        module = ViTModule(model=tiny(depth=2, grad_checkpointing="selective").to_dict(), compile=compile_mode)
        notes = memory.for_run(module, devices, "adamw", 8).notes
        assert len(notes) == said and all(n.startswith("model.grad_checkpointing=selective without") for n in notes)
    assert memory.for_run(ViTModule(model=tiny(depth=2).to_dict()), devices, "adamw", 8).notes == ()

    note = checkpointing_note("selective", compiled=False)
    assert note.startswith("model.grad_checkpointing=selective without compile: torch's selective policy")
    assert "compile=true or compile=regional compiles it" in note and "model.grad_checkpointing=N" in note
    assert [checkpointing_note(m, c) for m, c in [("selective", True), (True, False), (2, False), (False, False)]] == [
        None
    ] * 4
