"""Test-only Lightning callbacks, loaded into real `python -m vitlab.train` runs via +callbacks.X._target_."""

import os
import signal

import lightning as L
import torch


class SignalAtStep(L.Callback):
    """Send a real signal to this process after optimizer step `step` (mid-epoch when chosen so)."""

    def __init__(self, step: int, signum: str = "SIGTERM"):
        self.step, self.signum = step, getattr(signal, signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class NanAtStep(L.Callback):
    """Poison the batch of optimizer step `step` with NaN, so its loss is not finite."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            batch[0].fill_(torch.nan)


class AssertCompiled(L.Callback):
    """Fail the run unless the model's forward was compiled in place (nn.Module.compile)."""

    def on_train_start(self, trainer, pl_module):
        assert pl_module.model._compiled_call_impl is not None, "compile=true did not compile the model"
