"""Callback hooks called only where a callback has one.

Lightning calls every hook of every callback at every step (`trainer.call._call_callback_hooks`), each inside a
profiler context named from the callback's `state_key` (for a ModelCheckpoint, a string built anew from its settings
each time): for vitlab.train's eleven callbacks that is ~66 calls a training step, of which ~13 do anything. On the
digits default the dispatch cost about 1% of a step (benchmark.task=overhead, experiments/throughput). Installed here
(by `training.run.build.build_trainer`), a callback whose hook is `Callback`'s own empty method is not called: the
same work is done, in the same order; only a profiler (trainer.profiler=simple) no longer lists the empty hooks."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.trainer import call

MONITORING = (EarlyStopping, Checkpoint)  # Lightning's two "monitoring" kinds, asked for or left out at an epoch's end


def call_callback_hooks(
    trainer: L.Trainer, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
) -> None:
    """Lightning 2.6's `_call_callback_hooks`, skipping the callbacks that keep `Callback`'s own `hook_name`."""
    pl_module = trainer.lightning_module
    if pl_module:
        prev_fx_name = pl_module._current_fx_name
        pl_module._current_fx_name = hook_name
    empty = getattr(L.Callback, hook_name, None)
    for callback in trainer.callbacks:
        if monitoring_callbacks is not None and monitoring_callbacks != isinstance(callback, MONITORING):
            continue
        fn = getattr(callback, hook_name)
        if callable(fn) and (empty is None or getattr(fn, "__func__", None) is not empty):
            with trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):
                fn(trainer, trainer.lightning_module, *args, **kwargs)
    if pl_module:
        pl_module._current_fx_name = prev_fx_name  # (restored, as a hook may call another)


def install() -> None:
    """Make Lightning's loops call `call_callback_hooks` (they look it up on `lightning.pytorch.trainer.call`)."""
    call._call_callback_hooks = call_callback_hooks
