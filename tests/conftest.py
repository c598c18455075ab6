import os

# Tests never touch the network: timm/HF downloads fail at once instead of waiting on a socket. Set
# before anything imports huggingface_hub (Lightning does), which reads it once at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import image_tree, run_cli  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """The suites of tests/end_to_end/ are the `slow` ones (make test-fast leaves that folder out). `gpu` tests run
    where a CUDA device is visible and are skipped, saying so, elsewhere (CI)."""
    end_to_end = Path(__file__).parent / "end_to_end"
    for item in items:
        if end_to_end in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def compose_cfg(tmp_path):
    """compose(config_name, overrides) as the entry points see it (HydraConfig set), writing under tmp_path."""
    yield from _composer(tmp_path)


@pytest.fixture(scope="module")
def compose_cfg_module(tmp_path_factory):
    """compose_cfg for a module's shared fixture (a run several tests read)."""
    yield from _composer(tmp_path_factory.mktemp("composed"))


def _composer(tmp_path: Path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from vitlab.cli.config_tree import config_dir, register_resolvers

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


# An image folder and its LitData shards (python -m vitlab.pack), for tests/data/test_streaming.py and
# tests/end_to_end/test_streaming_runs.py.
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    return image_tree(root, classes=("a", "b", "c"), per_class=24, size=(12, 12), splits=("train", "val", "test"))


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "shards"
    r = run_cli("pack", "data=imagefolder", f"data.data_dir={folder}", f"out={out}", "workers=2", cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-2:] == [
        f"packed train 72, val 72, test 72 images of 3 classes into {out}",
        f"train on them: python -m vitlab.train data=streaming data.data_dir={out}",
    ]
    return out
