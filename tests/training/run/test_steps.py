from types import SimpleNamespace

import pytest

from vitlab.training.run.steps import what_to_test


class Data:
    def __init__(self, test_set=True):
        self.test_set, self.set_up = test_set, []

    def setup(self, stage):
        self.set_up.append(stage)


MODULE = SimpleNamespace(best_key="val/acc")


@pytest.mark.parametrize(
    "train, test, test_set, metrics, best, start, expected, said",
    [
        (True, True, True, {}, "best.ckpt", None, "best.ckpt", None),
        (True, True, True, {}, "", None, "", "no best checkpoint was saved; testing the final weights"),
        (False, True, True, {}, "", "given.ckpt", "given.ckpt", None),
        (False, True, True, {}, "", None, "", None),  # the weights built (pretrained ones, say)
        (True, False, True, {}, "best.ckpt", None, None, None),
        (True, True, None, {}, "best.ckpt", None, None, "not tested: the data has no test split"),
        (True, True, True, {"pruned": {"epoch": 3}}, "", None, None, "pruner stopped this trial at epoch 3"),
    ],
)
def test_what_is_tested_is_decided_in_one_place(caplog, train, test, test_set, metrics, best, start, expected, said):
    plan = SimpleNamespace(train=train, test=test)  # (the plan's parts what_to_test reads)
    data = Data(test_set)
    caplog.set_level("INFO", logger="vitlab.train")
    assert what_to_test(plan, start, data, MODULE, metrics, best) == expected
    assert data.set_up == ["test"]  # its splits are known whatever is decided
    assert (said in caplog.text) if said else "tested" not in caplog.text
