"""What Lightning's Trainer gets wrong for us, set right by one callback every Trainer vitlab builds carries
(build.build_trainer)."""

from __future__ import annotations

import lightning as L


class LightningWorkarounds(L.Callback):
    """What Lightning's Trainer gets wrong for us, set right where the Trainer is built, once the optimizer and its
    schedule have counted the steps (which builds the train loader) and before a checkpoint's loops are restored."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = max(1, int(trainer.estimated_stepping_batches))
        # Counting the steps (here and in configure_optimizers) built the train loader before a checkpoint's loader
        # position is restored, and fit then never applies that position (Lightning-AI/pytorch-lightning#20550,
        # open): drop the early loader, after the last count, so fit builds it again after the restore.
        # tests/end_to_end/test_reliability.py guards this.
        trainer.fit_loop._combined_loader = None
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
        if 0 < total // epochs < trainer.log_every_n_steps:
            # Epochs shorter than the logging interval would log no step at all (no loss or LR curve for a short
            # run): log once per epoch's worth of steps instead.
            trainer.log_every_n_steps = total // epochs
