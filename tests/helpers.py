"""What tests share: tiny model configs, running a command as a user does, files for command-line
tests, and test-only Lightning callbacks (loaded into real `python -m vitlab.train` runs via
+callbacks.X._target_)."""

import contextlib
import copy
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tests.forkserver import READ_AT_RUN_TIME
from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint
from vitlab.model import ViTConfig

ROOT = Path(__file__).resolve().parents[1]
# A command run outside ROOT finds the test callbacks its command line names (tests.helpers.<class>) through this.
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

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


# A run on the `folder`/`shards` fixtures' images (conftest.py: 3 classes x 24 images of 12 px in train, val and
# test): 9 steps of 8 an epoch, loader workers, RandAugment and random erasing.
SHARDS_RUN = [
    "data.batch_size=8",
    "data.num_workers=2",
    "model.img_size=8",
    "trainer.max_epochs=3",
    "trainer.deterministic=true",
    "progress_bar=none",
    "model.drop_path_rate=0.1",
    "data.train_transform.auto_augment=randaugment",
    "data.train_transform.random_erasing=0.5",
    "trainer.log_every_n_steps=5",
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
    session) of its own, as a terminal starts a command: a signal to its group then reaches only it. Forked from
    tests/forkserver.py, which has the libraries imported, where the environment allows (the same command, seconds
    sooner); a real subprocess otherwise."""
    full_env = {**({} if replace_env else os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    argv = [sys.executable, "-m", f"vitlab.{module}", *args]
    server = _fork_server(full_env)
    if server is not None:
        return server.run(argv, module, list(args), Path(cwd or ROOT), full_env, own_group, timeout)
    return subprocess.run(
        argv,
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=own_group,
    )


class _ForkServer:
    def __init__(self):
        import queue
        import threading

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env = {k: v for k, v in env.items() if k not in READ_AT_RUN_TIME}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [self.replies.put(json.loads(x)) for x in self.proc.stdout], daemon=True
        ).start()
        assert "ready" in self.replies.get(timeout=300)

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and {k: v for k, v in env.items() if k not in READ_AT_RUN_TIME} == self.env

    def run(self, argv, module, args, cwd, env, own_group, timeout) -> subprocess.CompletedProcess:
        import queue
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = dict(module=module, args=args, cwd=str(cwd), env=env, own_group=own_group, out=str(out),
                           err=str(err))  # fmt: skip
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self.replies.get(timeout=60)["pid"]
            try:
                status = self.replies.get(timeout=timeout)["status"]
            except queue.Empty:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL) if own_group else os.kill(pid, signal.SIGKILL)
                self.replies.get(timeout=60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            code = os.waitstatus_to_exitcode(status)
            return subprocess.CompletedProcess(
                argv, code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )


_SERVER: list = []


def _fork_server(env: dict) -> _ForkServer | None:
    """This test process's fork server (started on first use) when it can run a command with `env`."""
    if os.environ.get("VITLAB_TEST_FORK", "1") == "0":
        return None
    if not _SERVER:
        _SERVER.append(_ForkServer())
    return _SERVER[0] if _SERVER[0].serves(env) else None


def ctrl_c_as_in_a_terminal() -> None:
    """Popen's preexec_fn for a test that presses Ctrl-C (SIGINT): the command starts with SIGINT's default action,
    as a terminal starts it, whatever this test process inherited (a script's background job, `nohup ... &` or a CI
    runner may start the suite with SIGINT ignored, and the command would then ignore the test's Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def reference(repo: str, module: str):
    """A module of a reference implementation vendored verbatim under tests/reference/<repo>/ (its README: which
    commit, which license), imported as its own code imports itself (`dino`'s files are top-level modules, `dinov2` a
    package), so that a test holds vitlab to the reference's code rather than to a copy typed out here."""
    path = str(ROOT / "tests" / "reference" / repo)
    sys.path.insert(0, path)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(path)


def extra_callback(name: str, target: str, **params) -> list[str]:
    """Overrides that add callbacks.<name>: the class `target` of this module (or a dotted path), built with
    `params`."""
    return [
        f"+callbacks.{name}._target_={target if '.' in target else f'tests.helpers.{target}'}",
        *(f"+callbacks.{name}.{k}={v}" for k, v in params.items()),
    ]


class SignalAtStep(L.Callback):
    """Send a real signal after optimizer step `step` (mid-epoch when chosen so): to this process, or with
    `group=true` to its whole process group from another process, as Ctrl-C in a terminal, `timeout` or a
    scheduler do (loader workers and the other ranks included); under DDP only from rank `rank`. `times=2` sends
    it twice in a row; in a -m sweep, `job` picks the job that sends it. The time it was sent goes to `stamp`, when
    given. `hook` lands it elsewhere than after the step: at the end of the epoch whose last step is `step` (after its
    validation and its checkpoint, on_train_epoch_end), at the start of the next (on_train_epoch_start), or while the
    test after fit runs (on_test_batch_start: before the test batch numbered `step`)."""

    def __init__(
        self,
        step: int,
        signum: str = "SIGTERM",
        group: bool = False,
        rank: int = 0,
        times: int = 1,
        stamp: str | None = None,
        job: int | None = None,
        hook: str = "on_train_batch_end",
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
        self.hook = hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._send(trainer, "on_train_batch_end")

    def on_train_epoch_end(self, trainer, pl_module):
        self._send(trainer, "on_train_epoch_end")

    def on_train_epoch_start(self, trainer, pl_module):
        self._send(trainer, "on_train_epoch_start")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._send(trainer, "on_test_batch_start", batch_idx)

    def _send(self, trainer, hook: str, test_batch: int | None = None) -> None:
        step = trainer.global_step if test_batch is None else test_batch
        if hook != self.hook or step != self.step or trainer.global_rank != self.rank:
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


class SignalAgainWhenStuck(L.Callback):
    """After optimizer step `step` (once SignalAtStep has sent its signal there), the next step hangs: past the window
    in which a repeat is the same stop (`wait` seconds), it sends `signum` to the process group once more, then
    sleeps ten minutes, a step that never ends."""

    def __init__(self, step: int, signum: str = "SIGTERM", wait: float = 1.5):
        self.step, self.signum, self.wait = step, signal.Signals[signum], wait

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            time.sleep(self.wait)
            kill = ["kill", f"-{self.signum.name[3:]}", "--", f"-{os.getpgid(0)}"]
            subprocess.run(kill, check=True, start_new_session=True)
            time.sleep(600)


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


class SleepPerStep(L.Callback):
    """Make every training step `seconds` longer: a run slow enough to act on from outside while it trains."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class RecordTrainIndices(L.Callback):
    """Write the dataset indices each process trained on, per epoch, to `path`/indices.<rank>.json, for data held on
    the device (its loader gathers whole batches by index: data/resident.py)."""

    def __init__(self, path: str):
        self.path, self.epochs, self._fetched = Path(path), [], {}

    def on_train_start(self, trainer, pl_module):
        dataset = trainer.train_dataloader.dataset
        gather = dataset.__getitems__

        def recording(indices):
            batch = gather(indices)
            self._fetched[id(batch[1])] = (batch[1], list(indices))  # the labels travel to the step as they are
            return batch

        dataset.__getitems__ = recording

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.epochs[-1] += self._fetched.pop(id(batch[1]))[1]

    def on_train_end(self, trainer, pl_module):
        (self.path / f"indices.{trainer.global_rank}.json").write_text(json.dumps(self.epochs))


class RecordTrainSizes(L.Callback):
    """Write [optimizer step, height, width, images] of every training batch each process trained on, as the model
    took it, to <the run directory>/sizes.<rank>.json (data.train_img_sizes)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append([trainer.global_step, *batch[0].shape[-2:], len(batch[0])])

    def on_train_end(self, trainer, pl_module):
        (Path(trainer.default_root_dir) / f"sizes.{trainer.global_rank}.json").write_text(json.dumps(self.steps))


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


class FirstStep(L.Callback):
    """Records what the first training step took and gave: its batch as the objective took it, the model and the
    random generators' states before it, its loss; and the optimizer's groups (parameter names, learning rates)."""

    seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import numpy

        if trainer.global_step == 0 and not FirstStep.seen:
            FirstStep.seen.update(
                x=batch[0].clone(), y=batch[1].clone(), model=copy.deepcopy(pl_module.model),
                numpy=numpy.random.get_state(), torch=torch.get_rng_state(),
            )  # fmt: skip

    def on_before_backward(self, trainer, pl_module, loss):
        FirstStep.seen.setdefault("loss", loss.detach().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        names = {id(p): n for n, p in pl_module.model.named_parameters()}
        groups = [([names[id(p)] for p in g["params"]], g["lr"]) for g in trainer.optimizers[0].param_groups]
        FirstStep.seen.setdefault("groups", groups)


class NanAtStep(L.Callback):
    """Poison the batch of optimizer step `step` with NaN, so its loss is not finite."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            batch[0].fill_(torch.nan)


class OrdinarySteps(L.Callback):
    """Guard ordinary training steps (`guard(True)`, then `guard(False)`). Each guarded window runs from the end of one
    step's callbacks to the end of the next step's (fetching, transfer, device transform, hooks, forward, backward,
    optimizer, scheduler). Left out: the first `after` steps (lazy set-up), logging steps and the step after one
    (reading a logged value must wait), and epoch ends. Put it last in the callbacks; `guarded` counts the windows
    (on the class: the tests build it from the config)."""

    guarded = 0

    def __init__(self, after: int = 3):
        self.after = after

    def guard(self, on: bool) -> None:
        raise NotImplementedError

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.guard(False)
        step, n = trainer.global_step, trainer.log_every_n_steps  # `step` steps are done
        ordinary = step >= self.after and (step + 1) % n != 0 and step % n != 0  # the next step and this one
        if ordinary and batch_idx + 1 < trainer.num_training_batches:
            self.guard(True)
            type(self).guarded += 1

    def on_train_epoch_end(self, trainer, pl_module):
        self.guard(False)

    def on_exception(self, trainer, pl_module, exception):
        self.guard(False)


class ForbidSync(OrdinarySteps):
    """On a GPU, ordinary training steps run under `torch.cuda.set_sync_debug_mode("error")`: any host-device
    synchronisation raises."""

    guarded = 0

    def guard(self, on: bool) -> None:
        torch.cuda.set_sync_debug_mode("error" if on else "default")


MARK = "_vitlab_on_device"  # set on tensors that would be on the training device on a GPU (HostReads)


class HostReads(TorchFunctionMode):
    """What makes the host wait for a GPU, seen on a CPU: a read of a tensor marked as on the device (`.item()`,
    `.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`int()`/`float()`/`format` of it, a mask indexing or an op whose
    output size depends on its values), and a Python value made into a tensor on a named device (a copy that blocks).
    An op's outputs are marked when any of its tensor inputs is, and `.to(device)`'s are. Each is recorded in
    `found` with the line that did it. (A sync inside C++, such as a CUDA kernel that reads a size, is not seen
    here: ForbidSync sees it on a GPU.)"""

    READS = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
        torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__format__,
        torch.Tensor.__repr__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique,
        torch.masked_select, torch.Tensor.masked_select, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
    }  # fmt: skip
    MADE = {torch.tensor, torch.as_tensor, torch.scalar_tensor}

    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marked = any(getattr(t, MARK, False) for t in leaves)
        read = marked and func in self.READS
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):  # only a mask's values decide a size
            read = marked and any(t.dtype == torch.bool and getattr(t, MARK, False) for t in leaves[1:])
        if read or (func in self.MADE and kwargs.get("device") is not None):
            self.found.append(f"{getattr(func, '__name__', func)} at {_caller()}")
        out = func(*args, **kwargs)
        if (marked and func not in self.READS) or (
            func in (torch.Tensor.to, torch.Tensor.cuda) and _names_device(args, kwargs)
        ):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    setattr(t, MARK, True)
        return out


def _names_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])


def _caller() -> str:
    """Where the read is: the innermost line outside this file and, when that is in torch, the line outside torch
    that called it."""
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("tests/helpers.py")]
    show = [frames[-1]] + [next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])]
    return " <- ".join(dict.fromkeys(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in show))


def mark_on_device(*tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, MARK, True)


class ForbidHostReads(OrdinarySteps):
    """ForbidSync on a CPU: in the same windows, reads of what would be on the device (HostReads) are recorded in
    `ForbidHostReads.found`. What a GPU run keeps on the device is marked when a window opens: the module's weights,
    buffers and metric states, the optimizer's state (not its step counts: host tensors there too), an EMA average,
    the splits held on the device; and NonFiniteLoss checks as on a GPU (recorded, read at logging steps)."""

    guarded = 0
    found: list[str] = []

    def __init__(self, after: int = 3):
        super().__init__(after)
        self._mode: HostReads | None = None

    def on_train_start(self, trainer, pl_module):
        from vitlab.training.callbacks.standard import NonFiniteLoss

        for callback in trainer.callbacks:
            if isinstance(callback, NonFiniteLoss):
                callback.every_step = False

    def guard(self, on: bool) -> None:
        if on and self._mode is None:
            self._mark(self.trainer)
            self._mode = HostReads(ForbidHostReads.found)
            self._mode.__enter__()
        elif not on and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer

    @staticmethod
    def _mark(trainer) -> None:
        from torchmetrics import Metric

        module = trainer.lightning_module
        mark_on_device(*module.parameters(), *module.buffers())
        for metric in module.modules():
            if isinstance(metric, Metric):
                mark_on_device(*(getattr(metric, name) for name in metric._defaults))
        for optimizer in trainer.optimizers:
            mark_on_device(*(v for state in optimizer.state.values() for k, v in state.items() if k != "step"))
        for store in getattr(trainer.datamodule, "_stores", {}).values():
            mark_on_device(store.images, store.labels)
        for callback in trainer.callbacks:
            if getattr(callback, "_average_model", None) is not None:
                mark_on_device(*callback._average_model.parameters(), *callback._average_model.buffers())


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
        r = run_cli("train", *args, f"hydra.run.dir={folder / 'run'}", cwd=folder)
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


def segmentation_tree(root, classes=4, per_split=(4, 3), seed=0):
    """An ADE20k-layout folder: images/{training,validation}/<name>.jpg of random RGB pixels and sizes, each with its
    annotations/.../<name>.png of labels 0..classes (0: ADE20k's "other", ignored by reduce_zero_label); returns
    root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in zip(("training", "validation"), per_split, strict=True):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = (int(v) for v in rng.integers(24, 48, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "images" / split / f"{i}.jpg")
            labels = rng.integers(0, classes + 1, (h, w), dtype=np.uint8)
            Image.fromarray(labels).save(root / "annotations" / split / f"{i}.png")
    return root


# ---- MAE's reference (facebookresearch/mae), written from its code, for tests that compare with it -----------------


def mae_get_2d_sincos_pos_embed(embed_dim: int, grid_size: int):
    """facebookresearch/mae util/pos_embed.py get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=True), line by
    line (np.float for np.float64): (1 + grid_size**2, embed_dim) float64."""
    import numpy as np

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])

    def get_1d(embed_dim, pos):
        omega = np.arange(embed_dim // 2, dtype=np.float64)
        omega /= embed_dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([get_1d(embed_dim // 2, grid[0]), get_1d(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


def mae_state_dict_like_maes(
    depth: int = 2, decoder_depth: int = 1, dim: int = 768, decoder_dim: int = 512, patch: int = 16, img: int = 224,
    chans: int = 3, seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """What `MaskedAutoencoderViT(...).state_dict()` of models_mae.py holds (mae_vit_base_patch16_dec512d8b's names
    and shapes at the default widths, fewer blocks): its own parameters (cls_token, pos_embed, mask_token,
    decoder_pos_embed), then patch_embed, blocks (timm 0.3.2's Block), norm, decoder_embed, decoder_blocks,
    decoder_norm, decoder_pred; random values, the two fixed tables MAE's sin-cos."""
    g = torch.Generator().manual_seed(seed)
    grid = img // patch

    def block(prefix: str, d: int) -> dict[str, tuple]:  # timm 0.3.2's Block: norm1, attn.qkv, attn.proj, norm2, mlp
        layers = {"norm1": [(d,)], "attn.qkv": [(3 * d, d), (3 * d,)], "attn.proj": [(d, d)], "norm2": [(d,)],
                  "mlp.fc1": [(4 * d, d), (4 * d,)], "mlp.fc2": [(d, 4 * d)]}  # fmt: skip
        out = {}
        for name, (weight, *bias) in layers.items():
            out |= {f"{prefix}.{name}.weight": weight, f"{prefix}.{name}.bias": bias[0] if bias else (weight[0],)}
        return out

    shapes = {"cls_token": (1, 1, dim), "pos_embed": None, "mask_token": (1, 1, decoder_dim), "decoder_pos_embed": None,
              "patch_embed.proj.weight": (dim, chans, patch, patch), "patch_embed.proj.bias": (dim,)}  # fmt: skip
    for i in range(depth):
        shapes |= block(f"blocks.{i}", dim)
    shapes |= {"norm.weight": (dim,), "norm.bias": (dim,), "decoder_embed.weight": (decoder_dim, dim)}
    shapes |= {"decoder_embed.bias": (decoder_dim,)}
    for i in range(decoder_depth):
        shapes |= block(f"decoder_blocks.{i}", decoder_dim)
    shapes |= {"decoder_norm.weight": (decoder_dim,), "decoder_norm.bias": (decoder_dim,)}
    shapes |= {
        "decoder_pred.weight": (patch * patch * chans, decoder_dim),
        "decoder_pred.bias": (patch * patch * chans,),
    }
    sd = {k: torch.randn(s, generator=g) * 0.02 if s else None for k, s in shapes.items()}
    sd["pos_embed"] = torch.from_numpy(mae_get_2d_sincos_pos_embed(dim, grid)).float()[None]
    sd["decoder_pos_embed"] = torch.from_numpy(mae_get_2d_sincos_pos_embed(decoder_dim, grid)).float()[None]
    return sd


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


# --- the commands the documentation shows ------------------------------------------------------------------------

# The pages of the documentation site (mkdocs.yml): the README, docs/, and each study's README.md that docs/hooks.py
# pulls in. Their fenced code blocks are the one list of commands: tests/test_docs.py parses every one against the
# config tree, and the tests that run a documented command as typed take it from here (`documented`).
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("experiments/*/README.md"))]
# <ckpt>, <run>, <its best .ckpt>: a value the reader fills in; $s, ${m#vit_}: the shell's, in a study's loop
PLACEHOLDER = re.compile(r"<[^<>\n]+>|\$\{[^}\s]*\}|\$\w+")


def _code_lines(text: str):
    """(line number, line) of every line inside a fenced code block, `\\` continuations joined."""
    fence, held, start = None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence else stripped
            continue
        if fence is None or fence.startswith(("```python", "```yaml")):
            continue
        start = start or n
        if stripped.endswith("\\"):
            held += stripped[:-1] + " "
            continue
        yield start, held + stripped
        held, start = "", 0


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """Every `python -m vitlab.<command> args` (or `torchrun ... -m vitlab.<command>`) in a code block of the
    documentation: (where, as `page:line`; the command; its arguments, shell-split, placeholders as `x`)."""
    found = []
    for page in DOC_PAGES:
        for n, line in _code_lines(page.read_text()):
            line = line.removeprefix("$ ")
            try:
                words = shlex.split(PLACEHOLDER.sub("x", line), comments=True)
            except ValueError:  # not a shell line (a log line quoting one)
                continue
            for i, word in enumerate(words[:-1]):
                by = Path(words[i - 1]).name in ("python", "python3") if i else False
                if (by or words[0] == "torchrun") and word == "-m" and re.fullmatch(r"vitlab\.\w+", words[i + 1]):
                    where = f"{page.relative_to(ROOT)}:{n}"
                    found.append((where, words[i + 1].removeprefix("vitlab."), words[i + 2 :]))
                    break
    return found


def documented(command: str, *args: str) -> tuple[str, ...]:
    """`args`, checked to begin a command the documentation shows for `python -m vitlab.<command>`: a test that runs
    a documented command as typed names it through this, so that the page and the test cannot part."""
    for _, name, words in documented_commands():
        if name == command and tuple(words[: len(args)]) == args:
            return args
    raise AssertionError(f"no page shows `python -m vitlab.{command} {' '.join(args)}` (tests/helpers.py DOC_PAGES)")


def replaced(args, *overrides: str) -> list[str]:
    """`args` with `overrides` in place of the ones of the same key (a command refuses a key given twice, as a user
    would be refused: a test that changes a shared list's value says so with this), new keys appended."""
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    return [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys] + list(overrides)
