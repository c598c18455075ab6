"""What build.py makes from a config, where a test of the whole command would only see it in passing."""

import pytest
from omegaconf import OmegaConf

from vitlab.training.run.loggers import build_loggers


def test_a_wandb_logger_asks_wandb_for_no_anonymous_setting(tmp_path):
    """Lightning passes anonymous=None to wandb.init, and W&B warns on every run that the setting has no effect
    (issue 53): the logger is built without it, and its other settings as given."""
    group = OmegaConf.create(
        {
            "wandb": {
                "_target_": "lightning.pytorch.loggers.WandbLogger",
                "save_dir": str(tmp_path),
                "offline": True,
                "project": "vitlab",
            }
        }  # fmt: skip
    )
    (logger,) = build_loggers(group)
    assert "anonymous" not in logger._wandb_init
    assert logger._wandb_init["project"] == "vitlab" and logger._wandb_init["dir"] == str(tmp_path)


CHECKPOINT = "callbacks.model_checkpoint"


@pytest.mark.parametrize(
    ("overrides", "monitor", "mode"),
    [
        (["objective=mae", "model.num_classes=0"], "val/loss", "min"),  # logs no accuracy: its own best
        (["objective=dino", "model.num_classes=0", "model.dynamic_img_size=true"], "val/loss", "min"),
        ([], "val/acc", "max"),  # the classifier keeps the default
        (["objective=mae", "model.num_classes=0", f"{CHECKPOINT}.monitor=train/loss"], "train/loss", "max"),  # kept
        # callbacks=ema's val/acc_ema: the objective's own, of the averaged weights
        (["objective=mae", "model.num_classes=0", "callbacks=ema"], "val/loss_ema", "min"),
        (["callbacks=ema"], "val/acc_ema", "max"),
    ],
)
def test_the_best_checkpoint_follows_an_objective_without_accuracy(compose_cfg, overrides, monitor, mode):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from vitlab.cli.plans import train_plan
    from vitlab.training.run.build import build_callbacks

    plan = train_plan(compose_cfg("train", overrides))
    callbacks, _ = build_callbacks(plan.callbacks, plan.progress_bar)
    (best,) = [c for c in callbacks if isinstance(c, ModelCheckpoint) and c.monitor is not None]
    assert (best.monitor, best.mode) == (monitor, mode)
