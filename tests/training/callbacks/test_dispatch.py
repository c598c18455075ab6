"""training/callbacks/dispatch.py: Lightning's callback hooks called only where a callback has one, in order, the
monitoring callbacks kept apart as Lightning keeps them."""

from types import SimpleNamespace

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.profilers import PassThroughProfiler

from vitlab.training.callbacks.dispatch import call_callback_hooks


class Calls(L.Callback):
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append((self.name, outputs, batch_idx))


class Watching(Checkpoint):
    def on_train_epoch_end(self, trainer, module):
        self.seen.append(("watching", None, None))


def test_a_hook_reaches_the_callbacks_that_have_it_in_order_and_monitoring_ones_apart(monkeypatch):
    seen = []
    quiet = L.Callback()
    monkeypatch.setattr(L.Callback, "on_train_epoch_end", lambda *a: seen.append(("base", None, None)))
    watching = Watching()
    watching.seen = seen
    callbacks = [Calls("a", seen), quiet, Calls("b", seen), watching]
    trainer = SimpleNamespace(callbacks=callbacks, lightning_module=None, profiler=PassThroughProfiler())
    call_callback_hooks(trainer, "on_train_batch_end", "out", "batch", 3)
    assert seen == [("a", "out", 3), ("b", "out", 3)]
    seen.clear()
    call_callback_hooks(trainer, "on_train_epoch_end", monitoring_callbacks=False)  # (the base method, patched
    assert seen == []  # here to record, is Callback's own: skipped on every callback that keeps it)
    call_callback_hooks(trainer, "on_train_epoch_end", monitoring_callbacks=True)
    assert seen == [("watching", None, None)]
