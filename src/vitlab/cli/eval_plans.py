"""vitlab.eval's config made into its plan, once, before anything is built (STYLE rule 13): the checkpoint read once
(training.run.inference) or `model.pretrained`'s weights resolved once (timm's architecture and preprocessing become
the plan's model and data mappings), the data mapping laid over the checkpoint's, the task and its settings
(evaluation.tasks.Probe), the trainer mapping (settled for a checkpoint's task=test) and the paths. Below it nothing
reads eval's config, and nothing writes into it: the decisions are laid into a copy of the tree here, and handed on as
plain values."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitlab.evaluation.tasks import Pretrained, Probe, check_launch
from vitlab.training.module import ViTModule
from vitlab.training.run import build
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPlan:
    """What vitlab.eval runs: a checkpoint's module (`module`, read once) or timm's weights (`pretrained`), the data
    mapping to build the data module of (with its `_target_`), the task, the Trainer of a checkpoint's task=test and
    where metrics.json goes."""

    probe: Probe
    ckpt_path: str | None
    module: ViTModule | None
    pretrained: Pretrained | None
    data: dict[str, Any]
    tester: Any  # a checkpoint's task=test: the Lightning Trainer that tests it (its settings settled), else None
    tta: str
    output_dir: Path
    teachers: tuple[TeacherPlan, ...] = ()  # a distilled checkpoint's, probed beside it (eval's teacher=true)


@dataclass(frozen=True)
class TeacherPlan:
    """A teacher a checkpoint was distilled from (objective=distill), probed beside it: its name in the student's
    objective, its checkpoint (read once), and the student's data mapping prepared as the teacher takes its images
    (its image size and normalisation)."""

    name: str
    ckpt_path: str
    module: ViTModule
    data: dict[str, Any]


def eval_plan(cfg: DictConfig) -> EvalPlan:
    """eval's checked config (cli/schemas.py's EvalSettings) -> its plan, read from a copy of it (`tree`: the plan's
    decisions are laid into it, never into `cfg`)."""
    tree = OmegaConf.create(OmegaConf.to_container(cfg))
    part = {k: OmegaConf.to_container(tree[k], resolve=True) for k in ("knn", "linear", "fewshot", "segmentation")}
    layers = OmegaConf.to_container(tree.layers) if OmegaConf.is_list(tree.layers) else tree.layers
    trainer = OmegaConf.to_container(tree.trainer, resolve=True)
    task, ckpt_path = tree.task, tree.ckpt_path
    probe = Probe(task, layers, **part, trainer=trainer, features_dir=tree.features_dir)
    if task != "test" or ckpt_path is None:  # the processes that extract features (or score timm's head)
        check_launch(trainer)
    common = {"tta": tree.tta, "output_dir": Path(tree.paths.output_dir)}
    if ckpt_path is None:
        pretrained = _pretrained(tree, task)
        _check_labels(task, pretrained.data, checkpoint=False)
        return EvalPlan(probe, None, None, pretrained, dict(pretrained.data), None, **common)
    module = _checkpoint(ckpt_path, task)
    data = _data(tree, module.hparams.get("data"), ckpt_path, module.model.cfg.to_dict()["img_size"])
    _check_labels(task, data)
    tester = _tester(trainer, tree.progress_bar) if task == "test" else None
    teachers = _teachers(module, data, task) if tree.teacher and task != "test" else ()
    return EvalPlan(probe, ckpt_path, module, None, data, tester, **common, teachers=teachers)


def _teachers(module: ViTModule, data: dict[str, Any], task: str) -> tuple[TeacherPlan, ...]:
    """The teachers of a checkpoint trained with objective=distill (objective.teacher, or objective.teachers), each
    to be probed beside it on the same images: those that are vitlab checkpoints; a timm name's weights are probed by
    their own command, said in a line."""
    from vitlab.convert.weights import is_sharded_checkpoint
    from vitlab.training.objectives.distillation import normalisation

    plans = []
    for spec in module.objective.taught_by():
        if not spec.source.endswith(".ckpt"):
            said = "probe it beside with python -m vitlab.eval model.pretrained=%s model=<its model group> data=<...>"
            log.info("teacher %s is timm's %s: " + said + " task=%s", spec.name, spec.source, spec.source, task)
            continue
        if not Path(spec.source).is_file() and not is_sharded_checkpoint(spec.source):
            raise UserError(
                f"teacher {spec.source!r}, which this checkpoint was distilled from, is not there to be probed beside "
                "it: give teacher=false to evaluate the student alone"
            )
        teacher = _checkpoint(spec.source, task)
        mean, std = normalisation(teacher.hparams.get("data") or {})
        norm = {"mean": list(mean), "std": list(std)} if mean is not None and std is not None else {}
        taken = {**data, "img_size": teacher.model.cfg.to_dict()["img_size"], **norm}
        plans.append(TeacherPlan(spec.name, spec.source, teacher, taken))
    return tuple(plans)


def _check_labels(task: str, data: dict[str, Any], checkpoint: bool = True) -> None:
    """Several labels an image (data.multilabel): knn, linear and fewshot score frozen features by mAP, test a
    checkpoint's classifier; the rest (segmentation, and test of timm's one-label head) refused in one line."""
    scored = ("knn", "linear", "fewshot", "test") if checkpoint else ("knn", "linear", "fewshot")
    if data.get("multilabel") and task not in scored:
        raise UserError(
            f"task={task} scores one label an image, and this data has several (objective.multilabel): use "
            f"{', '.join(f'task={t}' for t in scored[:-1])} or task={scored[-1]}, which score mAP"
        )


def _tester(trainer: dict[str, Any], progress_bar: str) -> Any:
    """The Trainer of a checkpoint's task=test: its settings settled (said where `auto` chose), the progress bar of
    progress_bar=, no logger, no checkpoints."""
    settled = build.settle_trainer(trainer, said=False)
    bars, show_bar = build.progress_bar(progress_bar)
    return build.build_trainer(settled, build.trainer_arguments(settled), logger=False, callbacks=bars,
                               enable_progress_bar=show_bar, enable_checkpointing=False)  # fmt: skip


def _checkpoint(ckpt_path: str, task: str) -> ViTModule:
    """The checkpoint's module, from the one read of its file; task=test of an encoder refused."""
    from vitlab.training.run.inference import load_for_inference

    module = load_for_inference(ckpt_path)
    if task == "test" and not module.objective.uses_labels:  # an encoder: no classifier to test
        raise UserError(
            f"checkpoint {ckpt_path!r} is objective={module.objective.name} pretraining (an encoder without a "
            "classifier): evaluate its features with task=knn, task=linear or task=fewshot"
        )
    return module


def _data(tree: DictConfig, stored: dict | None, ckpt_path: str, img_size: Any) -> dict[str, Any]:
    """The data mapping to test on: a chosen `data=<name>`, or the checkpoint's own with the non-null `data.<key>`
    overrides of the command line applied; its images prepared at the size the checkpoint's model takes
    (`img_size`: an int, or [height, width])."""
    data = tree.data
    if "_target_" in data:  # eval.yaml's data.data_dir placeholder stays null beside a group that names its data
        if "data_dir" in data and data.data_dir is None:  # another way (data=hf's name, data=wds's urls)
            del data["data_dir"]
        data.img_size = img_size
        return OmegaConf.to_container(data, resolve=True)
    if not stored or "_target_" not in stored:
        raise UserError(f"checkpoint {ckpt_path!r} stores no data config; choose one with data=<name>")
    overrides = {k: v for k, v in OmegaConf.to_container(data, resolve=True).items() if v is not None}
    unknown = sorted(set(overrides) - set(stored))
    if unknown:
        raise UserError(
            f"data.{unknown[0]} is not a setting of the checkpoint's data ({stored['_target_']}); "
            f"its settings: {sorted(k for k in stored if not k.startswith('_'))}"
        )
    return {**stored, **overrides, "img_size": img_size}


def _pretrained(tree: DictConfig, task: str) -> Pretrained:
    """`model.pretrained=<source>` on `data=<name>`, resolved once: task=test scores the weights' own head at
    model.img_size (null: the size they were trained at), the data taking their preprocessing where it leaves it
    null; the other tasks build our model=<name> as timm's architecture (training.pretrained.pretrained_model), with
    the data's channels and no head (the features never reach one)."""
    from vitlab.convert.source import resolve
    from vitlab.training.pretrained import explicit_model_keys, pretrained_model, take_preprocessing

    source = OmegaConf.select(tree, "model.pretrained")
    if not source:
        raise UserError(
            "ckpt_path must be given: ckpt_path=<file.ckpt>, or timm's weights with model.pretrained=<timm name | "
            "local-dir:<folder> | hf-hub:<repo>> data=<name> (task=test: their own head; task=knn|linear|fewshot: "
            "their features, with model=<name>)"
        )
    if "_target_" not in tree.data:
        raise UserError(f"model.pretrained={source} needs the data to evaluate on: data=<name>")
    if task == "test":
        weights = resolve(source, run={"img_size": OmegaConf.select(tree, "model.img_size")})
        if not weights.is_file:  # (a weights file is refused by score_pretrained: it carries no preprocessing)
            _take_preprocessing(tree, weights)
    else:
        if OmegaConf.select(tree, "model.img_size") is None:
            raise UserError(f"task={task} on model.pretrained={source} needs the model's size: model=<name>")
        tree.model.in_chans, tree.model.num_classes = tree.data.get("channels", 3), 0
        before = OmegaConf.to_container(tree.model, resolve=True)  # timm's architecture, and the data's mean/std/crop
        weights, model = pretrained_model(before, explicit_model_keys())  # left null (training.pretrained)
        tree.model.update(model)
        take_preprocessing(tree.data, weights, before)
    model, data = (OmegaConf.to_container(tree[k], resolve=True) for k in ("model", "data"))
    network = None
    if task != "test":  # our ViT at the model's size, the weights loaded, no head (the features never reach one)
        from vitlab.model import ViT
        from vitlab.model.config import vit_config

        network = ViT(vit_config(model))
        weights.load_into(network, reset_head=True)
    return Pretrained(source, weights, model, data, Path(tree.paths.log_dir), network)


def _take_preprocessing(tree: DictConfig, weights: Any) -> None:
    """task=test's model.img_size, where null, becomes the weights' (data.img_size follows it); the data's mean, std
    and eval transform left null become the weights' (training.pretrained's fill)."""
    from vitlab.training.pretrained import pretrained_preprocessing

    if OmegaConf.select(tree, "model.img_size") is None:
        tree.model.img_size = list(weights.preprocessing["input_size"][1:])
    taken = pretrained_preprocessing(tree.data, weights.preprocessing, tree.data.get("channels", 3))
    log.info(
        "model.pretrained=%s: preprocessing %s", weights.source, ", ".join(f"data.{k}={v}" for k, v in taken.items())
    )
