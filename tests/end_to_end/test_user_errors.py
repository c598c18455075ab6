"""Each bad input of issue 10's and issue 20's lists, through the command a user types: exit 2, one line naming
the input and what is allowed, no traceback, an earlier run's files untouched and no new run directory left
behind. And the other half of the policy: a bug in our code keeps its traceback and exits 1. Issue 34's catalog:
test_user_errors_commands.py (the other commands' keys, export, pack) and test_user_errors_launch.py (Trainer
values, processes, sweeps, launchers)."""

import io
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.commands import assert_refused, run_cli
from tests.helpers.images import image_tree
from tests.helpers.runs import digits_checkpoint, earlier_run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return digits_checkpoint(tmp_path_factory)


@pytest.fixture
def unwritable(tmp_path):
    """A directory nobody may create files in, root included (immutable flag); skipped where neither
    chattr nor permissions can make one."""
    d = tmp_path / "locked"
    d.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
    else:
        d.chmod(0o555)
    try:
        (d / "probe").touch()
        pytest.skip("cannot make an unwritable directory here")
    except OSError:
        pass
    yield d
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    d.chmod(0o755)


def _truncated_jpeg(path: Path) -> Path:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 48, 3), dtype=np.uint8)).save(buf, "JPEG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def _bomb_png(path: Path) -> Path:
    """A valid PNG header that declares 20000x12000 pixels (PIL refuses it before decoding anything)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    b = bytearray(buf.getvalue())
    b[16:24] = struct.pack(">II", 20000, 12000)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])) & 0xFFFFFFFF)
    path.write_bytes(bytes(b))
    return path


def _cases(tmp: Path, ckpt: Path) -> dict:
    """case -> (command, args, the one line it must print)."""
    images = tmp / "images"
    images.mkdir()
    trunc_ckpt = tmp / "trunc.ckpt"
    trunc_ckpt.write_bytes(ckpt.read_bytes()[:100_000])
    (tmp / "a_file").write_text("not a directory")
    (tmp / "model.onnx").write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x052.14.1")  # how an ONNX file begins
    (tmp / "metrics.json").write_text('{"test/acc": 0.5}')
    return {
        "predict a directory": (
            "predict",
            [f"ckpt_path={ckpt}", f"images=[{images}]"],
            f"error: image '{images}' is a directory; give image files (for example {images}/<name>.jpg)",
        ),
        "visualize a directory": (
            "visualize",
            [f"ckpt_path={ckpt}", f"image={images}"],
            f"error: image '{images}' is a directory; give image files (for example {images}/<name>.jpg)",
        ),
        "predict a truncated JPEG": (
            "predict",
            [f"ckpt_path={ckpt}", f"images=[{_truncated_jpeg(tmp / 'cut.jpg')}]"],
            f"error: image file '{tmp / 'cut.jpg'}' cannot be decoded (OSError: image file is truncated",
        ),
        "a decompression bomb": (
            "predict",
            [f"ckpt_path={ckpt}", f"images=[{_bomb_png(tmp / 'huge.png')}]"],
            f"error: image file '{tmp / 'huge.png'}' is too large to decode safely (Image size (240000000 pixels)",
        ),
        "run dir is a file": (
            "train",
            [f"hydra.run.dir={tmp / 'a_file'}"],
            f"error: hydra.run.dir '{tmp / 'a_file'}' is a file, not a directory; give a new directory",
        ),
        "unknown timm name in parity": (
            "parity",
            ["model.timm_name=vit_bogus_patch16_224"],
            "error: 'vit_bogus_patch16_224' is neither a weights file nor a timm model name; did you mean",
        ),
        "unknown timm name as pretrained": (
            "train",
            ["model.pretrained=vit_bas_patch16_224"],
            "error: 'vit_bas_patch16_224' is neither a weights file nor a timm model name; did you mean "
            "['vit_base_patch16_224'",
        ),
        "crop scale out of order": (
            "train",
            ["data=fake", "data.train_transform.random_resized_crop=[1.5,0.2]"],
            "error: data.train_transform.random_resized_crop [1.5, 0.2] must be [min_scale, max_scale] with "
            "0 < min_scale <= max_scale <= 1",
        ),
        "negative max_epochs": (
            "train",
            ["trainer.max_epochs=-2"],
            "error: trainer.max_epochs -2 must be an integer >= -1 or null",
        ),
        "ckpt_path is a directory": (
            "train",
            [f"ckpt_path={ckpt.parent}"],
            f"error: ckpt_path '{ckpt.parent}' is a directory; give a checkpoint file (.ckpt) in it",
        ),
        "truncated checkpoint": (
            "eval",
            [f"ckpt_path={trunc_ckpt}"],
            f"error: ckpt_path '{trunc_ckpt}' is corrupt or incomplete (cut short while copying or saving?)",
        ),
        "zero std": (
            "train",
            ["data=cifar10", "data.std=[0,0,0]", "data.download=false", "data.data_dir=."],  # (a missing one: refused)
            "error: data.std [0, 0, 0] must be positive (images are divided by it), or null",
        ),
        # issue 20: values checked against the types their config declares, before anything is built
        "negative seed": ("train", ["seed=-5"], "error: seed -5 must be an integer in [0, 4294967295]"),
        "nan learning rate": ("train", ["optim.lr=nan"], "error: optim.lr nan must be a number >= 0"),
        "max_epochs not a number": (
            "train",
            ["trainer.max_epochs=abc"],
            "error: trainer.max_epochs 'abc' must be an integer >= -1 or null",
        ),
        "batch_size not a number": (
            "train",
            ["data.batch_size=abc"],
            "error: data.batch_size 'abc' must be 'auto' or an integer >= 1",
        ),
        "fractional batch_size": (
            "train",
            ["data.batch_size=8.5"],
            "error: data.batch_size 8.5 must be 'auto' or an integer >= 1",
        ),
        "export to a place nobody may write": (
            "export",
            [f"ckpt_path={ckpt}", "output=/sys/model.onnx"],
            "error: output '/sys/model.onnx' cannot be written (",
        ),
        "predict without images": ("predict", [f"ckpt_path={ckpt}"], "error: images must be given: images=..."),
        "misspelt optimizer key": (
            "train",
            ["optim.lrr=1"],
            "error: optim.lrr is not a key of optim; its keys: ['betas', 'decay_tokens', 'eps', 'fused',",
        ),
        "model=_base": (
            "train",
            ["model=_base"],
            "error: model=_base holds the defaults every model builds on, not a model; choose one of ['eva02_s14',",
        ),
        "an ONNX model as checkpoint": (
            "train",
            ["ckpt_path=model.onnx"],
            "error: ckpt_path 'model.onnx' is not a checkpoint (a .ckpt file vitlab.train writes in "
            "<run>/checkpoints/); it holds another kind of file",
        ),
        "a JSON file as checkpoint": (
            "eval",
            ["ckpt_path=metrics.json"],
            "error: ckpt_path 'metrics.json' is not a checkpoint",
        ),
        "a non-ASCII path": (
            "train",
            ["data.data_dir=/data/phötos"],
            "error: data.data_dir=/data/phötos: an unquoted value may hold only ASCII characters; quote it for "
            """Hydra as well as for the shell: 'data.data_dir="/data/phötos"'""",
        ),
        "resume with another batch size": (
            "train",
            [f"ckpt_path={ckpt}"],
            f"error: ckpt_path '{ckpt}' was trained with data.batch_size=256 (this run: 64): its place in the epoch "
            "and its learning-rate schedule count steps of 256 images; resume with data.batch_size=256",
        ),
        "several devices and no GPU": (
            "train",
            ["model=vit_b16", "trainer.devices=4"],
            "error: trainer.devices=4 asks for 4 devices and this machine has no GPU: that would train in 4 CPU "
            "processes; ask for them with trainer=ddp_cpu trainer.devices=4",
        ),
        # issue 53's quiet mistakes: accepted and doing nothing, or refused without the fix
        "checkpointing beyond the depth": (
            "train",
            ["model.grad_checkpointing=9"],
            "error: grad_checkpointing 9 recomputes every 9th block and the model has 4: none would be; give N from 1 "
            "to 4, true (every block), false or selective",
        ),
        "clipping without a value": (
            "train",
            ["trainer.gradient_clip_algorithm=norm"],
            "error: trainer.gradient_clip_algorithm=norm needs trainer.gradient_clip_val, the norm the gradients are "
            "clipped to (timm's --clip-grad, e.g. 1.0), not None: without one nothing is clipped",
        ),
        "dino with classes": (
            "train",
            ["objective=dino", "model.num_classes=10"],
            "error: objective=dino trains an encoder without a head: model.num_classes is 10; set model.num_classes=0",
        ),
    }


CASES = [
    "predict a directory",
    "visualize a directory",
    "predict a truncated JPEG",
    "a decompression bomb",
    "run dir is a file",
    "unknown timm name in parity",
    "unknown timm name as pretrained",
    "crop scale out of order",
    "negative max_epochs",
    "ckpt_path is a directory",
    "truncated checkpoint",
    "zero std",
    "negative seed",
    "nan learning rate",
    "max_epochs not a number",
    "batch_size not a number",
    "fractional batch_size",
    "export to a place nobody may write",
    "predict without images",
    "misspelt optimizer key",
    "model=_base",
    "an ONNX model as checkpoint",
    "a JSON file as checkpoint",
    "a non-ASCII path",
    "resume with another batch size",
    "several devices and no GPU",
    "checkpointing beyond the depth",
    "clipping without a value",
    "dino with classes",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line(ckpt, tmp_path, case):
    if case == "several devices and no GPU" and torch.cuda.is_available():
        pytest.skip("a machine with a GPU trains on it")
    before = earlier_run(tmp_path)
    module, args, message = _cases(tmp_path, ckpt)[case]
    assert_refused(run_cli(module, *args, cwd=tmp_path), message, before, tmp_path / "outputs")


@pytest.mark.parametrize(
    "args, said",
    [
        (["model.depth=three"], "error: depth 'three' must be an integer"),
        (["trainer.gradient_clip_algorithm=value"], "error: trainer.gradient_clip_algorithm=value needs"),
        (["-m", "hparams_search=digits_optuna", "hydra.sweeper.pruner=medain"], "error: hydra.sweeper.pruner='medain'"),
        (["seed=-1"], "error: seed -1 must be an integer in"),
        (["trainer.max_epochs=abc"], "error: trainer.max_epochs 'abc' must be an integer >= -1 or null"),
        (["trainer.accumulate_grad_batches=0"], "error: trainer.accumulate_grad_batches 0 must be an integer >= 1"),
        (["data.batch_size=0"], "error: data.batch_size 0 must be 'auto' or an integer >= 1"),
        (["optim.lr=-1"], "error: optim.lr -1 must be a number >= 0"),
        (["scheduler.warmup_epochs=-1"], "error: scheduler.warmup_epochs -1 must be a number >= 0"),
    ],
)
def test_a_bad_value_is_refused_before_torch_or_lightning_is_imported(tmp_path, args, said):
    """Issue 53: a refusal of a value comes at once, not after the ~5 s Lightning's import takes. Here torch and
    Lightning cannot be imported at all (a package of each name that fails on import comes first on the path): the
    refusal is still the one line."""
    for name in ("torch", "lightning"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} imported')\n")
    r = subprocess.run(
        [sys.executable, "-m", "vitlab.train", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_refused(r, said)


def test_a_finished_run_is_not_resumed(ckpt, tmp_path):
    """`ckpt_path=last` after a run that ended trains nothing: said in one line, not a test of the old weights
    and a warning that the metric was not logged. (The run that ended: the suite's one-epoch digits run, copied
    where this directory's `last` looks.)"""
    shutil.copytree(ckpt.parent.parent, tmp_path / "outputs" / "train" / "runs" / "ended")
    before = {p: p.read_bytes() for p in (tmp_path / "outputs").rglob("*") if p.is_file()}
    (last,) = (tmp_path / "outputs").rglob("last.ckpt")
    again = ["ckpt_path=last", "trainer.max_epochs=1", "data.batch_size=256"]  # the copied run's epochs and batch
    r = run_cli("train", *again, cwd=tmp_path)
    message = f"error: ckpt_path '{last}' is of a run that had finished (1 of 1 epochs): nothing is left to train"
    assert_refused(r, message, before, tmp_path / "outputs")
    assert f"python -m vitlab.eval ckpt_path={last}" in r.stderr


def test_a_bad_image_in_any_split_stops_the_run_before_the_first_step(tmp_path):
    image_tree(tmp_path / "photos", splits=("train", "val", "test"))
    (tmp_path / "photos" / "test" / "b" / "scan.png").write_bytes(b"not an image")
    before = earlier_run(tmp_path)
    r = run_cli("train", "data=imagefolder", "data.data_dir=photos", "data.batch_size=2", cwd=tmp_path)
    message = (
        "error: image file 'photos/test/b/scan.png' cannot be decoded (UnidentifiedImageError: cannot identify image "
        "file 'photos/test/b/scan.png'); remove or replace it"
    )
    assert_refused(r, message, before, tmp_path / "outputs")


def test_every_image_kind_is_read_and_other_files_are_counted(tmp_path):
    """One list of image kinds (images.IMAGE_EXTENSIONS) for folders and predict alike: a GIF trains, a note
    beside the images is counted in the log line."""
    photos = image_tree(tmp_path / "photos", per_class=2)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(photos / "train" / "a" / "anim.gif")
    (photos / "train" / "a" / "notes.txt").write_text("shot in May")
    (photos / "val" / "b" / "README").write_text("")
    r = run_cli("train", "data=imagefolder", "data.data_dir=photos", "data.batch_size=2", "debug=fdr", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "photos: 5 train, 4 val images in 2 classes; skipped, not of a kind read: 1 .txt, 1 README" in r.stdout


def test_parity_with_pretrained_weights_offline_says_so_at_once(tmp_path):
    """No network (the hub's address refuses): one line naming the weights and the ways out, without
    huggingface_hub's minute of retries first."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # conftest sets it for every test
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    r = run_cli("parity", "pretrained=true", cwd=tmp_path, env=env, replace_env=True)
    message = (
        "error: cannot fetch timm weights 'vit_base_patch16_224': no network and not in the Hugging Face cache "
        f"({tmp_path / 'hf'}); run once online, or give a local .safetensors/.pth file"
    )
    assert_refused(r, message, {}, tmp_path / "outputs")


def test_sweep_jobs_do_not_print_lightnings_srun_hint(tmp_path):
    """Where Slurm is installed Lightning tells every Trainer to use srun; vitlab's Slurm launcher starts the
    processes itself (hydra/launcher=slurm), so nobody can act on it."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    r = run_cli("train", "-m", "debug=fdr", "optim.lr=1e-3,3e-4", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "srun" not in r.stdout + r.stderr


def test_unwritable_run_directory(unwritable, tmp_path):
    before = earlier_run(tmp_path)
    run = unwritable / "run"
    r = run_cli("train", f"hydra.run.dir={run}", cwd=tmp_path)
    assert_refused(r, f"error: run directory '{run}' cannot be written (", before)
    assert "choose a writable hydra.run.dir or paths.log_dir" in r.stderr


@pytest.mark.parametrize("fmt, name", [("timm", "timm"), ("onnx", "model.onnx"), ("pt2", "model.pt2")])
def test_export_where_nobody_may_write_is_one_line(ckpt, unwritable, tmp_path, fmt, name):
    """format=timm refuses an output it cannot write as ONNX and pt2 do (issue 53, point 13): one line, exit 2, and
    nothing left behind, neither in the folder nor a run directory."""
    out = unwritable / "sub" / name
    r = run_cli("export", f"ckpt_path={ckpt}", f"format={fmt}", f"output={out}", cwd=tmp_path)
    assert_refused(r, f"error: output '{out}' cannot be written (", {}, tmp_path / "outputs")
    assert r.stderr.strip().endswith("; choose another output")
    assert list(unwritable.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["locked"]


def test_unwritable_working_directory(unwritable):
    r = run_cli("train", cwd=unwritable)
    assert_refused(r, f"error: output directory '{unwritable / 'outputs'}' cannot be written (", {})


def test_full_disk_during_a_checkpoint_write(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        run = disk / "run"
        r = run_cli("train", f"hydra.run.dir={run}", "trainer.max_epochs=1", cwd=tmp_path)
        best = run / "checkpoints" / "epoch_000.ckpt"
        assert_refused(
            r, f"error: cannot write checkpoint {best} (No space left on device); no epoch_000.ckpt was written", {}
        )
        assert not list((run / "checkpoints").iterdir())  # no partial or temporary file
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_wandb_without_a_login_and_not_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc, no wandb settings
    before = earlier_run(tmp_path)
    r = run_cli("train", "logger=wandb", "trainer.max_epochs=1", cwd=tmp_path, env=env, replace_env=True)
    assert_refused(r, "error: logger=wandb needs a W&B login: run `wandb login`, set WANDB_API_KEY", before)


def test_a_killed_save_leaves_no_temporary_behind_once_resumed(ckpt, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(ckpt.parent.parent, run)
    dead = subprocess.run(["python3", "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = run / "checkpoints" / f".last.ckpt.tmp-{int(dead.stdout)}"  # what kill -9 mid-save leaves
    stale.write_bytes(b"x" * 1000)
    r = run_cli(
        "train", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=2", "data.batch_size=256",
        "test=false", f"hydra.run.dir={tmp_path / 'resumed'}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert not stale.exists() and "removed 1 unfinished checkpoint file(s) left by a killed save" in r.stdout


def test_a_bug_keeps_its_traceback_and_exits_1(tmp_path):
    """A ValueError raised inside the model's forward is not the user's input: no one-line disguise."""
    r = run_cli(
        "train",
        "debug=fdr",
        "+callbacks.bug._target_=tests.helpers.callbacks.BugInForward",
        f"hydra.run.dir={tmp_path / 'r'}",
    )
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ValueError: planted bug in forward" in r.stderr
    assert not r.stderr.startswith("error:")
