"""The vendored mmseg 0.27.0 files (tests/reference/mmseg/) and DINOv2's segmentation head (tests/reference/dinov2/),
imported unmodified over the least of mmcv and mmseg they import: registries that keep what they register, mmcv's
BaseModule as a plain nn.Module (the init_cfg it would apply is not run: the tests copy weights across), fp16
decorators that leave functions as they are. Everything else the tests call is the references' own code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1] / "reference"


class _Registry:
    def __init__(self):
        self.classes: dict[str, type] = {}

    def register_module(self, name=None, force=False, module=None):
        def add(cls):
            self.classes[name or cls.__name__] = cls
            return cls

        return add


class _BaseModule(nn.Module):
    def __init__(self, init_cfg=None):
        super().__init__()
        self.init_cfg = init_cfg


def _unchanged(*args, **kwargs):
    return lambda f: f


def _package(name: str, **attrs) -> ModuleType:
    module = ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attrs)
    return module


def _load(monkeypatch, name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def load(monkeypatch) -> SimpleNamespace:
    """The references, their shims in sys.modules for this test only (monkeypatch takes them out)."""
    losses, heads = _Registry(), _Registry()

    def build_loss(cfg):
        cfg = dict(cfg)
        return losses.classes[cfg.pop("type")](**cfg)

    modules = {
        "mmcv": _package("mmcv"),
        "mmcv.runner": _package("mmcv.runner", BaseModule=_BaseModule, auto_fp16=_unchanged, force_fp32=_unchanged),
        "mmseg": _package("mmseg"),
        "mmseg.core": _package("mmseg.core", build_pixel_sampler=None),
        "mmseg.ops": _package("mmseg.ops"),
        "mmseg.models": _package("mmseg.models"),
        "mmseg.models.builder": _package("mmseg.models.builder", LOSSES=losses, HEADS=heads, build_loss=build_loss),
        "mmseg.models.losses": _package("mmseg.models.losses", accuracy=lambda *a, **k: torch.zeros(())),
        "mmseg.models.decode_heads": _package("mmseg.models.decode_heads"),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    mmseg, mp = ROOT / "mmseg" / "mmseg", monkeypatch
    modules["mmseg.ops"].resize = _load(mp, "mmseg.ops.wrappers", mmseg / "ops" / "wrappers.py").resize
    _load(mp, "mmseg.models.losses.utils", mmseg / "models" / "losses" / "utils.py")
    ce = _load(mp, "mmseg.models.losses.cross_entropy_loss", mmseg / "models" / "losses" / "cross_entropy_loss.py")
    _load(mp, "mmseg.models.decode_heads.decode_head", mmseg / "models" / "decode_heads" / "decode_head.py")
    head = ROOT / "dinov2" / "dinov2" / "eval" / "segmentation" / "models" / "decode_heads" / "linear_head.py"
    linear_head = _load(mp, "dinov2_linear_head", head)  # (its file path: tests/reference/dinov2/)
    metrics = _load(mp, "mmseg.core.evaluation.metrics", mmseg / "core" / "evaluation" / "metrics.py")
    return SimpleNamespace(ce=ce, linear_head=linear_head, metrics=metrics)
