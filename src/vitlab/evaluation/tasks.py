"""vitlab.eval's frozen-feature tasks (task=knn|linear|fewshot), in the processes the trainer config asks for:
Lightning Fabric starts them as the Trainer does (a DDP launch re-runs the command once per further device) and
sets up torch.distributed's group; each process then extracts its share of every split (vitlab.evaluation.features) and
rank 0 gathers, caches and scores. The weights are a checkpoint's, or timm's pretrained weights ported into our
ViT (`model.pretrained=<timm name>` and no ckpt_path), whose own head task=test scores as timm's validate.py does
(vitlab.evaluation.classifier). What they read of eval's config is handed to them as values, made once by the
command's plan (cli/eval_plans.py): the task and its settings (`Probe`), and timm's weights resolved (`Pretrained`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitlab.convert.source import Weights
from vitlab.evaluation import classifier
from vitlab.evaluation.features import Layers, _world, layers_of, source_id, split_features
from vitlab.training.run import build
from vitlab.training.run.ranges import check_devices
from vitlab.utils.errors import UserError
from vitlab.utils.logs import shown

log = logging.getLogger(__name__)

# Data settings that change how images are loaded, not which: left out of what identifies cached features.
LOADER_KEYS = ("batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclass(frozen=True)
class Probe:
    """vitlab.eval's task and what it reads of the command's config: its groups as cli/schemas.py validated them
    (KnnSettings, LinearSettings, FewshotSettings, SegmentationSettings: plain mappings), the features' `layers`, the
    features cache (`features_dir`, None: beside the weights' run) and the trainer mapping whose processes extract."""

    task: str
    layers: int | list[int] | None
    knn: Mapping[str, Any]
    linear: Mapping[str, Any]
    fewshot: Mapping[str, Any]
    segmentation: Mapping[str, Any]
    trainer: Mapping[str, Any]
    features_dir: str | None = None


@dataclass(frozen=True)
class Pretrained:
    """`model.pretrained=<source>` without a checkpoint, resolved once by the plan: the weights (timm's architecture
    and preprocessing), our model's config at the run's size and that model with the weights loaded (task=test:
    neither, the weights' own head is scored), the data mapping with the weights' preprocessing laid in where it was
    left null, and where runs log (the features cache: <log_dir>/features/<name>/)."""

    source: str
    weights: Weights
    model: Mapping[str, Any]
    data: Mapping[str, Any]
    log_dir: Path
    network: Any = None  # task=knn|linear|fewshot|segmentation: our ViT of `model` with the weights, without a head


def check_launch(trainer: Mapping[str, Any]) -> None:
    """The processes `launch` would start, checked as the command is planned: the devices asked for, a strategy that
    extracts features (each process a share of the images, the whole model in each)."""
    check_devices(trainer)
    if not isinstance(trainer.get("strategy", "auto"), str):
        raise UserError(
            "frozen features are extracted with trainer.strategy=auto or ddp (each process a share of the images, "
            "the whole model in each); this config gives an object (trainer=fsdp?): use trainer=ddp or trainer=ddp_cpu"
        )


def launch(trainer: Mapping[str, Any]) -> torch.device:
    """Start the processes of trainer.accelerator / devices / num_nodes / strategy (checked by the plan:
    check_launch; this one becomes rank 0); this process's device."""
    from lightning.fabric import Fabric

    strategy = trainer.get("strategy", "auto")
    t = trainer
    fabric = Fabric(accelerator=t.get("accelerator", "auto"), strategy=strategy, devices=t.get("devices", 1),
                    num_nodes=t.get("num_nodes", 1))  # fmt: skip
    fabric.launch()
    return fabric.device


def probe_checkpoint(probe: Probe, ckpt_path: str, model: torch.nn.Module, datamodule, teachers=()) -> dict | None:
    """The task on a checkpoint's model, its features cached beside its run (<run>/features/<checkpoint name>/).
    `teachers`: (name, checkpoint, model, data module) of the teachers it was distilled from, each probed after it in
    the same processes on the same images (its data module: the teacher's size and normalisation), its features
    cached in the student's cache under teacher_<name>/; their metrics beside the student's (`beside_teacher`)."""
    ckpt = Path(ckpt_path)
    cache = Path(probe.features_dir) if probe.features_dir else ckpt.resolve().parent.parent / "features" / ckpt.stem
    device = launch(probe.trainer)
    metrics = run_probe(probe, model, datamodule, source_id(ckpt_path), cache, device)
    for name, path, teacher, data in teachers:
        log.info("teacher %s (%s), probed beside the student on the same images:", name, path)
        found = run_probe(probe, teacher, data, source_id(path), cache / f"teacher_{name}", device)
        metrics = beside_teacher(metrics, name, found)
    return metrics


def beside_teacher(student: dict | None, name: str, teacher: dict | None) -> dict | None:
    """The student's metrics with a teacher's beside them, `teacher/<metric>` (of several teachers:
    `teacher_<name>/<metric>`), and each score's retention, the student's over the teacher's: `retention/<metric>`
    (`retention_<name>/...`). Scores: the numbers that grow with quality, not learning rates, spreads over seeds,
    single seeds or the validation numbers that chose a head. None in the processes other than rank 0."""
    if student is None or teacher is None:
        return student
    label, kept = ("teacher", "retention") if name == "teacher" else (f"teacher_{name}", f"retention_{name}")
    out = dict(student) | {f"{label}/{k}": v for k, v in teacher.items() if k != "split"}
    for k, v in student.items():
        t = teacher.get(k)
        score = not any(w in k for w in ("/lr", "_std", "-seed-", "val_", "loss"))
        if score and isinstance(v, float) and isinstance(t, float) and t > 0:
            out[f"{kept}/{k}"] = v / t
    return out


def probe_pretrained(probe: Probe, pretrained: Pretrained) -> dict | None:
    """The task on `model.pretrained`'s weights (a timm name, or a weights file) at the model config's size, on
    `data=<name>`; its features cached in <log_dir>/features/<name>/, identified by the name (a file: its path,
    size and time), our model config and the data config. task=test scores the weights' own head instead
    (`score_pretrained`)."""
    if probe.task == "test":
        return score_pretrained(probe, pretrained)
    source, weights, model = pretrained.source, pretrained.weights, pretrained.network
    datamodule = build.build_datamodule(pretrained.data)
    datamodule.setup("test")
    data = {k: v for k, v in pretrained.data.items() if k not in LOADER_KEYS}
    named = source_id(source) if weights.is_file else {"pretrained": source}
    ident = named | {"model": dict(pretrained.model), "data": data}
    name = Path(source).stem if weights.is_file else source.replace("/", "_").replace(":", "_")
    cache = Path(probe.features_dir) if probe.features_dir else pretrained.log_dir / "features" / name
    return run_probe(probe, model, datamodule, ident, cache, launch(probe.trainer))


def score_pretrained(probe: Probe, pretrained: Pretrained) -> dict:
    """task=test on timm's weights (resolved once, by the plan): their own head on the data's images, in this one
    process, as timm's validate.py scores them (evaluation.classifier)."""
    weights = pretrained.weights
    source = weights.source
    if weights.is_file:
        raise UserError(
            f"task=test on model.pretrained={source}: a weights file carries no preprocessing to score it with; give "
            "a timm name or a timm folder (local-dir:<folder>, with its config.json)"
        )
    t = probe.trainer
    if t.get("num_nodes", 1) != 1 or t.get("devices", 1) not in (1, "1"):
        raise UserError("task=test on model.pretrained runs in one process: set trainer.devices=1")
    metrics, images = classifier.score(pretrained.data, weights, launch(probe.trainer))
    log.info("model.pretrained=%s on %s: %s", source, images, ", ".join(f"{k} {shown(v)}" for k, v in metrics.items()))
    return metrics


TASKS = ("test", "knn", "fewshot", "linear", "segmentation")


def run_probe(probe: Probe, model, datamodule, source: dict, cache: Path | None, device: torch.device) -> dict | None:
    """vitlab.eval's task=knn|linear|fewshot (`probe`: the task and its settings) on the frozen features of the
    training split and the test split (the validation split where the data has none), extracted once into the
    features cache `cache` (None: none) and read from there by later tasks; `source` names the weights. Under
    several processes each extracts its share, and rank 0 alone scores: the metrics there, None elsewhere."""
    if probe.task not in TASKS:
        raise UserError(f"task {probe.task!r} is not one of {list(TASKS)}")
    if probe.task == "segmentation":
        return probe_segmentation(probe.segmentation, model, datamodule, source, cache, device)
    split = "test" if getattr(datamodule, "test_set", None) is not None else "val"
    if probe.task == "linear" and split == "val":
        raise UserError(
            "task=linear picks its learning rate on the validation split and needs a test split besides it: this data "
            "has none (for an image folder, data.val_fraction=0.01 validates on a slice of train and tests on val/)"
        )
    bank = len(datamodule.eval_view("train"))
    ks = list(probe.knn["k"])
    if probe.task == "knn" and max(ks) > bank:
        raise UserError(
            f"knn.k {ks} asks for more neighbours than the {bank} training images the k-NN votes among: "
            f"give values up to {bank} (knn.k=[{','.join(str(k) for k in ks if k <= bank) or min(10, bank)}])"
        )
    linear = probe.task == "linear"
    lp = probe.linear
    layers, views = linear_views(probe.layers, lp, model) if linear else (layers_of(model, probe.layers), None)
    augment = linear and lp["augment"]  # the heads train on features recomputed each step: none cached for train
    splits = (["val", split] if augment else ["train", "val", split]) if linear else ["train", split]
    labels = label_spec(datamodule)
    feats = {s: split_features(model, datamodule, s, device, cache, source, layers, label_spec=labels) for s in splits}
    if linear:  # under augment every process extracts training features all along: each runs it
        metrics = score_linear(lp, model, datamodule, layers, views, feats, split, device)
    if feats[split][0] is None:  # not rank 0
        return None
    if not linear:
        metrics = _score(probe, feats, split, datamodule.num_classes)
    line = ", ".join(f"{name} {shown(v)}" if isinstance(v, float) else f"{name} {v}" for name, v in metrics.items())
    print(f"{line} (on the {split} split)", flush=True)
    return metrics | {"split": split, "features": str(cache)}


def linear_views(layers: int | list[int] | None, lp: Mapping[str, Any], model) -> tuple[Layers, dict]:
    """task=linear's features: DINOv2's grid (linear.n_last_blocks x linear.avgpool: the class tokens of the last n
    blocks, with or without the last block's average patch token), each a slice of one extraction (the class
    tokens of the last max(n) blocks, then the average patch token); or, with linear.n_last_blocks=null, the one
    set of features `layers` picks (`lp`: eval's linear group). Returns (what to extract, {name: the columns of each
    configuration})."""
    if lp["n_last_blocks"] is None:
        picked = layers_of(model, layers)
        return picked, {picked.name or "pooled": slice(None)}
    depth, width = len(model.blocks), model.num_features
    ns, pools = ([v] if isinstance(v, (bool, int, str)) else list(v) for v in (lp["n_last_blocks"], lp["avgpool"]))
    if not ns or any(not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= depth for n in ns):
        raise UserError(
            f"linear.n_last_blocks={ns} must list block counts from 1 to {depth} (the model's depth), or be null to "
            "probe the features `layers` picks"
        )
    if not pools or any(not isinstance(a, bool) for a in pools):
        raise UserError(f"linear.avgpool={pools} must list true and/or false")
    if not model.cfg.class_token:
        raise UserError(
            f"linear.n_last_blocks={ns} concatenates class tokens and the model has none (class_token=false); set "
            "linear.n_last_blocks=null to probe its pooled features"
        )
    most = max(ns)
    picked = layers_of(model, list(range(depth - most, depth)), any(pools))
    views = {f"last{n}" + ("+avgpool" if a else ""): slice((most - n) * width, (most + a) * width)
             for n in ns for a in pools}  # fmt: skip
    return picked, views


def label_spec(datamodule) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and type of an image's label in the features cache: a class index, or with several labels an image
    (objective.multilabel data) its multi-hot row of the classes."""
    return ((datamodule.num_classes,), torch.int64) if getattr(datamodule, "multilabel", False) else ((), torch.int64)


def _score(probe: Probe, feats: dict, split: str, k: int) -> dict:
    from vitlab.evaluation.probes import fewshot_seeds, knn_map, knn_topk_accuracy

    (train, train_y), (test, test_y) = feats["train"], feats[split]
    if probe.task == "knn":
        knn = probe.knn
        if train_y.ndim == 2:  # several labels an image: mAP of the neighbours' votes
            found = knn_map(train, train_y, test, test_y, tuple(knn["k"]), knn["temperature"])
        else:
            found = knn_topk_accuracy(train, train_y, test, test_y, k, tuple(knn["k"]), knn["temperature"])
        return {f"knn/{name}_k{n}": acc for n, accs in found.items() for name, acc in accs.items()}
    f = probe.fewshot
    check_shots(list(f["shots"]), train_y, k)
    return fewshot_seeds(train, train_y, test, test_y, k, tuple(f["shots"]), f["l2_reg"], tuple(f["seeds"]))


def check_shots(shots: list[int], labels: torch.Tensor, num_classes: int) -> None:
    """A shot count beyond a class's training images (with several labels an image: those that carry it) would
    silently take all of them (fewshot/500shot computed on every image of each class): refused, as knn.k beyond the
    bank is."""
    counts = labels.long().sum(0) if labels.ndim == 2 else torch.bincount(labels.long(), minlength=num_classes)
    fewest, cls = int(counts.min()), int(counts.argmin())
    if max(shots) > fewest:
        fits = [s for s in shots if s <= fewest]
        raise UserError(
            f"fewshot.shots {shots} asks for more training images per class than class {cls} has ({fewest}): give "
            f"values up to {fewest} (fewshot.shots=[{','.join(map(str, fits)) or fewest}])"
        )


def score_linear(
    lp: Mapping[str, Any], model, datamodule, layers: Layers, views: dict, feats: dict, split: str, device
) -> dict | None:
    """task=linear (`lp`: eval's linear group): DINOv2's heads trained on the cached training features, or with
    lp.augment on features of augmented images recomputed each step (in every process: each its batch); chosen on
    the validation split, the chosen head scored on `split`. The metrics in rank 0, None elsewhere."""
    from vitlab.evaluation.augmented import augmented_batches
    from vitlab.evaluation.linear import Heads, Schedule, cached_batches, choose, train_heads

    rank, world = _world()
    s = Schedule(lp["iterations"], lp["batch_size"], world, tuple(lp["lrs"]), seed=lp["seed"])
    if lp["augment"]:
        batches = augmented_batches(model, datamodule, layers, device, s)
    elif rank == 0:
        batches = cached_batches(feats["train"][0].to(device), feats["train"][1].to(device), s)
    if rank > 0:
        if lp["augment"]:  # this process's batch of every step, gathered by rank 0
            for _ in batches:
                pass
        return None
    g = torch.Generator().manual_seed(s.seed)
    heads = Heads(views, layers.dim(model), datamodule.num_classes, len(s.lrs), g).to(device)
    log.info("linear probe: %s", s.describe(len(views), lp["augment"]))
    train_heads(heads, batches, s, on_step=_progress("linear probe", s.iterations))
    (val, val_y), (test, test_y) = feats["val"], feats[split]
    found = choose(heads, s.lrs, val.to(device), val_y.to(device), test.to(device), test_y.to(device))
    if val_y.ndim == 2:  # several labels an image: chosen on validation mAP
        scores = {"linear/map": found["test_map"], "linear/map_micro": found["test_map_micro"],
                  "linear/val_map": found["val_map"]}  # fmt: skip
    else:
        scores = {"linear/top1": found["test_acc"], "linear/val_top1": found["val_acc"]}
    return scores | {"linear/lr": found["lr"], "linear/features": found["features"],
                     "linear/protocol": s.describe(len(views), lp["augment"]), "linear/chosen_on": "val",
                     "linear/reported_on": split}  # fmt: skip


def _progress(what: str, total: int, minute: float = 60.0) -> Callable[[int], None]:
    """A long loop that shows it runs: after its first steps, an estimate of its time at their pace; then a log line
    (step k of n, seconds so far) every tenth of `total` steps, and at least once a `minute` between them."""
    started, every, first = time.time(), max(1, total // 10), min(3, total)
    said = [started]

    def step_done(step: int) -> None:
        now, done = time.time(), step + 1
        if done == first and done < total:
            pace = (now - started) / done
            log.info("%s: %d steps, about %.0f s (%.3g s a step over the first %d)", what, total, pace * total, pace,
                     done)  # fmt: skip
        if done % every == 0 or done == total or now - said[0] >= minute:
            said[0] = now
            log.info("%s: step %d of %d (%.0f s)", what, done, total, now - started)

    return step_done


def probe_segmentation(
    sp: Mapping[str, Any], model, datamodule, source: dict, cache: Path | None, device: torch.device
) -> dict | None:
    """task=segmentation (vitlab.evaluation.seg_probe; `sp`: eval's segmentation group): the patch tokens of the
    training split and of the test split (the validation split where the data has none) with their masks, extracted
    once into the cache; DINOv2's linear head trained on them in rank 0 and scored there by mIoU and pixel accuracy.
    The metrics in rank 0, None elsewhere."""
    from vitlab.evaluation import seg_probe as seg
    from vitlab.evaluation.seg_schedule import schedule_for

    if not hasattr(datamodule, "seg_view"):
        raise UserError(
            f"task=segmentation needs images with class masks, data=segmentation (not {type(datamodule).__name__})"
        )
    tokens = seg.patch_tokens(model, sp["n_last_blocks"])
    split = "test" if datamodule.test_set is not None else "val"
    ident = source | {"data": datamodule.identity, "task": "segmentation"}
    masks = (tuple(datamodule.img_hw), torch.uint8)
    feats = {s: split_features(model, datamodule, s, device, cache, ident, tokens, datamodule.seg_view(s), masks, False)
             for s in ("train", split)}  # fmt: skip
    if feats[split][0] is None:  # not rank 0
        return None
    for s in ("train", split):
        seg.check_labels(feats[s][1], datamodule.num_classes, s)
    schedule, length = schedule_for(sp, len(feats["train"][0]))
    g = torch.Generator().manual_seed(schedule.seed)
    head = seg.BNHead(feats["train"][0].shape[1], datamodule.num_classes, g)
    log.info("segmentation probe: %s", length)
    log.info("segmentation probe: %s", schedule.describe(len(tokens.blocks)))
    seg.train_head(
        head, *feats["train"], schedule, device, on_step=_progress("segmentation probe", schedule.iterations)
    )
    found = seg.score(head, *feats[split], datamodule.num_classes, device)
    protocol = schedule.describe(len(tokens.blocks))
    metrics = {"seg/mIoU": found["mIoU"], "seg/aAcc": found["aAcc"], "seg/protocol": protocol, "seg/reported_on": split}
    print(f"seg/mIoU {shown(found['mIoU'])}, seg/aAcc {shown(found['aAcc'])} (on the {split} split)", flush=True)
    return metrics | {"split": split, "features": str(cache)}
