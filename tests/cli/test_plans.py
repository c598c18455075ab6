"""The train plan's decisions (cli/plans.py) that a sweep reads."""

import pytest
from omegaconf import OmegaConf

from vitlab.cli.plans import optimized_metric


@pytest.mark.parametrize("mode", ["RUN", "MULTIRUN"])
def test_the_default_optimized_metric_follows_the_objective_where_its_direction_is_kept(compose_cfg, mode):
    """val/acc_best, the default, becomes val/map_best for several labels an image in a sweep too (higher is better,
    as accuracy: a sweep of them once returned NaN to its sweeper and warned in every job), val/loss_best for MAE in
    a single run only (a sweep's direction, maximize, goes with the name it was given); a name given is kept."""

    def metric(*overrides):
        cfg = compose_cfg("train", [*overrides, f"hydra.mode={mode}"], keep_hydra=True)
        return optimized_metric(OmegaConf.to_container(cfg, resolve=False))

    assert metric() == "val/acc_best"
    assert metric("data=digit_pairs", "objective.multilabel=true") == "val/map_best"
    assert metric("objective=mae") == ("val/loss_best" if mode == "RUN" else "val/acc_best")
    assert metric("data=digit_pairs", "objective.multilabel=true", "optimized_metric=test/map") == "test/map"
