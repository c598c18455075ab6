"""vitlab.utils.values, arguments, cuda and kernels: the shared validators of config values."""

import math
import re
from typing import Literal, TypedDict

import pytest

from tests.helpers.configs import tiny
from vitlab.training.module import ViTModule
from vitlab.utils.arguments import (
    Fraction,
    NonEmpty,
    NonNegativeInt,
    PositiveInt,
    PositiveNumber,
    Seed,
    check_arguments,
)
from vitlab.utils.cuda import check_device
from vitlab.utils.errors import UserError
from vitlab.utils.kernels import compile_mode
from vitlab.utils.values import is_number


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
        ({"mean": 0.5}, "data.mean 0.5 must be a list of numbers or null"),
        ({"mean": [0.5, "x"]}, "data.mean [0.5, 'x'] must be a list of numbers or null"),
        ({"mean": [0.5, math.nan]}, "data.mean [0.5, nan] must be a list of numbers or null"),  # finite ones
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


class _Knn(TypedDict):
    k: NonEmpty[PositiveInt]
    temperature: PositiveNumber


class _Settings(TypedDict):
    """A command's schema: its keys, a group among them."""

    seed: Seed
    top_k: PositiveInt
    limit: NonNegativeInt | Fraction | None
    knn: _Knn


GOOD = {"seed": 0, "top_k": 5, "limit": 0.5, "knn": {"k": [10, 20], "temperature": 0.07}}


@pytest.mark.parametrize(
    "values, said",
    [
        ({"top_k": "abc"}, "top_k 'abc' must be an integer >= 1"),  # a type and its range: one sentence
        ({"top_k": 0}, "top_k 0 must be an integer >= 1"),
        ({"seed": -5}, "seed -5 must be an integer in [0, 4294967295]"),
        ({"seed": 2**32}, "seed 4294967296 must be an integer in [0, 4294967295]"),
        ({"limit": 1.5}, "limit 1.5 must be an integer >= 0 or a number in [0, 1] or null"),
        ({"limit": -1}, "limit -1 must be an integer >= 0 or a number in [0, 1] or null"),
        ({"knn": {"k": [0], "temperature": 1}}, "knn.k [0] must be a non-empty list of integers >= 1"),
        ({"knn": {"k": [], "temperature": 1}}, "knn.k [] must be a non-empty list of integers >= 1"),
        ({"knn": {"k": "abc", "temperature": 1}}, "knn.k 'abc' must be a non-empty list of integers >= 1"),
        ({"knn": {"k": ["5"], "temperature": 1}}, "knn.k ['5'] must be a non-empty list of integers >= 1"),
        ({"knn": {"k": [5], "temperature": math.nan}}, "knn.temperature nan must be a number > 0"),
        ({"knn": {"k": [5], "temperature": 1, "kk": 3}}, "knn.kk is not a key of knn; its keys: ['k', 'temperature']"),
    ],
)
def test_a_schema_checks_types_ranges_and_groups_key_by_key(values, said):
    with pytest.raises(UserError, match=re.escape(said)):
        check_arguments(_Settings, GOOD | values, "")


def test_a_schema_takes_what_its_types_and_ranges_allow():
    check_arguments(_Settings, GOOD, "")
    check_arguments(_Settings, GOOD | {"limit": 3, "knn": {"k": [1], "temperature": 2}}, "")  # an int is a number
    check_arguments(_Settings, GOOD | {"knn": {"_target_": "x.Y"}}, "")  # a node that builds something: its own check


def _target(accumulate: int = 1, every: int | None = None, name: str = "x"):
    pass


class _Narrower(TypedDict):
    accumulate: PositiveInt
    every: PositiveInt | None


def test_a_narrower_adds_the_ranges_a_library_documents_and_leaves_unchecked():
    """Lightning's Trainer declares `accumulate_grad_batches: int`; its documented range comes from vitlab's table."""
    check_arguments(_target, {"accumulate": 0, "every": 0}, "trainer")  # the target's own types allow it
    with pytest.raises(UserError, match=re.escape("trainer.accumulate 0 must be an integer >= 1")):
        check_arguments(_target, {"accumulate": 0}, "trainer", _Narrower)
    with pytest.raises(UserError, match=re.escape("trainer.every 0 must be an integer >= 1 or null")):
        check_arguments(_target, {"every": 0}, "trainer", _Narrower)
    check_arguments(_target, {"accumulate": 2, "every": None, "name": "y"}, "trainer", _Narrower)


def test_a_device_is_one_this_machine_has():
    assert check_device("device", "cpu") == "cpu"
    assert check_device("benchmark.device", "auto", auto=True) in ("cpu", "cuda")
    with pytest.raises(UserError, match=re.escape("device 'tpu' is not one of cpu, cuda, cuda:<i>")):
        check_device("device", "tpu")
    with pytest.raises(UserError, match=re.escape("benchmark.device 'x' is not one of auto, cpu, cuda, cuda:<i>")):
        check_device("benchmark.device", "x", auto=True)
    with pytest.raises(UserError, match=re.escape("device 'cuda:99' is not available here: ")):
        check_device("device", "cuda:99")
