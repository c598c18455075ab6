"""k-fold cross-validation splits (`data.folds=K data.fold=i`): the training split cut into K class-stratified folds,
fixed by `data.split_seed` (scikit-learn's StratifiedKFold, shuffled; several labels an image: iterative
stratification, iterative-stratification's MultilabelStratifiedKFold, vendored in ml_stratifiers.py); fold i
validates (selects the checkpoint) and the other K - 1 train. The test split is left as it is: every fold is tested
on the same images. Where the data has no test split, its validation split tests (as with data.val_fraction); where
it has both, its own validation split is not read. `python -m vitlab.train -m data.folds=5 'data.fold=range(5)'`
trains every fold, and the sweep's summary gives the mean and standard deviation over the folds (vitlab.cli.sweep).

The map-style readers take it (data=digits, imagefolder, hf, list): their labels are known before the split.
`check_folds` needs no torch nor numpy (imported where a split is made): the command checks the values at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vitlab.utils.errors import UserError


def check_folds(folds: int, fold: int, refused_by: str | None = None) -> None:
    """data.folds (0: off, else >= 2) and data.fold (one of the folds), in one line each, before anything is read;
    `refused_by`: the data module that takes no folds, named."""
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 0 or folds == 1:
        raise UserError(f"data.folds {folds!r} must be 0 (no k-fold) or a number of folds >= 2")
    if isinstance(fold, bool) or not isinstance(fold, int):
        raise UserError(f"data.fold {fold!r} must be an integer, a fold in 0..data.folds - 1")
    if folds and not 0 <= fold < folds:
        raise UserError(f"data.fold {fold} is not a fold of data.folds {folds}: give one of 0..{folds - 1}")
    if not folds and fold:
        raise UserError(f"data.fold {fold} needs data.folds=K (the number of folds); data.folds is 0 (no k-fold)")
    if folds and refused_by:
        raise UserError(f"data.folds {folds}: {refused_by} takes no folds; k-fold splits map-style data ({READERS})")


READERS = "data=digits, imagefolder, hf, list"


def labels_of(dataset: Any) -> list[int] | list[list[int]]:
    """The class index of every item of a map-style dataset, read without decoding an image: torchvision's ImageFolder
    (`targets`), vitlab's readers (`labels`); several labels an image: each item's 0/1 row (multi-hot)."""
    for name in ("targets", "labels"):
        labels = getattr(dataset, name, None)
        if labels is not None and getattr(labels, "ndim", 1) == 2:
            return labels.tolist()
        if labels is not None:
            return [int(v) for v in labels]
    raise UserError(f"data.folds splits by class, and {type(dataset).__name__} does not list its labels")


def fold_split(labels: Sequence[int], folds: int, fold: int, seed: int) -> tuple[list[int], list[int]]:
    """(kept, held): the positions in `labels` that train and the ones of fold `fold` (validation), class-stratified.
    The same (labels, folds, seed) give the same folds whatever `fold`: they are disjoint and cover every position."""
    import numpy as np
    from sklearn.model_selection import StratifiedKFold

    check_folds(folds, fold)
    labels = np.asarray(labels)
    if labels.ndim == 2:  # several labels an image: iterative stratification (Sechidis et al. 2011, as skmultilearn's)
        from vitlab.data.ml_stratifiers import MultilabelStratifiedKFold

        if len(labels) < folds:
            raise UserError(f"data.folds {folds} is more than the {len(labels)} images: give fewer folds")
        splitter = MultilabelStratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        kept, held = list(splitter.split(np.zeros(len(labels)), labels))[fold]
        return sorted(int(i) for i in kept), sorted(int(i) for i in held)
    counts = np.bincount(labels) if len(labels) else np.array([0])
    if counts.max() < folds:
        raise UserError(
            f"data.folds {folds} is more than the images of any class ({counts.max()} at most): give fewer folds"
        )
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    kept, held = list(splitter.split(np.zeros(len(labels)), labels))[fold]
    return sorted(int(i) for i in kept), sorted(int(i) for i in held)


def held_out(n: int, held: int, seed: int) -> tuple[list[int], list[int]]:
    """Indices (kept, held out) of n images, `held` of them held out at random, fixed by `seed` (big_vision's
    minival, CIFAR's validation images: a slice of train that selects the checkpoint)."""
    import torch

    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[held:]), sorted(order[:held])


def kept_and_held(train: Any, count: int, seed: int, folds: int, fold: int) -> tuple[list[int], list[int]]:
    """(kept, held) positions of `train`: fold `fold` of `folds` where k-fold is on, else `count` at random."""
    if folds:
        return fold_split(labels_of(train), folds, fold, seed)
    return held_out(len(train), count, seed)


def describe(folds: int, fold: int, held: int, seed: int, what: str = "train/") -> dict[str, str]:
    """The splits' names for the log and metrics.json (`ImageDataModule.splits`)."""
    return {
        "train": f"{what} less fold {fold} of {folds}",
        "val": f"fold {fold} of {folds} of {what} ({held:,} images, class-stratified, split_seed {seed})",
    }


def describe_splits(splits: dict[str, str]) -> str:
    """One line on which images validate and which test (the run's log)."""
    if "test" not in splits:
        return (
            f"validation (selects the best checkpoint): {splits['val']}; no test split, so the result is val/acc "
            "on that split (data.val_fraction holds a validation slice out of train and tests on val/)"
        )
    return f"validation (selects the best checkpoint): {splits['val']}; test: {splits['test']}"
