"""Stopping on a signal, in one process and in two: Ctrl-C, SIGTERM, SIGUSR1 or SIGUSR2, to the process, to one
rank or to the whole process group (loader workers included). Every rank stops after the same step, one checkpoint
is written, the run exits with 128 + the signal's number naming it and the command that resumes it, and the
resumed run equals the uninterrupted one bit for bit."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.commands import ROOT, replaced, run_cli
from tests.helpers.configs import RESUMABLE, extra_callback
from tests.helpers.images import image_tree
from tests.helpers.runs import assert_close_run, assert_same_run, interrupt, resume, trained

DIGITS = RESUMABLE
TWO = ["trainer=ddp_cpu", "trainer.devices=2"]  # two CPU processes (gloo)


def folder(data_dir) -> list[str]:
    """The uint8 pipeline with loader workers and every random augmentation: repeated augmentation (3 copies of
    each image, on different processes), timm's RandAugment (numpy's draws too), colour jitter and grayscale in the
    workers, per-pixel random erasing of up to 2 boxes on the device, timm's MixUp/CutMix per image in the module.
    72 images of 3 classes: 9 steps of 8 per epoch."""
    return [
        "data=imagefolder",
        f"data.data_dir={data_dir}",
        "data.batch_size=8",
        "data.num_workers=2",
        "model.img_size=8",
        "data.repeated_aug=3",
        "data.train_transform.auto_augment=rand-m9-mstd0.5-inc1",
        "data.train_transform.color_jitter=0.3",
        "data.train_transform.grayscale_prob=0.2",
        "data.train_transform.random_erasing=0.5",
        "data.train_transform.erasing_mode=pixel",
        "data.train_transform.erasing_count=2",
        "objective.mixup.mixup_alpha=0.8",
        "objective.mixup.cutmix_alpha=1.0",
        "objective.mixup.mode=elem",
        *[o for o in RESUMABLE if not o.startswith(("data.", "callbacks"))],
    ]


# Fake images held on the device (data.on_device=auto), shifted, flipped and erased there, then MixUp/CutMix per image:
# 288 images of 16 px, 9 steps of 32 an epoch.
ON_DEVICE = [
    "data=fake",
    "data.num_train=288",
    "data.batch_size=32",
    "model.img_size=16",
    "model.patch_size=8",
    "++data.train_transform.shift=2",
    "++data.train_transform.hflip=0.5",
    "++data.train_transform.random_erasing=0.5",
    "++data.train_transform.erasing_mode=pixel",
    "objective.mixup.mixup_alpha=0.8",
    "objective.mixup.cutmix_alpha=1.0",
    *[o for o in RESUMABLE if not o.startswith("data.")],
]


def two_sizes(data_dir) -> list[str]:
    """folder()'s pipeline at two sizes (issue 44): 8 and 12 px, global batches of 8 and 4, timm's constant
    schedule, position embeddings resampled per batch; one copy of each image (72: 12 batches a process an
    epoch)."""
    return [
        *replaced(folder(data_dir), "data.repeated_aug=0"),
        "model.dynamic_img_size=true",
        "data.train_img_sizes=[8,12]",
        "data.train_batch_sizes=[8,4]",
        *extra_callback("sizes", "RecordTrainSizes"),
    ]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return image_tree(tmp_path_factory.mktemp("images"), classes=("a", "b", "c"), per_class=24, size=(12, 12))


def _run(tmp_path_factory, args):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    r = run_cli("train", *args, f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return trained(tmp_path_factory, "resumable", *DIGITS)  # test_reliability.py's too


@pytest.fixture(scope="module")
def digits_two(tmp_path_factory):
    return trained(tmp_path_factory, "resumable-two", *DIGITS, *TWO)  # test_fresh_processes.py's too


@pytest.fixture(scope="module")
def on_device(tmp_path_factory):
    return _run(tmp_path_factory, ON_DEVICE)


@pytest.fixture(scope="module")
def folder_one(tmp_path_factory, images):
    return _run(tmp_path_factory, folder(images))


@pytest.fixture(scope="module")
def folder_two(tmp_path_factory, images):
    return _run(tmp_path_factory, [*folder(images), *TWO])


@pytest.mark.parametrize(
    "signum, step, group", [("SIGINT", 4, False), ("SIGTERM", 8, True), ("SIGUSR1", 11, True), ("SIGUSR2", 15, True)]
)
def test_one_process_stops_and_resumes_exactly(digits, tmp_path, signum, step, group):
    """Ctrl-C, SIGTERM, and Slurm's (SIGUSR1, its --signal default) and submitit's (SIGUSR2) warnings of a time limit
    or pre-emption, to the process or to its whole group: stopped after the step, resumed bit for bit."""
    command = interrupt(DIGITS, tmp_path, signum, step, group=group)
    assert_same_run(digits, resume(command, tmp_path))


def test_a_signal_at_the_epoch_boundary_stops_after_the_next_step_and_resumes_exactly(digits, tmp_path):
    """Landed exactly between epoch 1's last step (9) and epoch 2's first, once its validation and checkpoint are
    done (issue 41): the checkpoint is written after step 10 and the resumed run is the uninterrupted one. (The
    sweep below lands it at the next epoch's start.)"""
    command = interrupt(DIGITS, tmp_path, "SIGINT", 9, group=False, hook="on_train_epoch_end")
    assert_same_run(digits, resume(command, tmp_path))


def test_a_sweep_stopped_at_an_epoch_boundary_calls_its_job_interrupted_with_the_command_that_resumes_it(tmp_path):
    """Ctrl-C between job 0's first and second epochs (issue 41): the sweep ends with its table, and summary.json
    lists the job as interrupted with its resume command, the one the last line gives."""
    kill = extra_callback("kill", "SignalAtStep", step=9, signum="SIGINT", job=0, hook="on_train_epoch_start")
    sweep = tmp_path / "sweep"
    r = run_cli("train", "-m", "seed=1,2", *DIGITS, *kill, f"hydra.sweep.dir={sweep}", own_group=True)
    assert r.returncode == 130, r.stderr[-3000:]
    (row,) = json.loads((sweep / "summary.json").read_text())
    assert row["status"] == "interrupted" and row["overrides"][0] == "seed=1"
    assert row["resume"] == r.stderr.strip().splitlines()[-1].split("resume with: ")[1]
    assert row["resume"].endswith(f"hydra.mode=RUN ckpt_path={sweep / '0' / 'checkpoints' / 'interrupted.ckpt'}")
    assert "sweep summary" in r.stdout and "interrupted" in r.stdout


def test_data_held_on_the_device_resumes_exactly(on_device, tmp_path):
    """The on-device shift, flip and erasing draws (the datamodule's generator, checkpointed) resume mid-epoch."""
    command = interrupt(ON_DEVICE, tmp_path, "SIGTERM", 12)
    assert_same_run(on_device, resume(command, tmp_path))


@pytest.mark.parametrize("signum, step", [("SIGINT", 4), ("SIGTERM", 12)])
def test_group_signal_with_loader_workers_resumes_exactly(folder_one, images, tmp_path, signum, step):
    command = interrupt(folder(images), tmp_path, signum, step)
    assert_same_run(folder_one, resume(command, tmp_path))


@pytest.fixture(scope="module")
def sizes_two(tmp_path_factory, images):
    return _run(tmp_path_factory, [*two_sizes(images), *TWO])


def test_two_sizes_on_two_processes_resume_exactly_replaying_the_sizes(sizes_two, images, tmp_path):
    """Every step one size on both processes (timm's schedule, from the run's seed), both sizes trained; stopped
    mid-epoch, the resumed run trains the same sizes at the same steps and ends bit for bit the uninterrupted run."""
    full = [json.loads((sizes_two / f"sizes.{rank}.json").read_text()) for rank in (0, 1)]
    assert full[0] == full[1]
    assert {(h, w, n) for _, h, w, n in full[0]} == {(8, 8, 4), (12, 12, 2)}  # 8 and 4 images split over 2
    assert [s for s, *_ in full[0]] == list(range(len(full[0])))  # one batch a step
    command = interrupt([*two_sizes(images), *TWO], tmp_path, "SIGTERM", 7)
    resumed = resume(command, tmp_path)
    assert_same_run(sizes_two, resumed)
    again = json.loads((resumed / "sizes.0.json").read_text())
    first, per_epoch = again[0][0], len(full[0]) // 3
    assert first > 7 and first % per_epoch and again == full[0][first:]  # mid-epoch; from there, the same sizes


@pytest.mark.parametrize("signum, step", [("SIGINT", 5), ("SIGTERM", 13)])
def test_two_processes_stop_together_and_resume_exactly(digits_two, tmp_path, signum, step):
    command = interrupt([*DIGITS, *TWO], tmp_path, signum, step)
    assert_same_run(digits_two, resume(command, tmp_path))


@pytest.mark.parametrize("count", [1])
def test_two_processes_stopped_mid_epoch_go_on_on_another_count_as_the_uninterrupted_run(digits_two, tmp_path, count):
    """Issue 78: the global order, each image's shift and each sample's stochastic depth are the global batch's,
    whichever process holds it: resumed on `count` processes the run is the two processes' up to reduction order."""
    command = interrupt([*DIGITS, *TWO], tmp_path, "SIGTERM", 13)
    resumed = resume(command.replace("trainer.devices=2", f"trainer.devices={count}"), tmp_path)
    assert f"written by 2 processes, resumed on {count}: exact" in (resumed / "train.log").read_text()
    assert_close_run(digits_two, resumed)


def test_a_signal_to_one_rank_stops_every_rank(digits_two, tmp_path):
    command = interrupt([*DIGITS, *TWO], tmp_path, "SIGUSR1", 10, group=False, rank=1)
    assert_same_run(digits_two, resume(command, tmp_path))


def test_two_processes_with_loader_workers_resume_exactly(folder_two, images, tmp_path):
    command = interrupt([*folder(images), *TWO], tmp_path, "SIGTERM", 7)
    assert_same_run(folder_two, resume(command, tmp_path))


@pytest.mark.parametrize("two", [False, True])
def test_one_signal_delivered_three_times_at_once_is_one_stop_that_saves_and_resumes_exactly(
    digits, digits_two, tmp_path, two
):
    """GNU timeout forwards a SIGTERM to its child and again to the group, torchrun's agent and srun forward it to
    workers the scheduler has signalled already: three copies to the group within a millisecond are the one stop
    they are (issue 53), in one process and in two."""
    command = interrupt([*DIGITS, *(TWO if two else [])], tmp_path, "SIGTERM", 6, times=3)
    assert_same_run(digits_two if two else digits, resume(command, tmp_path))


@pytest.mark.parametrize(
    "signum, said", [("SIGINT", "Ctrl-C again (a second later)"), ("SIGTERM", "a second SIGTERM (or Ctrl-C) a second")]
)
def test_a_second_signal_stops_at_once(tmp_path, signum, said):
    """The first signal asks for a checkpoint after the step; a second, a second later or more, stops at once, by the
    kernel, also where the step never ends (here the one after the first signal sleeps for ten minutes, as a model
    too big for the machine swaps): the notice of the first says so, and nothing is saved."""
    killer = extra_callback("kill", "SignalAtStep", step=4, signum=signum, group=True)
    stuck = extra_callback("stuck", "SignalAgainWhenStuck", step=4, signum=signum)
    started = time.time()
    r = run_cli("train", *DIGITS, *killer, *stuck, f"hydra.run.dir={tmp_path / 'r'}", own_group=True)
    assert r.returncode == -getattr(signal, signum)  # ended by the signal itself, nothing more run
    assert time.time() - started < 300
    assert "stops at once, without saving" in r.stderr and said in r.stderr
    assert not (tmp_path / "r" / "checkpoints" / "interrupted.ckpt").exists()


def test_loader_workers_leave_group_signals_to_the_main_process_and_end_with_it(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, subprocess, time
        import torch
        from torch.utils.data import DataLoader, Dataset
        from vitlab.utils.signals import ignore_stop_signals

        class Slow(Dataset):
            def __len__(self):
                return 400
            def __getitem__(self, i):
                time.sleep(0.005)
                return i

        loader = DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True,
                            worker_init_fn=lambda _: ignore_stop_signals())
        batches = iter(loader)
        next(batches)
        for name in ("TERM", "INT", "USR1", "USR2"):  # to the whole group, from another process
            signal.signal(getattr(signal, "SIG" + name), lambda signum, _: print("main process:", signum))
            subprocess.run(["kill", "-" + name, "--", f"-{os.getpgid(0)}"], start_new_session=True, check=True)
        print(sum(len(next(batches)) for _ in range(20)), "images after the signals")
        # Exiting with the workers alive: Python's exit sends them SIGTERM, which they obey from their parent.
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        *(f"main process: {signum}" for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)),
        "80 images after the signals",
    ]
