"""vitlab.settings: the shared validators of config values."""

import pytest

from tests.helpers import tiny
from vitlab.errors import UserError
from vitlab.lit_module import ViTModule
from vitlab.settings import compile_mode


def test_compile_accepts_a_bool_or_a_torch_compile_mode():
    modes = [compile_mode(v) for v in (False, None, True, "reduce-overhead")]
    assert modes == [None, None, "default", "reduce-overhead"]
    with pytest.raises(UserError, match="compile 'fast' is not one of false, true, default, reduce-overhead"):
        ViTModule(model=tiny().to_dict(), compile="fast")
    assert ViTModule(model=tiny().to_dict(), compile="max-autotune").compile_mode == "max-autotune"
