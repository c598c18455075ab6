"""vitlab.utils.checks: the shared validators of config values."""

import math
import re
from typing import Literal

import pytest

from tests.helpers import tiny
from vitlab.training.module import ViTModule
from vitlab.utils.checks import check_arguments, compile_mode, is_number
from vitlab.utils.errors import UserError


def test_compile_accepts_a_bool_or_a_torch_compile_mode():
    modes = [compile_mode(v) for v in (False, None, True, "reduce-overhead")]
    assert modes == [None, None, "default", "reduce-overhead"]
    with pytest.raises(UserError, match="compile 'fast' is not one of false, true, default, reduce-overhead"):
        ViTModule(model=tiny().to_dict(), compile="fast")
    assert ViTModule(model=tiny().to_dict(), compile="max-autotune").compile_mode == "max-autotune"


class _Base:
    def __init__(self, batch_size: int, mean: tuple[float, ...] | None = None, name: str = "x"):
        pass


class _Child(_Base):
    def __init__(self, depth: int | float | None, **kwargs):  # the rest goes up to _Base
        super().__init__(**kwargs)


def _fn(mode: Literal["a", "b"] | bool, flag: bool = False, **anything):
    pass


@pytest.mark.parametrize(
    "values, said",
    [
        ({"batch_size": "abc"}, "data.batch_size 'abc' must be an integer"),
        ({"batch_size": 8.5}, "data.batch_size 8.5 must be an integer"),
        ({"batch_size": True}, "data.batch_size True must be an integer"),
        ({"batch_size": "64"}, "data.batch_size '64' must be an integer"),  # converting it would hide the mistake
        ({"mean": 0.5}, "data.mean 0.5 must be a list or null"),
        ({"depth": "deep"}, "data.depth 'deep' must be a number or null"),
        ({"name": 3}, "data.name 3 must be a string"),
        ({"colour": "red"}, "data.colour is not an argument of _Child; its arguments: ['batch_size', 'depth',"),
    ],
)
def test_check_arguments_names_the_key_the_value_and_the_type(values, said):
    with pytest.raises(UserError, match=re.escape(said)):
        check_arguments(_Child, {"batch_size": 4, "depth": 2, **values}, "data")


def test_check_arguments_takes_what_the_types_allow():
    check_arguments(_Child, {"batch_size": 4, "depth": 2.5, "mean": [0.5, 0.5], "name": "y", "_target_": "z"}, "data")
    check_arguments(_Child, {"batch_size": 4, "depth": None, "mean": None}, "data")
    check_arguments(_fn, {"mode": "a", "flag": True, "whatever": object()}, "")  # **anything takes any key
    with pytest.raises(UserError, match=re.escape("mode 'c' must be one of 'a', 'b' or true or false")):
        check_arguments(_fn, {"mode": "c"}, "")
    nested = {"batch_size": 4, "depth": 1, "name": {"_target_": "builds.something.Else"}}  # checked on its own
    check_arguments(_Child, nested, "data")


def test_numbers_must_be_finite():
    assert is_number(1) and is_number(0.5)
    assert not any(is_number(v) for v in (math.nan, math.inf, -math.inf, True, "1"))
