"""hydra.sweeper.pruner's names and how they become Optuna's pruners: read by the sweeper before any trial (a bad name
is refused before torch or Lightning is imported) and by each trial (training/callbacks/trial.py)."""

from __future__ import annotations

from typing import Any

from vitlab.utils.errors import UserError

# hydra.sweeper.pruner's names: Optuna's pruners, built with hydra.sweeper.pruner_args (their own arguments).
PRUNERS = {
    "median": "MedianPruner",
    "hyperband": "HyperbandPruner",
    "successive_halving": "SuccessiveHalvingPruner",
}


def make_pruner(name: str | None, args: dict[str, Any] | None = None):
    """Optuna's pruner called `name` (PRUNERS) with its own keyword arguments, or None (no pruning)."""
    if name is None:
        if args:
            raise UserError(f"hydra.sweeper.pruner_args={dict(args)} without a pruner: set hydra.sweeper.pruner")
        return None
    if name not in PRUNERS:
        raise UserError(f"hydra.sweeper.pruner={name!r} is not one of {sorted(PRUNERS)} (or null: no pruning)")
    import optuna

    cls = getattr(optuna.pruners, PRUNERS[name])
    try:
        return cls(**dict(args or {}))
    except TypeError as e:
        raise UserError(f"hydra.sweeper.pruner_args={dict(args or {})}: {PRUNERS[name]} says {e}") from e
