import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitlab.model import ViTConfig

ROOT = Path(__file__).resolve().parents[1]

# Tests never touch the network: timm/HF downloads fail at once instead of waiting on a socket.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny(**overrides) -> ViTConfig:
    """A ViT small enough for CPU tests: 32 px, patch 8 (16 patches), dim 32, depth 2, 4 heads."""
    base = dict(img_size=32, patch_size=8, in_chans=3, num_classes=7, embed_dim=32, depth=2, num_heads=4)
    return ViTConfig(**{**base, **overrides})


def run_cli(module: str, *args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m vitlab.<module> args` in a subprocess, output captured."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", f"vitlab.{module}", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
