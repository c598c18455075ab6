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


def run_cli(
    module: str,
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
    replace_env: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m vitlab.<module> args` in a subprocess, output captured. `env` is added to this
    process's environment, or replaces it with `replace_env`."""
    full_env = {**({} if replace_env else os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", f"vitlab.{module}", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def compose_cfg(tmp_path):
    """compose(config_name, overrides) as the entry points see it (HydraConfig set), writing under tmp_path."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from vitlab.cli import config_dir, register_resolvers

    register_resolvers()

    def _compose(name: str = "train", overrides=(), output_dir: Path | None = None, keep_hydra: bool = False):
        out = output_dir or tmp_path
        out.mkdir(parents=True, exist_ok=True)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(
                name,
                overrides=[*overrides, f"paths.root_dir={tmp_path}", f"paths.output_dir={out}"],
                return_hydra_config=True,
            )
        HydraConfig.instance().set_config(cfg)
        if not keep_hydra:  # the task function never sees the hydra node
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg

    yield _compose
    GlobalHydra.instance().clear()
