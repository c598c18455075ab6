"""data.batch_size=auto (training/run/auto_batch.py): the largest batch whose memory estimate fits 90% of the budget
(one image more would not), a multiple of the processes, at most the training images; recorded in config.yaml and
metrics.json, the learning rate scaled from it; a resumed run keeps its checkpoint's batch; too little memory is one
line. Chosen as the run is planned: the data module and the Trainer are built at the batch chosen."""

import json
from pathlib import Path

import pytest
import yaml

from vitlab.cli.plans import train_plan
from vitlab.training.devices import memory
from vitlab.training.devices.hardware import Devices, devices_of
from vitlab.training.run import auto_batch, build
from vitlab.utils.errors import UserError

BUDGET = 0.05  # GB: a few hundred digits per process at the default model


def chosen(compose_cfg, *overrides):
    cfg = compose_cfg("train", ["data.batch_size=auto", f"memory_budget_gb={BUDGET}", *overrides])
    plan = train_plan(cfg)
    trainer = build.build_trainer(plan.trainer, plan.trainer_args, logger=False)
    datamodule = build.fit_datamodule(plan)
    datamodule.setup("fit")
    return plan, trainer, datamodule, plan.batch_size_auto


def estimate_at(plan, trainer, per_process: int) -> float:
    probe = build.build_module(plan, None, probe=True)
    return memory.estimate(*auto_batch.probe_args(plan, devices_of(plan.trainer), probe, per_process)).total


@pytest.mark.parametrize("overrides", [[], ["trainer=ddp_cpu", "trainer.devices=2"]], ids=["one", "two-processes"])
def test_the_batch_is_the_largest_that_fits_and_divides_among_the_processes(compose_cfg, overrides):
    plan, trainer, datamodule, got = chosen(compose_cfg, *overrides)
    n, per = trainer.num_devices * trainer.num_nodes, got["per_process"]
    assert (
        got["batch_size"] == plan.data["batch_size"] == datamodule.batch_size == per * n
        and got["limited_by"] == "memory"
    )
    assert estimate_at(plan, trainer, per) <= 0.9 * BUDGET * 1e9 < estimate_at(plan, trainer, per + 1)
    assert per > 100


def test_the_batch_is_at_most_the_training_images(compose_cfg):
    _, trainer, datamodule, got = chosen(compose_cfg, "memory_budget_gb=10", "trainer=ddp_cpu", "trainer.devices=2")
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
    *_, again = chosen(compose_cfg, "memory_budget_gb=1")  # another budget, the checkpoint's batch
    *_, resumed = chosen(compose_cfg, "memory_budget_gb=1", f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}")
    assert resumed["batch_size"] == batch != again["batch_size"]


def test_with_several_training_sizes_the_batch_fits_at_the_size_of_the_most_activations(compose_cfg):
    """data.train_img_sizes (issue 53): chosen for the largest images, which every batch is (data.batch_size at each
    size), so the run's own estimate, logged next, fits the budget too; one image more would not."""
    sizes = ["model.dynamic_img_size=true", "data.train_img_sizes=[8,12]"]
    plan, trainer, datamodule, got = chosen(compose_cfg, *sizes)
    module = build.build_module(plan, datamodule)
    batch, optimizer = plan.data["batch_size"], plan.optim["name"]
    run = memory.for_run(module, Devices.of_trainer(trainer), optimizer, batch, datamodule.size_schedule)
    assert run.px == 12 and run.total <= 0.9 * BUDGET * 1e9
    more = memory.for_run(module, Devices.of_trainer(trainer), optimizer, batch + 1, datamodule.size_schedule)
    assert more.total > 0.9 * BUDGET * 1e9
    plain = chosen(compose_cfg)[3]["batch_size"]
    assert got["batch_size"] < plain  # (the model's own 8 px would have allowed more)
