"""Test-only Lightning callbacks, loaded into real `python -m vitlab.train` runs through their command line
(+callbacks.X._target_=tests.helpers.callbacks.<class>; configs.extra_callback writes it)."""

import copy
import json
import os
import signal
import subprocess
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


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
        if not self.epochs:  # resumed mid-epoch
            self.epochs.append([])
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


class FirstStep(L.Callback):
    """Records what the first training step took and gave: its batch as the objective took it, the model and the
    random generators' states before it, the step's stochastic depth draws (`rows`: the context the step runs the
    model in, model.layers.drawn_by_rows), its loss; and the optimizer's groups (parameter names, learning rates)."""

    seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import numpy

        if trainer.global_step == 0 and not FirstStep.seen:
            FirstStep.seen.update(
                x=batch[0].clone(), y=batch[1].clone(), model=copy.deepcopy(pl_module.model),
                numpy=numpy.random.get_state(), torch=torch.get_rng_state(),
                rows=pl_module._drawn_by_rows(batch_idx, len(batch[1])),
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
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("tests/helpers/callbacks.py")]
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


class EagerCompile(L.Callback):
    """Dynamo's eager backend for compile= in this process (it captures the graphs as for inductor and runs them
    eagerly: no code generated, seconds instead of minutes on a CPU), and the run fails unless the blocks were
    compiled. Made when the run builds its Trainer, before the module compiles."""

    def __init__(self):
        compile_ = torch.nn.Module.compile
        torch.nn.Module.compile = lambda module, **kwargs: compile_(module, **{**kwargs, "backend": "eager"})

    def on_train_start(self, trainer, pl_module):
        assert all(b._compiled_call_impl is not None for b in pl_module.model.blocks), "the blocks were not compiled"
