"""LightningDataModules, selected in configs with `data=<name>` (conf/data/).

Each module is imported when its class is first asked for (`vitlab.data.HFDataModule`, as a config's `_target_` names
it): importing the package imports no torch or Lightning, so what runs before them (vitlab.data.indexes: a config's
class count, read when the config is checked) refuses a bad value within a second.
"""

import importlib

from vitlab.data.formats import FORMATS

MODULES = {f.cls: f.module for f in FORMATS.values()}  # each class, and the module that holds it

__all__ = list(MODULES)


def __getattr__(name: str):
    if name not in MODULES:
        raise AttributeError(f"module 'vitlab.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"vitlab.data.{MODULES[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *MODULES])
