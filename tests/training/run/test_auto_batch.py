"""data.batch_size=auto (training/run/auto_batch.py): the largest batch whose memory estimate fits 90% of the budget
(one image more would not), a multiple of the processes, at most the training images; recorded in config.yaml and
metrics.json, the learning rate scaled from it; a resumed run keeps its checkpoint's batch; too little memory is one
line."""

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import open_dict

from vitlab.training.devices import memory
from vitlab.training.run import auto_batch, build
from vitlab.utils.errors import UserError

BUDGET = 0.05  # GB: a few hundred digits per process at the default model


def chosen(compose_cfg, *overrides):
    cfg = compose_cfg("train", ["data.batch_size=auto", f"memory_budget_gb={BUDGET}", *overrides])
    trainer = build.build_trainer(cfg.trainer, logger=False)
    auto_batch.provisional(cfg, trainer)
    datamodule = build.build_datamodule(cfg.data, cfg)
    return cfg, trainer, datamodule, auto_batch.choose(cfg, trainer, datamodule)


def estimate_at(cfg, trainer, per_process: int) -> float:
    return memory.estimate(*auto_batch._probe_args(cfg, trainer, auto_batch.processes(trainer), per_process)).total


@pytest.mark.parametrize("overrides", [[], ["trainer=ddp_cpu", "trainer.devices=2"]], ids=["one", "two-processes"])
def test_the_batch_is_the_largest_that_fits_and_divides_among_the_processes(compose_cfg, overrides):
    cfg, trainer, datamodule, got = chosen(compose_cfg, *overrides)
    n, per = auto_batch.processes(trainer), got["per_process"]
    assert (
        got["batch_size"] == cfg.data.batch_size == datamodule.batch_size == per * n and got["limited_by"] == "memory"
    )
    assert estimate_at(cfg, trainer, per) <= 0.9 * BUDGET * 1e9 < estimate_at(cfg, trainer, per + 1)
    assert per > 100


def test_the_batch_is_at_most_the_training_images(compose_cfg):
    cfg, trainer, datamodule, got = chosen(compose_cfg, "memory_budget_gb=10", "trainer=ddp_cpu", "trainer.devices=2")
    images = len(datamodule.train_set)
    assert got["limited_by"] == "training images" and got["batch_size"] == images // 2 * 2


def test_too_little_memory_is_one_line(compose_cfg):
    with pytest.raises(UserError, match=r"data.batch_size=auto: not one image per process fits 90% of memory_budget"):
        chosen(compose_cfg, "memory_budget_gb=0.0001")


def test_a_run_records_the_batch_scales_the_lr_and_resumes_with_it(compose_cfg, tmp_path):
    from vitlab.train import train

    overrides = ["optim.lr_base=1e-3", "trainer.max_epochs=1", "trainer.limit_train_batches=1", "test=false"]
    cfg = compose_cfg("train", ["data.batch_size=auto", f"memory_budget_gb={BUDGET}", *overrides])
    train(cfg)
    out = Path(cfg.paths.output_dir)
    metrics, config = json.loads((out / "metrics.json").read_text()), yaml.safe_load((out / "config.yaml").read_text())
    batch = metrics["batch_size_auto"]["batch_size"]
    assert config["data"]["batch_size"] == batch and batch > 100
    assert config["optim"]["lr"] == pytest.approx(1e-3 * batch / 256) and config["optim"]["global_batch"] == batch
    cfg, trainer, _, again = chosen(compose_cfg, "memory_budget_gb=1")  # another budget, the checkpoint's batch
    with open_dict(cfg):
        cfg.ckpt_path = str(out / "checkpoints" / "last.ckpt")
    datamodule = build.build_datamodule(cfg.data, cfg)
    with open_dict(cfg):
        cfg.data.batch_size = "auto"
    assert auto_batch.choose(cfg, trainer, datamodule)["batch_size"] == batch != again["batch_size"]


def test_with_several_training_sizes_the_batch_fits_at_the_size_of_the_most_activations(compose_cfg):
    """data.train_img_sizes (issue 53): chosen for the largest images, which every batch is (data.batch_size at each
    size), so the run's own estimate, logged next, fits the budget too; one image more would not."""
    sizes = ["model.dynamic_img_size=true", "data.train_img_sizes=[8,12]"]
    cfg, trainer, datamodule, got = chosen(compose_cfg, *sizes)
    module = build.build_module(cfg, datamodule)
    run = memory.for_run(module, trainer, cfg.optim.name, cfg.data.batch_size, datamodule.size_schedule)
    assert run.px == 12 and run.total <= 0.9 * BUDGET * 1e9
    more = memory.for_run(module, trainer, cfg.optim.name, cfg.data.batch_size + 1, datamodule.size_schedule)
    assert more.total > 0.9 * BUDGET * 1e9
    plain = chosen(compose_cfg)[3]["batch_size"]
    assert got["batch_size"] < plain  # (the model's own 8 px would have allowed more)
