"""Each bad input of issue 10's "Tracebacks" list, through the command a user types: exit 2, one
line naming the input and what to do, no traceback, and an earlier run's files untouched. And the
other half of the policy: a bug in our code keeps its traceback and exits 1."""

import io
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import earlier_run, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A digits checkpoint from a one-epoch run."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    r = run_cli("train", "trainer.max_epochs=1", "data.batch_size=256", "test=false", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "checkpoints" / "last.ckpt"


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
            "error: trainer: `max_epochs` must be a non-negative integer or -1. You passed in -2.",
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
            ["data=cifar10", "data.std=[0,0,0]", "data.download=false"],
            "error: data.std [0, 0, 0] must be positive (images are divided by it), or null",
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
]


def _check(r, message: str, before: dict) -> None:
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr[-3000:]
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line(ckpt, tmp_path, case):
    before = earlier_run(tmp_path)
    module, args, message = _cases(tmp_path, ckpt)[case]
    _check(run_cli(module, *args, cwd=tmp_path), message, before)


def test_unwritable_run_directory(unwritable, tmp_path):
    before = earlier_run(tmp_path)
    run = unwritable / "run"
    r = run_cli("train", f"hydra.run.dir={run}", cwd=tmp_path)
    _check(r, f"error: run directory '{run}' cannot be written (", before)
    assert "choose a writable hydra.run.dir or paths.log_dir" in r.stderr


def test_unwritable_working_directory(unwritable):
    r = run_cli("train", cwd=unwritable)
    _check(r, f"error: output directory '{unwritable / 'outputs'}' cannot be written (", {})


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
        _check(r, f"error: cannot write checkpoint {best} (No space left on device); no epoch_000.ckpt was written", {})
        assert not list((run / "checkpoints").iterdir())  # no partial or temporary file
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_wandb_without_a_login_and_not_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc, no wandb settings
    before = earlier_run(tmp_path)
    r = run_cli("train", "logger=wandb", "trainer.max_epochs=1", cwd=tmp_path, env=env, replace_env=True)
    _check(r, "error: logger=wandb needs a W&B login: run `wandb login`, set WANDB_API_KEY", before)


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
        "train", "debug=fdr", "+callbacks.bug._target_=tests.helpers.BugInForward", f"hydra.run.dir={tmp_path / 'r'}"
    )
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ValueError: planted bug in forward" in r.stderr
    assert not r.stderr.startswith("error:")
