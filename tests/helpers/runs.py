"""Runs several files need, trained once per pytest run (`once`, `trained`); a run interrupted and resumed, and the
whole sequence of a resume test (`assert_resumes_exactly`); two runs compared, an earlier run's files, an offline W&B
run's steps."""

import json
import os
import re
import shlex
import signal
import time
from pathlib import Path

import torch

from tests.helpers.commands import TESTS_ON_PATH, run_cli
from tests.helpers.configs import extra_callback
from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint


def assert_same_run(a: Path, b: Path) -> None:
    """Two run directories hold the same run: final weights (raw and EMA) bit for bit, and every logged value but
    timings."""
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    keys = [k for k in ma if k.startswith(("train/", "val/", "test/", "lr-")) and "per_sec" not in k]
    differ = {k: (ma[k], mb.get(k)) for k in keys if ma[k] != mb.get(k)}
    assert not differ, f"metrics of {a} and {b} differ: {differ}"
    ca, cb = (read_checkpoint(d / "checkpoints" / "last.ckpt") for d in (a, b))  # a file, or a directory of shards
    assert ca["global_step"] == cb["global_step"]
    # the checkpoint's weights, and with callbacks=ema the other set: raw (EMA kept) or average (raw kept)
    for key in ("state_dict", "current_model_state", "average_model_state"):
        if key in ca:
            assert ca[key].keys() == cb[key].keys()
            differ = [k for k in ca[key] if not torch.equal(ca[key][k], cb[key][k])]
            assert not differ, f"{key} of {a} and {b} differs in {differ}"


def assert_close_run(a: Path, b: Path, values: float = 1e-5, weights: float = 1e-4, beside: tuple = ()) -> None:
    """Two run directories hold the same run up to the order of reductions (another number of processes): every
    logged value but timings (and those named in `beside`) within `values`, the final weights (raw and EMA) within
    `weights`."""
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    keys = [
        k for k in ma if k.startswith(("train/", "val/", "test/", "lr-")) and "per_sec" not in k and k not in beside
    ]
    differ = {k: (ma[k], mb.get(k)) for k in keys if mb.get(k) is None or abs(ma[k] - mb[k]) > values}
    assert not differ, f"metrics of {a} and {b} differ: {differ}"
    ca, cb = (read_checkpoint(d / "checkpoints" / "last.ckpt") for d in (a, b))
    assert ca["global_step"] == cb["global_step"]
    for key in ("state_dict", "current_model_state", "average_model_state"):
        if key in ca:
            assert ca[key].keys() == cb[key].keys()
            far = {
                k: float((_outside_key_bias(k, ca[key][k]) - _outside_key_bias(k, cb[key][k])).abs().max())
                for k in ca[key]
                if ca[key][k].is_floating_point() and "metrics." not in k and "_best." not in k
            }  # fmt: skip  (the metrics' states: compared as logged, above)
            assert max(far.values()) <= weights, f"{key} of {a} and {b}: {max(far.items(), key=lambda kv: kv[1])}"


def _outside_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A fused qkv bias without its key third: a key bias changes no attention output (softmax is invariant to it),
    so its gradient is zero but for rounding, and AdamW turns that rounding into steps of the learning rate's size,
    which differ with the order of the reductions (docs/reliability.md#elastic-resume)."""
    if not name.endswith("attn.qkv.bias"):
        return tensor.float()
    q, _, v = tensor.float().chunk(3)
    return torch.cat([q, v])


def interrupt(args, tmp_path, signum, step, group=True, rank=0, hook=None, times=1) -> str:
    """`python -m vitlab.train args` stopped by `signum` after optimizer step `step` (SignalAtStep; `hook`: at that
    epoch boundary instead; `times`: sent that many times in a row): checks the exit, the checkpoint, the last line
    and interrupted.json beside them, and returns the command that line gives to resume."""
    stamp = tmp_path / "sent"
    at = ({"hook": hook} if hook else {}) | ({"times": times} if times != 1 else {})
    killer = extra_callback("kill", "SignalAtStep", step=step, signum=signum, group=group, rank=rank, stamp=stamp, **at)
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
    assert found[3] == str(saved) and (saved.is_file() or is_sharded_checkpoint(saved))  # a file, or shards
    assert int(found[1]) > step and read_checkpoint(saved, weights=False)["global_step"] == int(found[1])
    assert shlex.split(found[4]) == ["python", "-m", "vitlab.train", *args, *killer, f"ckpt_path={saved}"]
    said = json.loads((killed / "interrupted.json").read_text())
    assert said == {"signal": signum, "step": int(found[1]), "epoch": int(found[2]), "checkpoint": str(saved),
                    "resume": found[4]}  # fmt: skip
    assert exited - float(stamp.read_text()) < 30  # every process gone within seconds
    return found[4]


def resume(command, tmp_path) -> Path:
    """The printed resume command, run as typed (in tmp_path, so its run directory is the only one there; the
    test callback on its command line is found on PYTHONPATH)."""
    python, m, module, *args = shlex.split(command)
    assert (python, m) == ("python", "-m") and module.startswith("vitlab."), command
    r = run_cli(module.removeprefix("vitlab."), *args, cwd=tmp_path, env=TESTS_ON_PATH)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "train" / "runs").iterdir()
    return run_dir


def assert_resumes_exactly(args, tmp_path, signum, step, **stop):
    """`python -m vitlab.train args` run whole into tmp_path/full, then again stopped by `signum` after optimizer
    step `step` (`interrupt`, with its `stop` options) and resumed by the command it prints (`resume`): the resumed
    run is the uninterrupted one (`assert_same_run`). Returns the whole run's process (its output, to read)."""
    full = tmp_path / "full"
    r = run_cli("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-3000:]
    command = interrupt(args, tmp_path, signum, step, **stop)
    assert_same_run(full, resume(command, tmp_path))
    return r


def shared_dir(tmp_path_factory) -> Path:
    """The folder this pytest run's xdist workers share (each has its own base temp below it): pytest's base temp
    without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory, name: str, make) -> Path:
    """`make(folder)` run once per pytest run for `name`, whichever test or xdist worker asks first; the others wait
    for it (a file lock) and get the same folder. A failure is kept and raised again for every test that asks, with
    its message, instead of being attempted anew."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory) / "once"
    root.mkdir(exist_ok=True)
    folder, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(root / f"{name}.lock"):
        if failed.exists():
            raise AssertionError(f"the shared {name!r} failed earlier in this run:\n{failed.read_text()}")
        if not done.exists():
            folder.mkdir()
            try:
                make(folder)
            except BaseException as error:
                failed.write_text(f"{type(error).__name__}: {error}")
                raise
            done.touch()
    return folder


def trained(tmp_path_factory, name: str, *args: str) -> Path:
    """The run directory of `python -m vitlab.train args`, trained once per pytest run and shared by every test that
    names it (read it; never write into it)."""

    def train(folder: Path) -> None:
        (folder / "args.json").write_text(json.dumps(args))
        r = run_cli("train", *args, f"hydra.run.dir={folder / 'run'}", cwd=folder, env=TESTS_ON_PATH)  # (its callbacks)
        assert r.returncode == 0, r.stderr[-3000:]

    folder = once(tmp_path_factory, name, train)
    assert json.loads((folder / "args.json").read_text()) == list(args), f"two runs are named {name!r}"
    return folder / "run"


def digits_checkpoint(tmp_path_factory) -> Path:
    """A digits checkpoint from a one-epoch run, shared by the suite."""
    run = trained(tmp_path_factory, "digits-1-epoch", "trainer.max_epochs=1", "data.batch_size=256", "test=false")
    return run / "checkpoints" / "last.ckpt"


def earlier_run(root):
    """An earlier run's directory with files whose bytes must survive any failed command: returns
    {path: bytes} to compare against afterwards."""
    run = root / "outputs" / "train" / "runs" / "earlier"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"earlier checkpoint bytes")
    (run / "metrics.json").write_text('{"test/acc": 0.99}')
    (run / "config.yaml").write_text("seed: 1\n")
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def wandb_steps(run_dir: Path) -> list[int]:
    """The `trainer/global_step` of every history record in an offline W&B run's directory (its run-<id>.wandb:
    W&B's record log, LevelDB's log format of 32 KiB blocks behind a 7-byte ':W&B' header, which wandb's Python
    package no longer reads itself)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is no W&B record log"
    pos, record, steps = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of a block (padding)
            pos += left
            continue
        record, pos = record + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last part
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            record = b""
            if parsed.WhichOneof("record_type") == "history":
                items = {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in parsed.history.item}
                if "trainer/global_step" in items:
                    steps.append(items["trainer/global_step"])
    return steps


def assert_goes_on_on_one(tmp_path_factory, tmp_path, name: str, args: list[str], step: int = 4) -> Path:
    """`args` (trainer.devices=2) trained whole once per pytest run as `name`, then stopped by SIGTERM after step
    `step` and resumed by the printed command with trainer.devices=1: the resume line says it is exact, and the run
    is the two processes' (`assert_close_run`). Returns the whole run's directory."""
    two = trained(tmp_path_factory, name, *args)
    command = interrupt(args, tmp_path, "SIGTERM", step)
    assert " trainer.devices=2 " in command
    resumed = resume(command.replace(" trainer.devices=2 ", " trainer.devices=1 "), tmp_path)
    assert "written by 2 processes, resumed on 1: exact" in (resumed / "train.log").read_text()
    assert_close_run(two, resumed)
    return two
