"""Every file under conf/ composes, resolves and instantiates."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from vitlab.cli.config_tree import config_dir
from vitlab.cli.plans import train_plan
from vitlab.model.config import vit_config
from vitlab.training.module import ViTModule
from vitlab.training.run import build
from vitlab.training.run.build import build_trainer, settle_trainer, trainer_arguments
from vitlab.utils.errors import UserError

CONF = config_dir()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


def every_conf_file() -> set[Path]:
    return {p for p in CONF.rglob("*.yaml") if p.parent.name != "local"}


def build_everything(cfg):
    """What vitlab.train builds before fitting: model, data, module, callbacks, loggers, trainer."""
    mc = vit_config(cfg.model)
    # One block is enough to check the module's arguments; every full model is built in test_model_configs.
    mae = cfg.objective.name in ("mae", "dino")  # an encoder without a head, and its decoder (dino: heads, teacher)
    ViTModule(
        model={**mc.to_dict(), "depth": 1},
        objective=OmegaConf.to_container(cfg.objective),
        optim=OmegaConf.to_container(cfg.optim),
        scheduler=OmegaConf.to_container(cfg.scheduler),
    )
    views = build.data_views(cfg.data, OmegaConf.to_container(cfg.objective, resolve=True), mc)
    dm = build.build_datamodule(cfg.data, **views)  # (objective=dino: with its views)
    assert (0 if mae else dm.num_classes, dm.channels) == (mc.num_classes, mc.in_chans)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c and "_target_" in c]
    loggers = [instantiate(c) for c in (cfg.logger or {}).values() if c and "_target_" in c]
    return mc, dm, callbacks, loggers


def test_the_tests_cover_every_conf_file():
    covered = {
        CONF / f"{g}/{o}.yaml"
        for g in (
            "model",
            "objective",
            "data",
            "optim",
            "scheduler",
            "trainer",
            "callbacks",
            "logger",
            "debug",
            "experiment",
            "hparams_search",
            "paths",
            "peft",
        )
        for o in options(g)
    }
    covered |= {
        CONF / "model/_base.yaml",
        CONF / "peft/_base.yaml",
        CONF / "hydra/default.yaml",
        CONF / "hydra/launcher/slurm.yaml",
    }
    covered |= {CONF / "hydra/sweeper/vitlab_optuna.yaml"}  # tests/end_to_end/test_sweeps.py
    commands = ("train", "eval", "predict", "parity", "visualize", "benchmark", "export", "pack", "average")
    covered |= {CONF / f"{n}.yaml" for n in commands}
    assert every_conf_file() <= covered, every_conf_file() - covered


def test_base_model_fields_are_vitconfig_fields():
    from dataclasses import fields

    from vitlab.model import ViTConfig
    from vitlab.model.config import MODEL_EXTRA_KEYS

    base = OmegaConf.load(CONF / "model/_base.yaml")
    assert set(base) == {f.name for f in fields(ViTConfig) if f.init} | set(MODEL_EXTRA_KEYS)
    defaults = ViTConfig()
    for key in base:
        if key not in MODEL_EXTRA_KEYS and base[key] is not None:
            assert base[key] == getattr(defaults, key), key


@pytest.mark.parametrize("model", options("model"))
def test_model_configs(compose_cfg, model):
    cfg = compose_cfg("train", [f"model={model}"])
    assert vit_config(cfg.model).num_classes == 10  # wired to data=digits
    cfg = compose_cfg("parity", [f"model={model}"])
    with torch.device("meta"):
        from vitlab.model import ViT

        ViT(vit_config(cfg.model))


@pytest.mark.parametrize("data", options("data"))
def test_data_configs(compose_cfg, data, tmp_path, request):
    extra = []
    if data in ("hf", "list"):  # their class count is read from the data: the folder's (3 classes) as records
        records = request.getfixturevalue("records")
        extra = [f"data.name={records / 'saved'}" if data == "hf" else f"data.train_file={records / 'train.csv'}"]
    if data == "wds":  # and from the description python -m vitlab.pack format=wds writes beside the tars
        extra = [f'data.urls="{request.getfixturevalue("wds_shards") / "train-{000000..000003}.tar"}"']
    if data == "imagefolder":  # its class count is read from the folder
        for cls in ("cat", "dog", "eel"):
            (tmp_path / "tree" / "train" / cls).mkdir(parents=True)
        extra = [f"data.data_dir={tmp_path / 'tree'}"]
    if data == "digit_pairs":  # several labels an image: what it trains
        extra = ["objective.multilabel=true"]
    if data == "streaming":  # and from the description python -m vitlab.pack writes beside the shards
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "vitlab-shards.json").write_text('{"class_names": ["cat", "dog", "eel"]}')
        extra = [f"data.data_dir={tmp_path / 'shards'}"]
    cfg = compose_cfg("train", [f"data={data}", "model=vit_cifar", *extra])
    mc, dm, *_ = build_everything(cfg)
    assert dm.img_size == mc.img_size == 32
    if data in ("imagefolder", "streaming", "hf", "list", "wds"):
        assert dm.num_classes == mc.num_classes == 3


def test_wiring_resizes_digits_for_vit_b16(compose_cfg):
    cfg = compose_cfg("train", ["model=vit_b16", "data=digits"])
    mc, dm, *_ = build_everything(cfg)
    assert (mc.img_size, mc.in_chans, mc.num_classes) == (224, 1, 10)
    dm.setup()
    x, _ = dm.on_after_batch_transfer(next(iter(dm.test_dataloader())), 0)
    assert x.shape[1:] == (1, 224, 224)


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_configs(compose_cfg, trainer):
    cfg = compose_cfg("train", [f"trainer={trainer}"])
    strategy = cfg.trainer.get("strategy")
    if isinstance(strategy, dict) or OmegaConf.is_dict(strategy):
        strategy = instantiate(strategy)  # FSDP: vitlab's FSDP2 strategy object (training/devices/sharding.py)
        assert type(strategy).__name__ == "FSDP2Strategy"
    fewer = {"gpu": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}
    settings = settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True))  # (the settings a plan hands on)
    if cfg.trainer.accelerator in fewer and fewer[cfg.trainer.accelerator] < cfg.trainer.devices:
        if cfg.trainer.accelerator == "mps":  # not an Apple GPU: one line says so
            with pytest.raises(UserError, match="trainer.accelerator='mps' trainer.devices=1 cannot run here"):
                build_trainer(settings, trainer_arguments(settings), logger=False)
        # Fewer GPUs here than it asks for: build the same trainer on CPU processes to check every other argument.
        trainer_obj = build_trainer(
            settings, trainer_arguments(settings), accelerator="cpu", precision="32-true", logger=False
        )
    else:
        trainer_obj = build_trainer(
            settings, trainer_arguments(settings), logger=False
        )  # precision/strategy auto resolved as a run's plan does
    assert trainer_obj.max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize("callbacks", options("callbacks"))
def test_callback_configs(compose_cfg, callbacks):
    cfg = compose_cfg("train", [f"callbacks={callbacks}"])
    _, _, cbs, _ = build_everything(cfg)
    names = {type(c).__name__ for c in cbs}
    if callbacks == "ema":
        assert "EMA" in names and "BestCheckpoint" in names
    if callbacks == "early_stopping":  # on the metric the best checkpoint follows, which follows the objective
        (stop,) = [c for c in cbs if type(c).__name__ == "EarlyStopping"]
        assert (stop.monitor, stop.mode, stop.patience) == ("val/acc", "max", 10) and "BestCheckpoint" in names
        mae = train_plan(
            compose_cfg("train", ["callbacks=early_stopping", "objective=mae", "model.num_classes=0"])
        ).callbacks
        assert (mae["early_stopping"]["monitor"], mae["early_stopping"]["mode"]) == ("val/loss", "min")


@pytest.mark.parametrize("logger", options("logger"))
def test_logger_configs(compose_cfg, logger, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_cfg("train", [f"logger={logger}"])
    _, _, _, loggers = build_everything(cfg)
    assert len(loggers) == (3 if logger == "many" else 1)


@pytest.mark.parametrize("debug", options("debug"))
def test_debug_configs(compose_cfg, debug):
    cfg = compose_cfg("train", [f"debug={debug}"])
    assert cfg.task_name == "debug"
    build_everything(cfg)
    trainer = build_trainer(
        s := settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True)), trainer_arguments(s), logger=False
    )
    if debug == "default":  # one epoch, one device, anomaly detection
        assert (trainer.max_epochs, trainer.num_devices, trainer._detect_anomaly) == (1, 1, True)


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_configs(compose_cfg, experiment):
    cfg = compose_cfg("train", [f"experiment={experiment}"])
    mc, dm, *_ = build_everything(cfg)
    assert cfg.tags and mc.num_classes == (0 if cfg.objective.name in ("mae", "dino") else dm.num_classes)


def test_hparams_search_config(compose_cfg):
    cfg = compose_cfg("train", ["hparams_search=digits_optuna"], keep_hydra=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert set(cfg.hydra.sweeper.params) == {"optim.lr", "optim.weight_decay", "model.drop_path_rate", "model.depth"}
    instantiate(cfg.hydra.sweeper.sampler)


@pytest.mark.parametrize(
    "overrides, tasks, gpus, cpus",
    [
        (["trainer=ddp"], 4, 4, 1),  # digits loads in the main process: 1 CPU a task
        (["trainer=ddp_cpu"], 2, None, 1),  # no GPU asked for on a CPU run
        (["trainer=gpu", "data=fake"], 1, 1, 8),  # loader workers left to vitlab: 8 CPUs
        (["trainer=ddp", "trainer.devices=2", "data=fake", "data.num_workers=5"], 2, 2, 6),
    ],
)
def test_the_slurm_launcher_asks_for_what_the_run_uses(compose_cfg, overrides, tasks, gpus, cpus):
    cfg = compose_cfg("train", ["hydra/launcher=slurm", *overrides], keep_hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.vitlab_slurm.SlurmLauncher"
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.cpus_per_task) == (tasks, gpus, cpus)
    assert launcher.signal_delay_s > 0 and launcher.max_num_timeout > 0 and launcher.additional_parameters.requeue


@pytest.mark.parametrize("name", ["eval", "predict", "parity", "benchmark", "export", "pack", "average"])
def test_other_entry_point_configs(compose_cfg, name):
    overrides = {
        "eval": ["ckpt_path=x.ckpt", "data=digits", "data.img_size=8"],
        "predict": ["ckpt_path=x.ckpt", "images=[a.png]"],
        "export": ["ckpt_path=x.ckpt"],
        "pack": ["data=fake", "out=shards"],
        "average": ["run_dir=r", "top_k=2"],
        "parity": [],
        "benchmark": [],
    }[name]
    cfg = compose_cfg(name, overrides)
    assert cfg.task_name == name
    if name == "eval":
        instantiate(cfg.data)
        build_trainer(
            s := settle_trainer(OmegaConf.to_container(cfg.trainer, resolve=True)), trainer_arguments(s), logger=False
        )
    if name == "benchmark":
        from vitlab.benchmark.config import BenchmarkConfig

        b = BenchmarkConfig.from_dict(OmegaConf.to_container(cfg.benchmark))  # the defaults are valid
        assert b.train_overrides == tuple(cfg.benchmark.train_overrides)
        train = compose_cfg("train", list(cfg.benchmark.train_overrides))
        assert train.progress_bar == "none" and "csv" in train.logger


def test_unknown_key_and_wrong_type_fail_at_start_up(compose_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="model.depht"):
        compose_cfg("train", ["model.depht=3"])
    cfg = compose_cfg("train", ["model.depth=three"])
    with pytest.raises(ValueError, match="depth 'three' must be an integer"):
        vit_config(cfg.model)
    cfg = compose_cfg("train", ["optim.lr=fast"])
    with pytest.raises(ValueError, match="optim.lr .fast. must be a number >= 0"):
        build_everything(cfg)


@pytest.mark.parametrize(
    "data", [d for d in options("data") if "train_transform" in OmegaConf.load(CONF / f"data/{d}.yaml")]
)
def test_data_transform_settings_are_the_dataclass_fields(data):
    """Each data YAML's transform settings are fields of the dataclasses (no stray key), with valid values."""
    from dataclasses import fields

    from vitlab.data.transforms import EvalTransform, TrainTransform

    node = OmegaConf.to_container(OmegaConf.load(CONF / f"data/{data}.yaml"))
    for key, cls in (("train_transform", TrainTransform), ("eval_transform", EvalTransform)):
        names = {f.name for f in fields(cls)}
        assert set(node[key]) <= names, (key, set(node[key]) - names)
        cls(**{k: v for k, v in node[key].items() if v is not None})  # valid values (null: the data's default)


def test_benchmark_yaml_and_dataclass_are_one_source_of_defaults():
    from vitlab.benchmark.config import BenchmarkConfig
    from vitlab.utils.values import to_dict

    yaml_defaults = OmegaConf.to_container(OmegaConf.load(CONF / "benchmark.yaml"))["benchmark"]
    defaults = to_dict(BenchmarkConfig())
    defaults["train_overrides"] = list(defaults["train_overrides"])
    assert yaml_defaults == defaults


@pytest.mark.parametrize("optim", options("optim"))
@pytest.mark.parametrize("scheduler", options("scheduler"))
def test_optim_and_scheduler_configs(compose_cfg, optim, scheduler):
    """Every optimizer and schedule of conf/ builds through the module and steps."""
    from vitlab.training.optim import make_optimizer, make_scheduler

    cfg = compose_cfg("train", [f"optim={optim}", f"scheduler={scheduler}"])
    module = ViTModule(
        model={**vit_config(cfg.model).to_dict(), "depth": 1},
        optim=OmegaConf.to_container(cfg.optim),
        scheduler=OmegaConf.to_container(cfg.scheduler),
    )
    assert module.optim.name == cfg.optim.name and module.scheduler_cfg.name == cfg.scheduler.name
    optimizer = make_optimizer(module.model, module.optim)
    schedule = make_scheduler(optimizer, module.scheduler_cfg, total_steps=20, epochs=2)
    optimizer.step()
    if hasattr(schedule, "step_update"):  # timm's
        schedule.step_update(num_updates=1)
    else:
        schedule.step()
    assert optimizer.param_groups[0]["lr"] > 0
