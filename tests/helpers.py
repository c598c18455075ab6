"""What tests share: tiny model configs, running a command as a user does, files for command-line
tests, and test-only Lightning callbacks (loaded into real `python -m vitlab.train` runs via
+callbacks.X._target_)."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig

from vitlab.model import ViTConfig

ROOT = Path(__file__).resolve().parents[1]

# A short deterministic CPU run to interrupt and resume: 3 epochs x 9 steps (batch 128 of 1,257 digits), with
# stochastic depth and EMA on, so the random draws and the averaged weights are part of what must resume exactly.
RESUMABLE = [
    "trainer.max_epochs=3",
    "data.batch_size=128",
    "trainer.deterministic=true",
    "progress_bar=none",
    "model.drop_path_rate=0.1",
    "callbacks=ema",
    "callbacks.ema.update_starting_at_step=0",
    "trainer.log_every_n_steps=5",  # 27 steps in all: log the LR (compared after resuming) within them
    # the CPU's resume, also where a GPU is visible (tests/end_to_end/test_gpu.py resumes on one)
    "trainer.accelerator=cpu",
]


def tiny(**overrides) -> ViTConfig:
    """A ViT small enough for CPU tests: 32 px, patch 8 (16 patches), dim 32, depth 2, 4 heads."""
    base = dict(img_size=32, patch_size=8, in_chans=3, num_classes=7, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **overrides})


def run_cli(
    module: str,
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
    replace_env: bool = False,
    own_group: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m vitlab.<module> args` in a subprocess, output captured. `env` is added to this
    process's environment, or replaces it with `replace_env`. `own_group` starts it in a process group (and
    session) of its own, as a terminal starts a command: a signal to its group then reaches only it."""
    full_env = {**({} if replace_env else os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", f"vitlab.{module}", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=own_group,
    )


def extra_callback(name: str, target: str, **params) -> list[str]:
    """Overrides that add callbacks.<name>: the class `target` of this module, built with `params`."""
    return [
        f"+callbacks.{name}._target_=tests.helpers.{target}",
        *(f"+callbacks.{name}.{k}={v}" for k, v in params.items()),
    ]


class SignalAtStep(L.Callback):
    """Send a real signal after optimizer step `step` (mid-epoch when chosen so): to this process, or with
    `group=true` to its whole process group from another process, as Ctrl-C in a terminal, `timeout` or a
    scheduler do (loader workers and the other ranks included); under DDP only from rank `rank`. `times=2` sends
    it twice in a row; in a -m sweep, `job` picks the job that sends it. The time it was sent goes to `stamp`, when
    given."""

    def __init__(
        self,
        step: int,
        signum: str = "SIGTERM",
        group: bool = False,
        rank: int = 0,
        times: int = 1,
        stamp: str | None = None,
        job: int | None = None,
    ):
        self.step, self.signum, self.group, self.rank, self.times, self.stamp, self.job = (
            step,
            getattr(signal, signum),
            group,
            rank,
            times,
            stamp,
            job,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.job is not None and HydraConfig.get().job.num != self.job:
            return
        if self.stamp:
            Path(self.stamp).write_text(str(time.time()))
        for _ in range(self.times):
            if self.group:
                kill = ["kill", f"-{self.signum.name[3:]}", "--", f"-{os.getpgid(0)}"]
                subprocess.run(kill, check=True, start_new_session=True)  # the sender stays out of the group
            else:
                os.kill(os.getpid(), self.signum)


def assert_same_run(a: Path, b: Path) -> None:
    """Two run directories hold the same run: final weights (raw and EMA) bit for bit, and every logged value but
    timings."""
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    keys = [k for k in ma if k.startswith(("train/", "val/", "test/", "lr-")) and "per_sec" not in k]
    differ = {k: (ma[k], mb.get(k)) for k in keys if ma[k] != mb.get(k)}
    assert not differ, f"metrics of {a} and {b} differ: {differ}"
    ca, cb = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu") for d in (a, b))
    assert ca["global_step"] == cb["global_step"]
    # the checkpoint's weights, and with callbacks=ema the other set: raw (EMA kept) or average (raw kept)
    for key in ("state_dict", "current_model_state", "average_model_state"):
        if key in ca:
            assert ca[key].keys() == cb[key].keys()
            differ = [k for k in ca[key] if not torch.equal(ca[key][k], cb[key][k])]
            assert not differ, f"{key} of {a} and {b} differs in {differ}"


class SleepPerStep(L.Callback):
    """Make every training step `seconds` longer: a run slow enough to act on from outside while it trains."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


def interrupt(args, tmp_path, signum, step, group=True, rank=0) -> str:
    """`python -m vitlab.train args` stopped by `signum` after optimizer step `step` (SignalAtStep): checks the
    exit, the checkpoint and the last line, and returns the command that line gives to resume."""
    stamp = tmp_path / "sent"
    killer = extra_callback("kill", "SignalAtStep", step=step, signum=signum, group=group, rank=rank, stamp=stamp)
    killed = tmp_path / "killed"
    r = run_cli("train", *args, *killer, f"hydra.run.dir={killed}", own_group=True)
    exited = time.time()
    saved = killed / "checkpoints" / "interrupted.ckpt"
    assert r.returncode == 128 + getattr(signal, signum), r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"interrupted by {signum} at step (\d+) \(epoch (\d+)\): saved (\S+); resume with: (.*)", last
    )
    assert found, last
    assert found[3] == str(saved) and saved.is_file()
    assert int(found[1]) > step and torch.load(saved, weights_only=True)["global_step"] == int(found[1])
    assert shlex.split(found[4]) == ["python", "-m", "vitlab.train", *args, *killer, f"ckpt_path={saved}"]
    assert exited - float(stamp.read_text()) < 30  # every process gone within seconds
    return found[4]


def resume(command, tmp_path) -> Path:
    """The printed resume command, run as typed (in tmp_path, so its run directory is the only one there; the
    test callback on its command line is found on PYTHONPATH)."""
    argv = shlex.split(command)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "train" / "runs").iterdir()
    return run_dir


class NanAtStep(L.Callback):
    """Poison the batch of optimizer step `step` with NaN, so its loss is not finite."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            batch[0].fill_(torch.nan)


class ForbidSync(L.Callback):
    """Run ordinary training steps under `torch.cuda.set_sync_debug_mode("error")`: any host-device
    synchronisation raises. Each guarded window runs from the end of one step's callbacks to the end of the
    next step's (fetching, transfer, device transform, hooks, forward, backward, optimizer, scheduler). Left
    out: the first `after` steps (lazy set-up), logging steps and the step after one (reading a logged
    value must wait), and epoch ends. Put it last in the callbacks; `ForbidSync.guarded` counts the windows
    (on the class: the tests build it from the config)."""

    guarded = 0

    def __init__(self, after: int = 3):
        self.after = after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")
        step, n = trainer.global_step, trainer.log_every_n_steps  # `step` steps are done
        ordinary = step >= self.after and (step + 1) % n != 0 and step % n != 0  # the next step and this one
        if ordinary and batch_idx + 1 < trainer.num_training_batches:
            torch.cuda.set_sync_debug_mode("error")
            ForbidSync.guarded += 1

    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode("default")


class BugInForward(L.Callback):
    """Plant a bug: the model's forward raises a ValueError (which is not a user's mistake)."""

    def on_train_start(self, trainer, pl_module):
        def broken(x):
            raise ValueError("planted bug in forward")

        pl_module.model.forward = broken


class AssertCompiled(L.Callback):
    """Fail the run unless the model's forward was compiled in place (nn.Module.compile)."""

    def on_train_start(self, trainer, pl_module):
        assert pl_module.model._compiled_call_impl is not None, "compile=true did not compile the model"


# ---- files for command-line tests ------------------------------------------------------------------


def assert_refused(r, message: str, before: dict | None = None, outputs: Path | None = None, code: int = 2) -> None:
    """A command refused as the error policy says: exit `code` (2), `message` as the start of the one line on stderr,
    no traceback, the earlier run's files (`before`, from earlier_run) as they were and, given the outputs folder,
    nothing in it but them."""
    assert r.returncode == code, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr[-3000:]
    before = before or {}
    assert {p: p.read_bytes() for p in before} == before
    if outputs is not None:
        left = {p for p in outputs.rglob("*") if p.is_file()} if outputs.exists() else set()
        assert left == set(before), sorted(map(str, left - set(before)))


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small file system mounted at `path` (`options`: "size=300k", "ro,size=1m"): a full or read-only disk for
    the test; skipped where this machine cannot mount one."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def digits_checkpoint(root: Path) -> Path:
    """A digits checkpoint from a one-epoch run in `root`/run."""
    r = run_cli("train", "trainer.max_epochs=1", "data.batch_size=256", "test=false", f"hydra.run.dir={root / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "run" / "checkpoints" / "last.ckpt"


def earlier_run(root):
    """An earlier run's directory with files whose bytes must survive any failed command: returns
    {path: bytes} to compare against afterwards."""
    run = root / "outputs" / "train" / "runs" / "earlier"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"earlier checkpoint bytes")
    (run / "metrics.json").write_text('{"test/acc": 0.99}')
    (run / "config.yaml").write_text("seed: 1\n")
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def image_tree(root, classes=("a", "b"), per_class=3, size=(8, 8), splits=("train", "val"), seed=0):
    """data_dir/<split>/<class>/<i>.png of random RGB images; returns root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split in splits:
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
    return root
