"""vitlab.eval's plan (cli/eval_plans.py): what it refuses before anything is extracted."""

import pytest

from vitlab.cli.eval_plans import _check_labels
from vitlab.utils.errors import UserError


def test_several_labels_an_image_go_to_the_tasks_that_score_map_and_the_rest_are_refused_in_one_line():
    several, one = {"multilabel": True}, {"multilabel": False}
    for task in ("knn", "linear", "fewshot", "test"):  # a checkpoint's classifier and its frozen features: mAP
        _check_labels(task, several)
    for task in ("knn", "linear", "test", "fewshot", "segmentation"):
        _check_labels(task, one)
        _check_labels(task, {})  # (a data config without the key: one label)
    for task, checkpoint in (("segmentation", True), ("segmentation", False), ("test", False)):  # timm's head: one
        with pytest.raises(UserError) as refused:
            _check_labels(task, several, checkpoint=checkpoint)
        said = str(refused.value)
        assert said.startswith(f"task={task} scores one label an image") and "\n" not in said
        allowed = "task=knn, task=linear" + (", task=fewshot or task=test" if checkpoint else " or task=fewshot")
        assert said.endswith(f"use {allowed}, which score mAP")
