"""The representation measured while it trains: k-NN and few-shot accuracy of the frozen features of the model being
trained, every few epochs, logged beside val/acc (`knn/top1`, `fewshot/<n>shot`), so a run (a pretraining run above all)
shows its features improving; after training, the tested weights' on the test split (`test/knn_top1`). The same
classifiers as `vitlab.eval task=knn|fewshot` (vitlab.evaluation.probes); the features are those of the training split
(evaluation transforms, at most `max_train_images` of it) and of the validation split, extracted anew each time from the
weights as they are. Under DDP every process extracts its share of the images and rank 0 gathers them
(vitlab.evaluation.features), scores, and hands the numbers to the others, so every rank logs the same values (a
checkpoint or early stopping may monitor them).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch

from vitlab.data.seeded import TransformDataset
from vitlab.evaluation.features import split_features
from vitlab.evaluation.probes import fewshot_accuracy, knn_accuracy
from vitlab.utils.values import check_at_least


class RepresentationProbe(L.Callback):
    def __init__(
        self,
        every_n_epochs: int = 5,
        knn_k: Sequence[int] = (20,),
        temperature: float = 0.07,
        shots: Sequence[int] = (10,),
        l2_reg: float = 2.0**10,
        seed: int = 0,
        max_train_images: int | None = 10_000,
    ):
        check_at_least("callbacks.representation.every_n_epochs", every_n_epochs, 1)
        self.every, self.knn_k, self.temperature = every_n_epochs, tuple(knn_k), temperature
        self.shots, self.l2_reg, self.seed, self.max_train = tuple(shots), l2_reg, seed, max_train_images

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every:
            return
        metrics = self.measure(trainer, pl_module, "val")
        pl_module.log_dict({name: torch.tensor(v) for name, v in metrics.items()}, sync_dist=True)  # (equal already)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The tested weights' representation on the test split (the training split the bank): `test/knn_top1`,
        `test/fewshot_<n>shot`, a pretraining run's result beside its test loss."""
        metrics = self.measure(trainer, pl_module, "test")
        values = {f"test/{k.replace('/', '_')}": torch.tensor(v) for k, v in metrics.items()}
        pl_module.log_dict(values, sync_dist=True)  # every rank's is rank 0's: averaging keeps it, and Lightning quiet

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule, split: str) -> dict[str, float]:
        """k-NN and few-shot accuracy on `split`, the training split's features the bank; every rank gets rank 0's."""
        dm, model, device = trainer.datamodule, pl_module.model, pl_module.device
        train, train_y = split_features(model, _Limited(dm, self.max_train, self.seed), "train", device, None, {})
        val, val_y = split_features(model, dm, split, device, None, {})
        metrics = None if train is None else self.score(train, train_y, val, val_y, dm.num_classes)  # rank 0's
        return trainer.strategy.broadcast(metrics, src=0)

    def score(self, train, train_y, val, val_y, k: int) -> dict[str, float]:
        metrics = {}
        if self.knn_k:
            knn = knn_accuracy(train, train_y, val, val_y, k, self.knn_k, self.temperature)
            metrics |= {"knn/top1": knn[self.knn_k[0]]} | {f"knn/top1_k{n}": acc for n, acc in knn.items()}
        if self.shots:
            few = fewshot_accuracy(train, train_y, val, val_y, k, self.shots, self.l2_reg, self.seed)
            metrics |= {f"fewshot/{n}shot": acc for n, acc in few.items()}
        return metrics


class _Limited:
    """The data module, its training split's evaluation view cut to a seeded `limit` images (k-NN on 10,000 of
    ImageNet's 1.28M is DINO's cheap proxy; every image of a small set)."""

    def __init__(self, dm, limit: int | None, seed: int):
        self.dm, self.limit, self.seed = dm, limit, seed

    def __getattr__(self, name):
        return getattr(self.dm, name)

    def eval_view(self, split: str):
        dataset = self.dm.eval_view(split)
        if self.limit is None or len(dataset) <= self.limit:
            return dataset
        keep = sorted(torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.seed))[: self.limit])
        return TransformDataset(dataset.base, dataset.transform, [dataset.indices[i] for i in keep])
