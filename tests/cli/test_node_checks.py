"""vitlab.cli.node_checks: the nodes that build something, checked before anything is built: Lightning's
Trainer arguments within the ranges its documentation gives (TrainerRanges), an image folder's class count
(BEFORE_BUILD)."""

import inspect
import re
import typing

import lightning as L
import pytest
from omegaconf import OmegaConf

from vitlab.cli.node_checks import TrainerRanges, check_global_batch, check_node
from vitlab.utils.errors import UserError


def test_every_range_is_of_an_argument_lightnings_trainer_takes():
    assert set(typing.get_type_hints(TrainerRanges)) <= set(inspect.signature(L.Trainer.__init__).parameters)


@pytest.mark.parametrize(
    "key, value, said",
    [
        # accepted by Trainer(...), a ZeroDivisionError once training has started
        ("accumulate_grad_batches", 0, "must be an integer >= 1"),
        ("log_every_n_steps", 0, "must be an integer >= 1 or null"),
        ("check_val_every_n_epoch", 0, "must be an integer >= 1 or null"),
        ("max_steps", -2, "must be an integer >= -1"),
        ("num_sanity_val_steps", -2, "must be an integer >= -1 or null"),
        ("gradient_clip_val", -1.0, "must be a number >= 0 or null"),
        ("val_check_interval", 0.0, "must be an integer >= 1 or a number in (0, 1] or a string or a mapping or null"),
        ("limit_val_batches", 1.5, "must be an integer >= 0 or a number in [0, 1] or null"),
        ("precision", "fp8", "must be one of 'auto', 'float8', 'float8-rowwise', 64, 32, 16,"),
    ],
)
def test_a_trainer_value_outside_lightnings_range_is_named(key, value, said):
    node = OmegaConf.create({"_target_": "lightning.pytorch.Trainer", key: value})
    with pytest.raises(UserError, match=re.escape(f"trainer.{key} {value!r} {said}")):
        check_node(node, "trainer")


def test_values_lightning_documents_pass():
    good = {"max_epochs": -1, "max_steps": -1, "limit_train_batches": 10, "limit_val_batches": 0.25,
            "val_check_interval": 0.5, "num_sanity_val_steps": -1, "precision": "auto", "fast_dev_run": 3,
            "log_every_n_steps": None, "gradient_clip_algorithm": "norm"}  # fmt: skip
    check_node(OmegaConf.create({"_target_": "lightning.pytorch.Trainer", **good}), "trainer")


def test_an_image_folders_class_count_is_checked_before_its_module_is_built(tmp_path):
    from tests.helpers.images import image_tree

    image_tree(tmp_path / "photos")
    node = OmegaConf.create({"_target_": "vitlab.data.ImageFolderDataModule", "data_dir": str(tmp_path / "photos"),
                             "num_classes": 1000, "img_size": 8})  # fmt: skip
    with pytest.raises(
        UserError, match=re.escape(f"data.num_classes 1000 does not match the 2 class folders in {tmp_path}")
    ):
        check_node(node, "data")
    node.num_classes = 2
    check_node(node, "data")


@pytest.mark.parametrize(
    "trainer, data, refused",
    [
        ({"devices": 5}, {"batch_size": 96}, 5),
        ({"devices": [0, 1, 2], "num_nodes": 2}, {"batch_size": 64}, 6),  # a list of GPU indices: its length
        ({"devices": 4, "num_nodes": 2}, {"batch_size": 96}, None),
        ({"devices": "auto"}, {"batch_size": 97}, None),  # Lightning's count: the data module says it
        ({"devices": 5}, {"batch_size": 96, "train_batch_sizes": [80, 40]}, None),  # a size schedule: timm's
        ({"devices": 5}, {"batch_size": "auto"}, None),
    ],
)
def test_the_processes_asked_for_divide_the_global_batch_before_any_starts(trainer, data, refused):
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", **trainer}, "data": data})
    if refused is None:
        check_global_batch(cfg)
        return
    with pytest.raises(UserError, match=rf"^data.batch_size {data['batch_size']} is global and must be divisible by"
                       rf" the {refused} processes "):  # fmt: skip
        check_global_batch(cfg)
