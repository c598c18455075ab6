"""python -m vitlab.eval ckpt_path=<file.ckpt> [data=<name>] [data.data_dir=<moved data>] [task=...]: test a checkpoint,
write metrics.json (on the validation split, its metrics named val/, where the data has no test split). task=knn
(DINOv2's weighted k-NN), task=linear (DINOv2's linear probe over a grid of feature configurations and learning rates,
chosen on the validation split) and task=fewshot (big_vision's few-shot least squares) evaluate the frozen features
instead (vitlab.evaluation.probes), cached beside the checkpoint's run (<run>/features/<checkpoint>/), in the processes
trainer=... asks for (trainer=ddp_cpu: 2). Without ckpt_path, model=<name> model.pretrained=<timm name> data=<name>
evaluates timm's pretrained weights (vitlab/evaluation/tasks.py). tta=flip|flip_crops adds test-time augmentation's
numbers beside the plain ones (`test/acc_tta`: the logits averaged over the views, vitlab.evaluation.tta).

The model comes from the checkpoint's stored config; the data from `data=...` or, by default, the data config the
checkpoint was trained with (same split, same transforms), with any `data.<key>=` given on the command line on top (data
that moved: `data.data_dir=...`). The class names the checkpoint was trained on must be the data's, in the same order.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import UserError


def check_classes(trained: list[str], data: list[str], ckpt_path: str) -> None:
    """Labels are indices: a folder whose classes are named or ordered differently would be scored
    against the wrong classes."""
    if trained and data and list(trained) != list(data):
        pairs = enumerate(zip(trained, data, strict=False))
        diff = next((i for i, (a, b) in pairs if a != b), min(len(trained), len(data)))
        raise UserError(
            f"the data's classes {data[:5]}{'...' if len(data) > 5 else ''} are not the {len(trained)} classes "
            f"checkpoint {ckpt_path!r} was trained on {trained[:5]}{'...' if len(trained) > 5 else ''} "
            f"(first difference at index {diff}); evaluate on data with the same class folders"
        )


def evaluate(cfg: DictConfig) -> dict[str, float]:
    from vitlab.cli.eval_plans import eval_plan
    from vitlab.evaluation import seg_probe, tasks
    from vitlab.evaluation.tta import score_with_tta
    from vitlab.training.run import build

    plan = eval_plan(cfg)  # the checkpoint read once, or model.pretrained's weights resolved once
    if plan.module is None:  # model.pretrained=<timm name>: timm's weights, frozen features only
        return write_metrics(plan, tasks.probe_pretrained(plan.probe, plan.pretrained))
    module, task = plan.module, plan.probe.task
    mc = module.model.cfg
    datamodule = build.build_datamodule(plan.data)
    masks = task == "segmentation"  # the masks' classes are the probe's own, not the checkpoint's
    if masks:  # (data=segmentation renders its canvases in either channel count)
        seg_probe.check_channels(mc.in_chans, datamodule.channels)
    if mc.in_chans != datamodule.channels or (not masks and mc.num_classes not in (0, datamodule.num_classes)):
        raise UserError(  # num_classes 0: an encoder
            f"checkpoint expects {mc.num_classes} classes and {mc.in_chans} channels, but the data has "
            f"{datamodule.num_classes} classes and {datamodule.channels} channels"
        )
    datamodule.setup("test")
    if not masks:
        check_classes(module.hparams.get("class_names") or [], getattr(datamodule, "class_names", []), plan.ckpt_path)
    if task != "test":
        teachers = [(t.name, t.ckpt_path, t.module.model, teacher_data(t)) for t in plan.teachers]
        return write_metrics(
            plan, tasks.probe_checkpoint(plan.probe, plan.ckpt_path, module.model, datamodule, teachers)
        )
    return write_metrics(plan, score_with_tta(plan.tester, module, datamodule, plan.tta))


def teacher_data(teacher):
    """The data module of a teacher probed beside its student: the student's images as the teacher takes them."""
    from vitlab.training.run import build

    datamodule = build.build_datamodule(teacher.data)
    channels = teacher.module.model.cfg.in_chans
    if channels != datamodule.channels:
        raise UserError(
            f"teacher {teacher.ckpt_path!r} takes {channels}-channel images and the data has {datamodule.channels}: "
            "give teacher=false to evaluate the student alone"
        )
    datamodule.setup("test")
    return datamodule


def write_metrics(plan, metrics: dict | None) -> dict:
    if metrics is None:  # a process other than rank 0 of a frozen-feature task: rank 0 reports
        return {}
    weights = {"ckpt_path": str(plan.ckpt_path)} if plan.ckpt_path else {"pretrained": plan.pretrained.source}
    metrics = metrics | weights
    out = plan.output_dir / "metrics.json"
    out.write_text(json.dumps(metrics, indent=2))
    print(f"wrote {out}", flush=True)
    return metrics


@entry_point("eval")
def main(cfg: DictConfig) -> dict[str, float]:
    return evaluate(cfg)


if __name__ == "__main__":
    main()
