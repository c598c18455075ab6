"""Hydra looks for sweepers only in the `hydra_plugins` namespace: vitlab's Optuna sweeper (vitlab.cli.optuna_sweep)
is registered here, as `hydra_plugins.vitlab_optuna.OptunaSweeper` (conf/hydra/sweeper/vitlab_optuna.yaml)."""

from vitlab.cli import optuna_sweep


class OptunaSweeper(optuna_sweep.OptunaSweeper):
    pass
