"""objective=dino as users run it (experiment=dino_pretrain_digits, 2 epochs of 19 steps, with DINOv3's Gram
anchoring from step 3, its teacher refreshed every 5 steps): two processes (DDP) and FSDP, each interrupted by SIGTERM
mid-epoch (in the epoch whose last layer is frozen) and resumed bit for bit by the command it prints (the views drawn on
the device, the teacher, the Gram teacher, the centre, the EMA schedule, each loss term's log); the run ends with the
teacher's k-NN accuracy on the test split, and `vitlab.eval task=knn` reads the checkpoint's teacher to the same
number."""

import csv
import json

import pytest

from tests.helpers.commands import assert_refused, replaced, run_cli
from tests.helpers.runs import assert_close_run, assert_same_run, interrupt, resume

DINO = [
    "experiment=dino_pretrain_digits",
    "trainer.max_epochs=2",
    "data.batch_size=64",  # 19 steps an epoch on each of 2 processes: stopped within the first
    "trainer.deterministic=true",
    "progress_bar=none",
    "trainer.log_every_n_steps=1",
    "objective.gram.loss_weight=1",  # interrupted after step 4: between the Gram teacher's refreshes after steps 2, 7
    "objective.gram.start=3",
    "objective.gram.update_every=5",
]
DDP = ["trainer=ddp_cpu", "trainer.devices=2"]
# FSDP shards what callbacks=representation would read whole: the default callbacks, the checkpoint by the loss
FSDP = ["trainer=fsdp_cpu", "callbacks=default", "callbacks.model_checkpoint.monitor=val/loss",
        "callbacks.model_checkpoint.mode=min"]  # fmt: skip


def _run(tmp_path_factory, name, args):
    run_dir = tmp_path_factory.mktemp(name) / "run"
    r = run_cli("train", *args, f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _run(tmp_path_factory, "dino_ddp", [*DINO, *DDP])


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _run(tmp_path_factory, "dino_fsdp", [*DINO, *FSDP])


def test_two_processes_end_with_the_teachers_knn_that_vitlab_eval_reads_again(ddp, tmp_path):
    run_dir, r = ddp
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 < metrics["test/knn_top1"] <= 1 and "knn/top1" in metrics
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r["train/loss"]]
    assert len(rows) == 2 and all(float(r["train/loss_gram"]) > 0 and float(r["train/loss_koleo"]) for r in rows)
    for r in rows:  # the digits recipe's terms, each logged: DINO's + 0.1 KoLeo + 1 Gram
        terms = float(r["train/loss_dino"]) + 0.1 * float(r["train/loss_koleo"]) + float(r["train/loss_gram"])
        assert float(r["train/loss"]) == pytest.approx(terms, rel=1e-4)
    done = next(line for line in (run_dir / "train.log").read_text().splitlines() if " - done in " in line)
    assert f"test/knn_top1 {metrics['test/knn_top1']:.4f}" in done
    best = metrics["best_checkpoint"]
    e = run_cli("eval", f"ckpt_path={best}", "task=knn", f"hydra.run.dir={tmp_path / 'eval'}")
    assert e.returncode == 0, e.stderr[-3000:]
    knn = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert knn["knn/top1_k20"] == pytest.approx(metrics["test/knn_top1"], abs=1e-6)  # the teacher, both times
    # the default task (test: a classifier's accuracy) on a pretraining checkpoint: one line naming the tasks it has
    r = run_cli("eval", f"ckpt_path={best}", f"hydra.run.dir={tmp_path / 'test'}")
    assert_refused(r, f"error: checkpoint {best!r} is objective=dino pretraining (an encoder without a classifier): "
                   "evaluate its features with task=knn, task=linear or task=fewshot")  # fmt: skip
    assert not (tmp_path / "test").exists()


def test_stopped_on_two_processes_it_goes_on_on_one_saying_that_koleo_is_not_exact(ddp, tmp_path):
    """Issue 78: the recipe's KoLeo searches each image's nearest neighbour within its process's share of the batch,
    so a resume on another count says so (the views and the student's stochastic depth are the global batch's)."""
    command = interrupt([*DINO, *DDP], tmp_path, "SIGTERM", 4)
    resumed = resume(command.replace("trainer.devices=2", "trainer.devices=1"), tmp_path)
    log = (resumed / "train.log").read_text()
    assert "written by 2 processes, resumed on 1: the data order and each image's augmentation go on" in log
    assert "not exact: KoLeo's nearest neighbours are searched within each process's share of the batch" in log


def test_without_koleo_two_processes_stopped_mid_epoch_go_on_on_one_as_the_uninterrupted_two(tmp_path_factory):
    """Issue 78: DINO's views and iBOT's masks, drawn by the global batch's rows on the device, and the student's
    stochastic depth on the stacked views, so a run resumed on one process is the two processes' up to reduction
    order (one epoch)."""
    args = [*replaced(DINO, "trainer.max_epochs=1"), "objective.koleo_weight=0", "objective.ibot_weight=1", *DDP]
    full, _ = _run(tmp_path_factory, "dino_no_koleo", args)
    folder = tmp_path_factory.mktemp("dino_no_koleo_stopped")
    command = interrupt(args, folder, "SIGTERM", 4)
    resumed = resume(command.replace("trainer.devices=2", "trainer.devices=1"), folder)
    assert "written by 2 processes, resumed on 1: exact" in (resumed / "train.log").read_text()
    # the evaluation loss normalises the teacher's outputs over each evaluated batch (Sinkhorn-Knopp): its batches
    # are each process's share of the split, so it moves with the count; training, the k-NN and the weights do not
    assert_close_run(full, resumed, beside=("val/loss", "val/loss_best", "test/loss"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_mid_epoch_resumes_bit_for_bit(request, strategy, tmp_path):
    full, _ = request.getfixturevalue(strategy)
    args = [*DINO, *(DDP if strategy == "ddp" else FSDP)]
    command = interrupt(args, tmp_path, "SIGTERM", 4)
    assert_same_run(full, resume(command, tmp_path))


def test_dinos_released_checkpoint_is_evaluated_by_vitlab_eval(tmp_path):
    """A checkpoint in the form of DINO's `*_full_checkpoint.pth` (student, teacher, optimizer, epoch, args,
    dino_loss) of a digits-sized backbone: `vitlab.eval task=knn model.pretrained=<it>` probes its teacher."""
    import argparse

    import torch

    from vitlab.model import ViT, ViTConfig

    torch.manual_seed(0)
    cfg = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=0, embed_dim=64, depth=4, num_heads=4)
    teacher, student = ViT(cfg).state_dict(), ViT(cfg).state_dict()
    ckpt = {
        "student": {f"module.backbone.{k}": v for k, v in student.items()},
        "teacher": {f"backbone.{k}": v for k, v in teacher.items()},
        "epoch": 100,
        "args": argparse.Namespace(arch="vit_digits"),
        "dino_loss": {"center": torch.zeros(1, 8)},
    }
    torch.save(ckpt, tmp_path / "full_checkpoint.pth")
    args = ["task=knn", "model=vit_digits", f"model.pretrained={tmp_path / 'full_checkpoint.pth'}", "data=digits"]
    r = run_cli("eval", *args, f"hydra.run.dir={tmp_path / 'eval'}", cwd=tmp_path)  # its feature cache there
    assert r.returncode == 0, r.stderr[-3000:]
    assert "took the teacher's backbone" in (tmp_path / "eval" / "eval.log").read_text()
    assert 0 < json.loads((tmp_path / "eval" / "metrics.json").read_text())["knn/top1_k20"] <= 1
