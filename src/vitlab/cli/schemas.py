"""What each command checks before any work: its config schema (its top-level keys, conf/<command>.yaml, with their
types and ranges, its groups key by key: eval's knn, linear, fewshot) and what needs several keys or the file system
(`check_<command>`). `@entry_point` runs both (vitlab.cli.entry.check_config), with every node that builds something
(the data module, the Trainer within Lightning's ranges, callbacks, loggers) checked against its target, before Hydra
makes a plain run's directory and as each sweep job starts. tests/cli/test_schemas.py keeps each schema equal to its
YAML file's keys.

A schema is a TypedDict; a range is a type (`PositiveInt`, `Fraction`, utils.arguments): `top_k=abc` and `top_k=0` are
both `top_k ... must be an integer >= 1`, before a checkpoint is read.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypedDict

from omegaconf import DictConfig, OmegaConf

from vitlab.cli.peft_checks import check_peft
from vitlab.utils.arguments import (
    ByteSize,
    NonEmpty,
    NonNegativeInt,
    NonNegativeNumber,
    OpenUnit,
    PositiveInt,
    PositiveNumber,
    Seed,
    check_arguments,
)
from vitlab.utils.clipping import check_clipping
from vitlab.utils.cuda import check_device
from vitlab.utils.errors import UserError
from vitlab.utils.kernels import CompileMode, SdpaBackend
from vitlab.utils.logs import ProgressBar


class TrainSettings(TypedDict):
    seed: Seed
    train: bool
    test: bool
    ckpt_path: str | None
    optimized_metric: str | None
    compile: bool | CompileMode | None  # true: torch.compile's default mode
    sdpa_backend: SdpaBackend
    progress_bar: ProgressBar
    print_config: bool
    memory_check: bool
    memory_budget_gb: PositiveNumber | None  # data.batch_size=auto's budget per process
    freeze_backbone: bool
    task_name: str
    tags: list[str]


class KnnSettings(TypedDict):
    k: NonEmpty[PositiveInt]  # at most the training images it votes among (checked once the data is known)
    temperature: PositiveNumber


class LinearSettings(TypedDict):
    n_last_blocks: PositiveInt | NonEmpty[PositiveInt] | None  # at most the model's depth (checked with the model)
    avgpool: bool | NonEmpty[bool]
    lrs: NonEmpty[PositiveNumber]
    iterations: PositiveInt
    batch_size: PositiveInt  # per process
    augment: bool
    seed: Seed


class FewshotSettings(TypedDict):
    shots: NonEmpty[PositiveInt]
    l2_reg: NonNegativeNumber
    seeds: NonEmpty[Seed]


class SegmentationSettings(TypedDict):
    n_last_blocks: PositiveInt  # at most the model's depth (checked with the model)
    iterations: PositiveInt | None  # null: DINOv2's epochs (31.7) of the training split (seg_probe.schedule_for)
    warmup_iters: NonNegativeInt | None  # null: DINOv2's share of the iterations (1,500 of 40,000)
    batch_size: PositiveInt  # global
    lr: PositiveNumber
    weight_decay: NonNegativeNumber
    seed: Seed


class EvalDataOverrides(TypedDict):
    """eval's `data.<key>=`, laid over the checkpoint's own data config (a data=<name> group replaces them, and is
    checked against its data module instead)."""

    data_dir: str | None
    batch_size: PositiveInt | None
    num_workers: NonNegativeInt | None


class PretrainedModel(TypedDict):
    """Without a checkpoint: timm's weights (`pretrained`), at `img_size` (null: the size they were trained at)."""

    pretrained: str | None
    img_size: PositiveInt | NonEmpty[PositiveInt] | None


class EvalSettings(TypedDict):
    task_name: str
    tags: list[str]
    seed: Seed
    ckpt_path: str | None
    progress_bar: ProgressBar
    task: Literal["test", "knn", "linear", "fewshot", "segmentation"]
    tta: Literal["none", "flip", "flip_crops"]  # task=test of a checkpoint (vitlab.evaluation.tta)
    features_dir: str | None
    teacher: bool  # a distilled checkpoint's teachers probed beside it (task=knn|linear|fewshot|segmentation)
    layers: int | NonEmpty[int] | None
    knn: KnnSettings
    linear: LinearSettings
    fewshot: FewshotSettings
    segmentation: SegmentationSettings
    data: EvalDataOverrides
    model: dict[str, Any]  # PretrainedModel's keys, or a model=<name> group's (checked as the model is built)


class PredictSettings(TypedDict):
    task_name: str
    ckpt_path: str | None
    model: PretrainedModel
    images: str | NonEmpty[str]
    top_k: PositiveInt | None  # null: min(5, the model's classes)
    threshold: OpenUnit | None  # multi-label checkpoints: the labels above it; null: objective.threshold's
    device: str  # cpu, cuda, cuda:<i> that this machine has (check_predict)


class ExportSettings(TypedDict):
    task_name: str
    ckpt_path: str
    format: Literal["onnx", "pt2", "mae", "ckpt", "timm", "peft"]  # convert.programs.FORMATS' and vitlab.export's own
    output: str | None
    overwrite: bool
    atol: NonNegativeNumber
    license: str | None
    datasets: list[str] | None
    push_to_hub: str | None
    private: bool
    revision: str | None


class AverageSettings(TypedDict):
    task_name: str
    method: Literal["average", "uniform_soup", "greedy_soup"]
    run_dir: str | None
    top_k: PositiveInt | None
    ckpt_paths: NonEmpty[str] | None
    sweep_dir: str | None
    use_ema: bool
    output: str | None
    overwrite: bool
    device: str  # cpu, cuda, cuda:<i> that this machine has (vitlab.average's check_average)


class VisualizeSettings(TypedDict):
    task_name: str
    what: Literal["figures", "views"]
    ckpt_path: str | None
    image: str | None
    run_dir: str | None
    num_images: PositiveInt
    draws: PositiveInt


class ParitySettings(TypedDict):
    task_name: str
    seed: Seed
    batch_size: PositiveInt
    pretrained: bool
    atol: NonNegativeNumber
    grad_rtol: NonNegativeNumber
    timm_zoo: str | None
    zoo_depth: PositiveInt


class PackModel(TypedDict):
    img_size: PositiveInt | NonEmpty[PositiveInt]  # what the data configs read; packing keeps the images' own sizes


class PackSettings(TypedDict):
    task_name: str
    out: str
    overwrite: bool
    workers: PositiveInt | None
    chunk_bytes: ByteSize | PositiveInt  # LitData's: bytes, or a size such as 64MB
    format: Literal["litdata", "wds"]
    shard_size: PositiveInt  # format=wds: samples a tar
    model: PackModel


class BenchmarkSettings(TypedDict):
    task_name: str
    benchmark: dict[str, Any]  # its keys: benchmark.config.BenchmarkConfig's, checked by check_benchmark


def check_train(cfg: DictConfig) -> None:
    from vitlab.model.config import vit_config
    from vitlab.training.optim import OptimConfig, SchedulerConfig
    from vitlab.training.run.ranges import DataRanges, TrainerValues, check_devices

    # What can be checked before torch, Lightning and timm are imported (seconds): a refusal within a second.
    _check_ckpt_path(cfg.ckpt_path, "last")
    if not cfg.model.get("pretrained"):  # (timm's architecture replaces the group's once read: training.pretrained)
        vit_config(cfg.model)
    OptimConfig.check_early(OmegaConf.to_container(cfg.optim, resolve=True))  # (its name: at the build)
    SchedulerConfig.from_dict(OmegaConf.to_container(cfg.scheduler, resolve=True))
    check_arguments(TrainerValues, _present(cfg.trainer, TrainerValues), "trainer")  # (Lightning's types: later)
    check_arguments(DataRanges, _present(cfg.data, DataRanges), "data")
    check_clipping(cfg.trainer)
    if cfg.train and cfg.trainer.get("max_epochs") == 0:  # (Lightning trains nothing and the run ends as if done)
        raise UserError("trainer.max_epochs=0 trains nothing: give 1 or more (-1: until max_steps), or train=false "
                        "to test a checkpoint without training")  # fmt: skip
    if cfg.freeze_backbone and _pretrains(cfg.objective.get("name")):
        raise UserError(
            f"freeze_backbone=true trains only the classifier head, and objective={cfg.objective.name} pretrains the "
            "encoder without one: nothing would learn; drop freeze_backbone"
        )
    check_peft(cfg)  # peft=: its ranges, and what it cannot go with (cli/peft_checks.py)
    if cfg.objective.get("multilabel") and "multilabel" not in cfg.data:  # (issue 77: before the run's directory)
        target = str(cfg.data.get("_target_", "")).rsplit(".", 1)[-1]
        raise UserError(
            f"objective.multilabel=true needs several labels an image, and {target} reads one (an image folder cannot "
            "say more): give the labels in a list (data=list) or a dataset (data=hf)"
        )
    check_devices(cfg.trainer)  # (torch only where the machine may have a GPU) before check_request reads them
    _check_float8_on_a_cpu(cfg.trainer)
    if "folds" in cfg.data or "fold" in cfg.data:  # (whether the data module takes folds: check_nodes)
        from vitlab.data.folds import check_folds

        check_folds(cfg.data.get("folds", 0), cfg.data.get("fold", 0))

    from vitlab.cli.node_checks import check_global_batch, check_launch
    from vitlab.training.devices.sharding import check_request

    check_launch(cfg)  # a -m sweep of multi-process runs on a launcher that cannot start them
    check_global_batch(cfg)
    check_request(cfg.trainer, cfg.get("callbacks"))  # trainer=fsdp: what cannot shard (its note is logged by train)


def _check_float8_on_a_cpu(trainer: DictConfig) -> None:
    """trainer.precision=float8 where no GPU can be in use (the CPU asked for, or none here), refused before torch is
    imported; on a machine with GPUs, their compute capability is asked as the Trainer is configured
    (training.devices.hardware)."""
    from vitlab.training.devices.float8_request import check_float8, is_float8
    from vitlab.utils.cuda import no_cuda_here

    if is_float8(precision := trainer.get("precision")) and (trainer.get("accelerator") == "cpu" or no_cuda_here()):
        check_float8(str(precision), [])


def _pretrains(objective: str | None) -> bool:
    """objective=`objective` reads no labels (training.module.OBJECTIVES' `uses_labels`): it pretrains the encoder and
    has no classifier head to train. (Torch and Lightning imported: only where freeze_backbone asks.)"""
    from vitlab.training.module import OBJECTIVES

    return objective in OBJECTIVES and not OBJECTIVES[objective].uses_labels


def _present(node: DictConfig, schema: Any) -> dict[str, Any]:
    """The keys of `schema` that `node` has, resolved."""
    values = OmegaConf.to_container(node, resolve=True)
    return {k: values[k] for k in typing.get_type_hints(schema) if k in values}


def _check_ckpt_path(path: str | None, *special: str) -> None:
    """A checkpoint named that is not there, said before torch is imported (convert.weights.read_file's words)."""
    from vitlab.utils.errors import MissingFileError

    if path is not None and str(path) not in special and not Path(str(path)).expanduser().exists():
        raise MissingFileError(f"ckpt_path {str(path)!r} does not exist")


def check_export(cfg: DictConfig) -> None:
    _check_ckpt_path(cfg.ckpt_path)


def check_eval(cfg: DictConfig) -> None:
    """Model overrides beside a checkpoint would be ignored: its model is the one the checkpoint stores; tta averages
    a checkpoint's classifier over views (task=test)."""
    _check_ckpt_path(cfg.ckpt_path)
    seg = cfg.segmentation
    if seg.iterations is not None and seg.warmup_iters is not None:  # (null: sized to the data once it is read)
        from vitlab.evaluation.seg_schedule import check_warmup

        check_warmup(seg.iterations, seg.warmup_iters)
    if cfg.tta != "none" and (cfg.task != "test" or cfg.ckpt_path is None):
        raise UserError(
            f"tta={cfg.tta} averages the logits of a checkpoint's classifier over views: give ckpt_path=<file.ckpt> "
            f"with task=test (this is task={cfg.task}{'' if cfg.ckpt_path else ' without ckpt_path'}), or tta=none"
        )
    if cfg.ckpt_path is not None and _model_given(cfg):
        from hydra.core.hydra_config import HydraConfig

        given = " ".join(o for o in HydraConfig.get().overrides.task if o.lstrip("+~").startswith("model"))
        raise UserError(
            f"{given or 'model=...'}: the model of ckpt_path {cfg.ckpt_path!r} is the one its checkpoint stores, and "
            "model overrides would be ignored; drop them, or evaluate timm's weights instead of a checkpoint: "
            "model.pretrained=<timm name> data=<name> without ckpt_path"
        )


def _model_given(cfg: DictConfig) -> bool:
    """A model=<name> group chosen, or a model.<key> of the command's own (null) ones set."""
    model = cfg.get("model")
    return model is not None and any(v is not None for v in OmegaConf.to_container(model).values())


def check_predict(cfg: DictConfig) -> None:
    from vitlab.utils.errors import MissingFileError

    _check_ckpt_path(cfg.ckpt_path)
    check_device("device", cfg.device)
    for image in [cfg.images] if isinstance(cfg.images, str) else cfg.images:  # (data.images.read_image's words)
        if not Path(str(image)).expanduser().exists():
            raise MissingFileError(f"image file {str(image)!r} does not exist")
    if (cfg.ckpt_path is None) == (cfg.model.pretrained is None):
        raise UserError(
            "give ckpt_path=<file.ckpt> (a trained checkpoint) or model.pretrained=<timm name | local-dir:<folder> | "
            "hf-hub:<repo>> (timm's weights with their head), one of them"
        )


def _objectives() -> list[str]:
    """The objectives conf/objective/ offers (a new objective's file lists it here too)."""
    from vitlab.cli.config_tree import config_dir

    return sorted(p.stem for p in (config_dir() / "objective").glob("*.yaml"))


def check_visualize(cfg: DictConfig) -> None:
    if cfg.what == "views":
        missing = [g for g in ("data", "model", "objective") if cfg.get(g) is None]
        if missing or cfg.ckpt_path or cfg.run_dir or cfg.image:
            raise UserError(
                "what=views draws the training views of data=<name> model=<name> "
                f"objective=<{'|'.join(_objectives())}> "
                f"(as vitlab.train takes them){'; missing: ' + ' '.join(missing) if missing else ''}; ckpt_path, "
                "image and run_dir are for what=figures"
            )
        return
    if not (cfg.run_dir or cfg.ckpt_path):
        raise UserError("give ckpt_path=<checkpoint> [image=<file>] and/or run_dir=<training run directory>")
    _check_ckpt_path(cfg.ckpt_path)
    if cfg.image and not cfg.ckpt_path:
        raise UserError("image=... needs ckpt_path=<checkpoint> of the model to look inside")


def check_parity(cfg: DictConfig) -> None:
    from vitlab.model.config import vit_config

    if not cfg.timm_zoo:
        vit_config(cfg.model)  # the model's geometry and names


def check_pack(cfg: DictConfig) -> None:
    """`out` before the data is scanned: new (or overwrite=true), and somewhere this process may write."""
    from vitlab.cli.rundir import check_writable

    out = Path(cfg.out).absolute()
    if out.exists() and not cfg.overwrite:
        raise UserError(f"out {str(out)!r} already exists; give a new folder, or overwrite=true to replace it")
    check_writable(next(p for p in out.parents if p.exists()), "out", out)  # (creates no folder)


def _nothing(cfg: DictConfig) -> None:
    pass


# conf/<name>.yaml -> its schema, and its command's further checks.
SCHEMAS: dict[str, tuple[type, Callable[[DictConfig], Any]]] = {
    "train": (TrainSettings, check_train),
    "eval": (EvalSettings, check_eval),
    "predict": (PredictSettings, check_predict),
    "export": (ExportSettings, check_export),
    "average": (AverageSettings, _nothing),  # its further checks: vitlab.average's check_average
    "visualize": (VisualizeSettings, check_visualize),
    "parity": (ParitySettings, check_parity),
    "pack": (PackSettings, check_pack),
    "benchmark": (BenchmarkSettings, _nothing),  # its group's checks: the command's own (benchmark.config)
}
