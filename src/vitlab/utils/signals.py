"""Stopping a training run on a signal, in one process or in many, without a hang.

Ctrl-C (SIGINT), SIGTERM (a scheduler, `timeout`, a closing terminal), SIGUSR1 and SIGUSR2 (Slurm's and submitit's
warnings before a time limit or pre-emption) may reach one process, any rank, or the whole process group. Lightning's
own handling does collective work inside the handler (its SIGTERM handler broadcasts, its Slurm handler saves a
checkpoint with a barrier), so ranks that are in different collectives wait for each other forever
(Lightning-AI/pytorch-lightning#21406). Here a handler only records the signal. One process reads its flag after
every optimizer step (a Python value: nothing to wait for). Several agree on it every `AGREE_EVERY` optimizer steps
through an all-reduce on a CPU (gloo) group that is launched at one such step and read at the next: no step waits
for it, the GPU is never synchronised for it, and the run stops within two intervals of the signal. Once agreed,
Lightning raises its SIGTERMException on every rank after the same batch (and after the validation due after it,
never in its middle), and `callbacks.SaveOnInterrupt` writes one checkpoint.

Loader workers leave these signals to the main process (`ignore_stop_signals`, at their start).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from vitlab.utils.errors import AT_ONCE, ignore_repeats, python_ctrl_c

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
AGREE_EVERY = 8  # optimizer steps between the ranks' exchanges of their flags
STOPPING = threading.Event()  # this process's ranks agreed to stop on a signal: training's handling says so itself


class StopSignals(_SignalConnector):
    """The Trainer's signal connector during fit (installed by SaveOnInterrupt). Lightning calls
    `register_signal_handlers` right before the first batch and `teardown` when fit ends, and raises
    SIGTERMException where `received_sigterm` reads True."""

    def __init__(self, trainer: L.Trainer):
        super().__init__(trainer)
        self.received: int | None = None  # the first stop signal this process got
        self.stop: int | None = None  # the signal every rank stops for, once they agree
        self._handlers: dict[int, Any] = {}
        self._group = self._work = self._flag = None
        self._timer: threading.Timer | None = None

    @property
    def received_sigterm(self) -> bool:
        # Read by Lightning's loops: after a training batch and the validation due after it, and between
        # validation batches. Never True during validation, whose results the checkpoint would otherwise lose.
        return self.stop is not None and not (self.trainer.validating or self.trainer.sanity_checking)

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:
        pass  # Lightning resets the flag when it registers handlers; `stop` is the state here

    def register_signal_handlers(self) -> None:
        if self.trainer.state.fn != TrainerFn.FITTING or threading.current_thread() is not threading.main_thread():
            return  # evaluation keeps Python's handlers: nothing to save, and Ctrl-C stops at once
        self.received = self.stop = None
        self._handlers = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        if self.trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo")  # CPU tensors: no device work, no sync
        # Lightning 2.6 broadcasts rank 0's flag before every training batch and reads it back (a host sync per
        # step on a GPU, and rank 0's word only); the agreement here replaces it.
        loop = self.trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = _nothing

    def _record(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            if self.trainer.is_global_zero:  # os.write: a print here could re-enter a write it interrupted
                os.write(2, _NOTICE.get(signum, _NOTICE[None]).format(signal.Signals(signum).name).encode())
            # Copies of this stop are ignored for REPEAT_WINDOW_S (vitlab.utils.errors); after that a second Ctrl-C
            # or SIGTERM ends the process at once, by the kernel: a step that never ends (a model too big for the
            # machine, swapping) never reaches Python again to run a handler.
            self._timer = ignore_repeats()

    def agree(self, step: int) -> int | None:
        """The signal all ranks stop for, or None to go on, after optimizer step `step`. Every rank calls this at
        the same step boundaries; with several, the flags exchanged at one multiple of AGREE_EVERY are read at the
        next (the exchange has had AGREE_EVERY steps to finish)."""
        stop = self._agree(step)
        if stop is not None:
            STOPPING.set()
        return stop

    def _agree(self, step: int) -> int | None:
        if self.stop is not None:
            return self.stop
        if self._group is None:
            self.stop = self.received
            return self.stop
        if step % AGREE_EVERY:
            return None
        if self._work is not None:
            self._work.wait()
            self.stop = int(self._flag.item()) or None  # a CPU tensor: no device sync
        self._flag = torch.tensor([self.received or 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return self.stop

    def teardown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        if self._work is not None:
            self._work.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
        self._handlers, self._group, self._work = {}, None, None
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        super().teardown()
        late, self.received = (self.received if self.stop is None else None), None
        if late is not None and self.trainer.state.status != TrainerStatus.INTERRUPTED:
            # It came after the last step boundary (during the final validation): nothing is left to save, but the
            # user asked the run to stop, so the signal gets its default effect now. (Not when fit failed: its
            # error is the report.)
            os.kill(os.getpid(), late)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(_handlers={}, _group=None, _work=None, _flag=None, _timer=None)
        return state


_NOTICE = {
    signal.SIGINT: "\n{}: stopping after this step, saving a checkpoint; Ctrl-C again (a second later) stops at once, "
    "without saving\n",
    None: "{}: stopping after this step, saving a checkpoint; a second SIGTERM (or Ctrl-C) a second later stops at "
    "once, without saving\n",
}


def _nothing() -> None:
    pass


def pass_on(signum: int) -> None:
    """Hand `signum` to the handler that was there before the run, now that the checkpoint is on disk: under a
    submitit (Slurm) job, submitit's, which requeues the job on its time-limit signal."""
    handler = signal.getsignal(signum)
    if callable(handler) and not python_ctrl_c(handler):
        handler(signum, None)


def ignore_stop_signals() -> None:
    """For a loader worker: signals sent to the whole process group (Ctrl-C, a scheduler's SIGTERM) are the main
    process's to act on; a worker killed by one would take the run down before it saves. SIGTERM from the main
    process itself (its loader, or Python's exit, ending the worker) still ends it: a thread takes SIGTERM and
    looks at who sent it."""
    for signum in STOP_SIGNALS:
        if signum != signal.SIGTERM:
            signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):  # Linux
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # pending for the thread below, in every thread
        threading.Thread(target=_end_on_sigterm_from, args=(os.getppid(),), daemon=True).start()


def _end_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as asked: a worker ended by its loader is no failure (the loader would call it one)


def when_children_stop(report: Callable[[int], str]) -> None:
    """Where Lightning's DDP launcher (its child-process observer, in the process that started the others) finds a
    process it started ended by a stop signal (SIGINT or SIGTERM: killed by it, or exited 128 + it), which happens
    when a terminal's Ctrl-C or a scheduler's SIGTERM reaches the process group while the processes start, before
    training's own handling: this process may be waiting in the processes' rendezvous, where no Python handler runs,
    and Lightning ends it with SIGKILL (exit 137, no word). Instead its other processes are ended, `report(signal)`'s
    line is printed (it may tidy the run directory first) and it exits 128 + the signal. Any other end of a child is
    Lightning's to handle, as before; and so is nothing where this process's ranks agreed to stop on a signal
    (`STOPPING`): they save and exit 128 + it together, and this process says so itself (a child that ends first is
    no start-up stop: reporting it here raced this process's own last line)."""
    from lightning.fabric.strategies.launchers import subprocess_script

    observer = subprocess_script._ChildProcessObserver
    lightnings = observer.__dict__.get("_lightnings_terminate_all", observer._terminate_all)

    def _terminate_all(self: Any) -> None:
        codes = [p.returncode for p in self._child_processes if p.returncode]
        stops = [-c if c < 0 else c - 128 for c in codes if -c in AT_ONCE or c - 128 in AT_ONCE]
        if not stops:
            return lightnings(self)
        if STOPPING.is_set():  # the run's own stop: its processes end together, rank 0's line says what was saved
            return None
        for p in self._child_processes:
            p.send_signal(signal.SIGKILL)  # (those that have not ended are stuck in the rendezvous)
        os.write(2, f"error: {report(stops[0])}\n".encode())
        os._exit(128 + stops[0])

    observer._lightnings_terminate_all = lightnings
    observer._terminate_all = _terminate_all
