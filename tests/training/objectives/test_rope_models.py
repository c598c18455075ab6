"""Every objective on the RoPE model files (conf/model: DINOv3, EVA02, RoPE-Mixed), shrunk to depth 2 and 32 wide on
16 px digits, through vitlab.train's own build (data module, ViTModule, Lightning): classify (and vitlab.eval's every
task on its checkpoint), distill (a teacher of the same family, that checkpoint), MAE (the encoder on its kept patches,
the RoPE table's rows of those patches) and DINO, whose local crops are 2x2 patches: RoPE's table must be that grid's,
not the global views'."""

import lightning as L
import pytest
import torch

from vitlab.cli.plans import train_plan
from vitlab.training.run import build

# One file of each family: shrunk, vit_b16_dinov3 and eva02_s14 are these (tests/test_conf.py composes and builds them,
# tests/convert/test_timm.py holds every file to the config timm builds for its name)
ROPE_MODELS = ["vit_s16_dinov3", "eva02_ti14", "vit_b16_rope_mixed"]
TINY = ["model.depth=2", "model.embed_dim=32", "model.num_heads=2", "model.img_size=16", "model.patch_size=4",
        "data.batch_size=8", "progress_bar=none"]  # fmt: skip


def tiny(model: str) -> list[str]:
    swiglu = ["model.mlp_hidden_dim=170"] if model.startswith("eva02") else []  # 2 x int(32 x 8/3): timm's packed fc1
    return [f"model={model}", *TINY, *swiglu]


def fit(cfg, path=None, steps=1):
    """`steps` training steps of vitlab.train's module and data on the CPU: the module, and the RoPE tables its ViTs
    made (their shapes: the grids they were computed for)."""
    plan = train_plan(cfg)
    torch.manual_seed(0)
    dm = build.fit_datamodule(plan)
    module = build.build_module(plan, dm)
    tables = []
    for vit in {id(m): m for m in module.modules() if hasattr(m, "rope") and m.rope is not None}.values():
        vit.rope.register_forward_hook(lambda _m, _i, out: tables.append(tuple(out.shape)))
    student = module.objective.student.backbone if cfg.objective.name == "dino" else module.model  # (dino: the EMA)
    before = [p.detach().clone() for p in student.parameters()]
    trainer = L.Trainer(max_epochs=1, limit_train_batches=steps, limit_val_batches=0, logger=False, accelerator="cpu",
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    moved = [not torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True)]
    assert sum(moved) > len(moved) // 2, "the step trained most of the encoder"
    if path:
        trainer.save_checkpoint(path)
    return module, tables


def evaluate_every_task(compose_cfg, ckpt):
    """vitlab.eval's tasks on the checkpoint: its classifier (test) and its frozen features (k-NN, DINOv2's linear
    protocol on the last blocks' class tokens and the patch tokens' average, few-shot), the features cached once."""
    from vitlab.eval import evaluate

    features = ckpt.parent / "features"
    small = {"knn": ["knn.k=[5]"], "fewshot": ["fewshot.shots=[2]", "fewshot.seeds=[0]"],
             "linear": ["linear.iterations=1", "linear.lrs=[0.01]", "linear.n_last_blocks=[2]", "linear.batch_size=32"],
             "test": []}  # fmt: skip
    for task, options in small.items():
        args = [f"ckpt_path={ckpt}", f"task={task}", f"features_dir={features}", "progress_bar=none", *options]
        metrics = evaluate(compose_cfg("eval", args, output_dir=ckpt.parent / task))
        scores = [v for k, v in metrics.items() if k.split("/")[-1].startswith(("acc", "top1", "1shot", "2shot"))]
        assert scores and all(0.0 <= v <= 1.0 for v in scores), (task, metrics)


@pytest.mark.parametrize("model", ROPE_MODELS)
def test_every_objective_trains_the_rope_models(compose_cfg, tmp_path, model):
    grid, head = 16, 16 * 2  # a 4x4 grid of 16 px / 4; head dim 32 / 2 heads, sin and cos
    per_block = (2, 2) if model.endswith("mixed") else ()  # mixed RoPE: a table per block and head
    _, tables = fit(compose_cfg("train", tiny(model)), tmp_path / "classify.ckpt")
    assert set(tables) == {(*per_block, grid, head)}
    if model == "vit_s16_dinov3":  # (the tasks read forward_features and forward_intermediates: one family's enough)
        evaluate_every_task(compose_cfg, tmp_path / "classify.ckpt")
    distill = [f"objective.teacher={tmp_path / 'classify.ckpt'}", "objective.type=soft"]
    fit(compose_cfg("train", [*tiny(model), "objective=distill", *distill]))

    mae = ["objective=mae", "model.num_classes=0", "objective.decoder_embed_dim=16", "objective.decoder_depth=1",
           "objective.decoder_num_heads=2"]  # fmt: skip
    _, tables = fit(compose_cfg("train", [*tiny(model), *mae]))
    assert set(tables) == {(*per_block, grid, head)}  # (encode_visible takes the kept patches' rows of it)

    dino = ["experiment=dino_pretrain_digits", "objective.out_dim=32", "objective.hidden_dim=16",
            "objective.bottleneck_dim=8", "objective.crops.local_crops=2", "callbacks=none"]  # fmt: skip
    _, tables = fit(compose_cfg("train", [*tiny(model), *dino]), steps=2)  # (DINO's learning rate starts at 0)
    local = 2 * 2  # 8 px local crops of 4 px patches
    assert set(tables) == {(*per_block, grid, head), (*per_block, local, head)}  # the student's and the teacher's


def test_dino_on_a_rope_file_without_dynamic_img_size_is_refused_in_one_line(compose_cfg):
    """The EVA02 and RoPE-Mixed files keep timm's dynamic_img_size=false; DINO's local crops need it (docs/models/zoo.md
    and docs/training/objectives.md give the command with it set)."""
    from vitlab.utils.errors import UserError

    dino = ["objective=dino", "model.num_classes=0", "objective.out_dim=32", "objective.hidden_dim=16",
            "objective.bottleneck_dim=8", "objective.crops.local_size=8"]  # fmt: skip
    cfg = compose_cfg("train", [*tiny("eva02_ti14"), *dino])
    assert cfg.model.dynamic_img_size is False  # the file's own value (timm's)
    with pytest.raises(UserError) as e:
        plan = train_plan(cfg)
        build.build_module(plan, build.fit_datamodule(plan))
    said = "objective=dino's crops of [8, 16] px need position embeddings at each size: set model.dynamic_img_size=true"
    assert str(e.value) == said
    cfg = compose_cfg("train", [*tiny("eva02_ti14"), *dino, "model.dynamic_img_size=true"])  # the documented fix
    plan = train_plan(cfg)
    assert build.build_module(plan, build.fit_datamodule(plan)).objective.student is not None
