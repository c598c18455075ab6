"""experiments/recipes/README.md is the spec of the recipes: every row that names a vitlab key holds the value the
`experiment=` config gives it, and every recipe builds (model, optimizer groups, schedule, data pipeline, loss) on a
small image tree, its network shrunk to CPU size."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests.helpers.images import image_tree

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "experiments" / "recipes" / "README.md"
RECIPES = [
    "deit_b16_in1k",
    "deit_s16_in1k",
    "deit3_b16_in1k",
    "bv_s16_i1k_90ep",
    "mae_finetune_b16_in1k",
    "mae_pretrain_b16_in1k",
    "dino_vits16_100ep",
    "dino_vits16_300ep",
    "dinov2_vitl16_in1k",
]


def table_rows() -> dict[str, list[tuple[str, object]]]:
    """Per recipe (its `## <name>:` section), the (key, value) of each row naming a vitlab key."""
    rows: dict[str, list[tuple[str, object]]] = {}
    recipe = None
    for line in README.read_text().splitlines():
        if m := re.match(r"## (\w+):", line):
            recipe = m.group(1)
            rows[recipe] = []
        elif recipe and line.startswith("| ") and not line.startswith("| setting"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 6 and cells[3].startswith("`"):
                rows[recipe].append((cells[3].strip("`"), yaml.safe_load(cells[4].strip("`"))))
    return rows


def test_the_table_covers_every_recipe():
    rows = table_rows()
    assert list(rows) == RECIPES
    assert all(len(r) >= 10 for r in rows.values()), {k: len(v) for k, v in rows.items()}
    assert all((ROOT / "conf" / "experiment" / f"{name}.yaml").is_file() for name in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_is_its_table(compose_cfg, recipe):
    """Composed as the run composes it: with its real model.pretrained (timm's architecture and preprocessing read
    offline, what the recipe sets kept) and its LR scaled by the global batch."""
    from vitlab.cli.plans import train_plan

    plan = train_plan(compose_cfg("train", [f"experiment={recipe}"]))
    cfg = OmegaConf.create(plan.config)  # the config as the run saves it
    model = plan.model  # the network the run builds (a variant's sizes filled in)
    for key, value in table_rows()[recipe]:
        field = key.removeprefix("model.")
        if key.startswith("model.") and hasattr(model, field):
            ours = getattr(model, field)
        else:
            ours = OmegaConf.select(cfg, key, throw_on_missing=True)
            ours = OmegaConf.to_container(ours, resolve=True) if OmegaConf.is_config(ours) else ours
        if isinstance(value, float) or isinstance(ours, float):
            assert ours == pytest.approx(value, rel=1e-9), (recipe, key, ours, value)
        else:
            assert ours == value, (recipe, key, ours, value)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return image_tree(tmp_path_factory.mktemp("recipes"), classes=("a", "b", "c"), per_class=8, size=(40, 36))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_builds_and_takes_a_step(compose_cfg, recipe, tree):
    """The recipe's pipeline on a small tree (its network shrunk, so without its pretrained weights, which would refuse
    a shrunk network): each optimizer group and the schedule, the workers' augmentation, the device half, MixUp, the
    loss, one optimizer step."""
    from vitlab.cli.plans import train_plan
    from vitlab.training.optim import make_optimizer, make_scheduler
    from vitlab.training.run.build import build_module, fit_datamodule

    small = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.pretrained=null"]
    if recipe.startswith("dino"):  # 32 px views, local 16 px; a head of 64 prototypes
        small += ["model.img_size=32", "objective.crops.local_size=16", "objective.out_dim=64"]
        small += ["objective.hidden_dim=32", "objective.bottleneck_dim=16"]
    data = [f"data.data_dir={tree}", "data.num_classes=3", "data.batch_size=4", "data.num_workers=0"]
    data += ["data.val_fraction=0.25"] if recipe.startswith("bv_") else []  # its 1% minival: of 24 images, none
    cfg = compose_cfg("train", [f"experiment={recipe}", *small, *data, "trainer=cpu"])
    plan = train_plan(cfg)
    dm = fit_datamodule(plan)
    dm.setup("fit")
    module = build_module(plan, dm)
    optimizer = make_optimizer(module.objective.optimized(module.model), module.optim)
    scheduler = make_scheduler(optimizer, module.scheduler_cfg, total_steps=100, epochs=10)
    x, y = next(iter(dm.train_dataloader()))
    if cfg.objective.name == "dino":  # photos: the views cut from each whole image in the workers (data/image_views.py)
        assert all(v.dtype == torch.uint8 for v in x) and [v.shape[-1] for v in x] == [32, 32] + [16] * 8
    else:
        assert x.dtype == torch.uint8 and x.shape[-2:] == tuple(dm.img_hw)
    x, y = dm.device_transform((x, y), train=True)
    if cfg.objective.name == "dino":  # the views (and iBOT's masks), the teacher's and the student's forward
        views, masks = x
        assert [v.shape[-1] for v in views] == [32, 32] + [module.objective.cfg.crops.local_size] * 8
        module.objective.fit_start(dm, x[0][0].device)
        loss, _ = module.objective.training_loss(module.model, x, y, 0)
    elif cfg.objective.name == "mae":  # the reconstruction of the masked patches (labels unread)
        loss, pred, _ = module.objective.reconstruct(module.model, x)
        assert pred.shape[:2] == (4, module.model.cfg.num_patches)
    else:
        loss, logits = module.loss(x, y)
        assert logits.shape == (4, 3)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert type(optimizer).__name__.lower().startswith(cfg.optim.name)
    assert scheduler is not None
