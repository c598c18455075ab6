"""compile=regional (training.objectives.objective.Objective.compile): each transformer block a training step runs is
compiled in place and every block of one class shares one compiled graph, so the graphs (and the compile time) do not
grow with depth, for each objective; with inductor the logits and gradients are eager's."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.configs import tiny
from vitlab.training.module import ViTModule

MAE = {"name": "mae", "decoder_embed_dim": 16, "decoder_depth": 2, "decoder_num_heads": 2}


@pytest.fixture
def eager_backend(monkeypatch):
    """Dynamo captures the graphs as with inductor, but runs them eagerly (no code generated: fast)."""
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compile_(self, backend="eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs_of_a_step(depth: int, objective: dict | None, compile) -> int:
    """The graphs Dynamo captured for a training step (forward and backward) and an evaluation forward."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny(depth=depth, global_pool="avg", fc_norm=True, num_classes=0 if objective else 7, drop_path_rate=0.1)
    module = ViTModule(model=model.to_dict(), objective=objective, compile=compile)
    module.objective.setup_fit(model.num_classes)
    module.objective.compile(module.model, module.compile_mode, module.compile_regional)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    module.train()
    module.loss(x, y)[0].backward()
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("objective, graphs", [(None, 2), (MAE, 3)], ids=["classify", "mae"])
def test_regional_compile_makes_one_graph_per_block_kind_at_any_depth(eager_backend, objective, graphs):
    """Stochastic depth on (every block its own rate, an input of the graph): the encoder's first block (rate 0, no
    stochastic depth) and the others; MAE's (narrower) decoder blocks besides. The same at depth 2 and 6; compile=true's
    whole-model graph is one, but holds every block (its compile time grows with depth)."""
    assert graphs_of_a_step(2, objective, "regional") == graphs_of_a_step(6, objective, "regional") == graphs


def test_regional_compile_compiles_every_block_the_step_runs_and_keeps_the_keys(eager_backend, compose_cfg):
    from tests.training.objectives.test_dino import dino_cfg
    from vitlab.cli.plans import train_plan
    from vitlab.training.run import build

    cfg = dino_cfg(compose_cfg, "compile=regional")
    plan = train_plan(cfg)
    module = build.build_module(plan, build.fit_datamodule(plan))
    module.objective.compile(module.model, module.compile_mode, module.compile_regional)
    blocks = [*module.model.blocks, *module.objective.student.backbone.blocks]
    assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)  # teacher and student
    classify = ViTModule(model=tiny().to_dict(), compile="regional")
    classify.objective.compile(classify.model, classify.compile_mode, classify.compile_regional)
    assert classify.model._compiled_call_impl is None  # the blocks alone, not the whole model
    assert all(b._compiled_call_impl is not None for b in classify.model.blocks)
    assert set(classify.state_dict()) == set(ViTModule(model=tiny().to_dict()).state_dict())


@pytest.mark.parametrize("kind", ["logits", "tokens"])
def test_a_distillations_teacher_is_compiled_with_the_student(eager_backend, kind):
    """compile=true and objective=distill (issue 76, point 4): each block of the teacher (timm's model here) compiled
    in place beside the student, and the step's loss the eager one's (Dynamo's graphs run eagerly here)."""
    torch.manual_seed(0)
    options = {"name": "distill", "kind": kind, "teacher": "vit_tiny_patch16_224", "teacher_pretrained": False}
    if kind == "tokens":
        options["distill_weight"] = 1.0
    model = tiny(num_classes=7).to_dict()
    eager, compiled = (ViTModule(model=model, objective=options, compile=c) for c in (False, True))
    compiled.load_state_dict(eager.state_dict())
    for module in (eager, compiled):
        module.objective.setup_fit(7)
        module.objective.fit_start(_Data(), torch.device("cpu"))
    compiled.objective.teacher_networks()[0].load_state_dict(eager.objective.teacher_networks()[0].state_dict())
    compiled.objective.compile(compiled.model, compiled.compile_mode, compiled.compile_regional)
    blocks = compiled.objective.teacher_networks()[0].blocks
    assert all(b._compiled_call_impl is not None for b in blocks)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    losses = [m.loss(x, y)[0] for m in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)


class _Data:
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def test_regional_compile_with_inductor_gives_eagers_logits_and_gradients():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = ViTModule(model=tiny(depth=3).to_dict())
    compiled = ViTModule(model=tiny(depth=3).to_dict(), compile="regional")
    compiled.load_state_dict(eager.state_dict())
    compiled.objective.compile(compiled.model, compiled.compile_mode, compiled.compile_regional)
    x = torch.randn(4, 3, 32, 32)
    outs = [m.model(x) for m in (eager, compiled)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    for out in outs:
        out.square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch._dynamo.reset()


def test_compiling_says_so_in_the_log(eager_backend, caplog):
    """torch.compile works silently for tens of seconds on the first steps: the run says what it compiles (issue 53)."""
    import logging
    from types import SimpleNamespace

    module = ViTModule(model=tiny().to_dict(), compile="regional")
    module._trainer = SimpleNamespace(is_global_zero=True)  # what setup reads of its Trainer
    with caplog.at_level(logging.INFO, logger="vitlab.train"):
        module.setup("fit")
    assert "compile=regional: torch.compile compiles each transformer block (one code for all)" in caplog.text
