import json
import os
from collections import defaultdict

# Tests never touch the network: timm/HF downloads fail at once instead of waiting on a socket. Set
# before anything imports huggingface_hub (Lightning does), which reads it once at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# One thread a process, in this process and every command it starts (the fork server, its commands and their ranks
# read it as they import torch): the suite runs a process a core on every core, and OpenMP's threads of one test do
# not spin-wait against another's (a step then takes several times as long).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.commands import run_cli  # noqa: E402
from tests.helpers.configs import SHARDS_RUN  # noqa: E402
from tests.helpers.images import image_tree  # noqa: E402
from tests.helpers.runs import once, trained  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (should a plugin have imported torch before)


# Seconds each test file took in the last whole run (`make test-durations` writes it): the suite's files are run
# longest first, so that under `--dist loadfile` the slow ones start at once and the short ones fill in at the end.
DURATIONS = Path(__file__).parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="write the seconds each test file took (setup, call and teardown of its tests, summed) to PATH as JSON",
    )


def pytest_collection_modifyitems(config, items):
    """Files in the order of their durations, longest first (a file not yet measured counts as the longest: it starts
    early, where it can do no harm), tests within a file as written; run with `--no-loadscope-reorder` (the
    Makefile's PARALLEL), xdist hands them out in this order. The suites of tests/end_to_end/ are the `slow` ones
    (make test-fast leaves that folder out). `gpu` tests run where a CUDA device is visible and are skipped, saying
    so, elsewhere (CI)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    first = max(seconds.values(), default=0) + 1
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], first))  # a stable sort
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


class _Durations:
    """--record-durations: sums each file's test phases as the reports arrive (from every xdist worker)."""

    def __init__(self, path: Path):
        self.path, self.seconds = path, defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):  # an xdist worker: its reports reach the controller
            return
        ordered = dict(sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda x: -x[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config):
    if config.getoption("record_durations"):
        config.pluginmanager.register(_Durations(Path(config.getoption("record_durations"))), "vitlab-durations")


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


# An image folder and its LitData shards (python -m vitlab.pack), made once per pytest run and shared by every file
# and xdist worker (tests/data/test_streaming.py, tests/end_to_end/test_streaming_runs.py, ...): read them, never write.
@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    def make(root):
        image_tree(root, classes=("a", "b", "c"), per_class=24, size=(12, 12), splits=("train", "val", "test"))

    return once(tmp_path_factory, "folder", make)


@pytest.fixture(scope="session")
def shards(folder, tmp_path_factory):
    def pack(root):
        out = root / "shards"
        r = run_cli("pack", "data=imagefolder", f"data.data_dir={folder}", f"out={out}", "workers=2", cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip().splitlines()[-2:] == [
            f"packed train 72, val 72, test 72 images of 3 classes into {out}",
            f"train on them: python -m vitlab.train data=streaming data.data_dir={out}",
        ]

    return once(tmp_path_factory, "shards", pack) / "shards"


@pytest.fixture
def shards_run(shards, tmp_path_factory):
    """SHARDS_RUN on the shards in one process, trained once per pytest run (tests/data/test_streaming.py compares
    it with other runs; tests/end_to_end/test_streaming_runs.py resumes to it)."""
    return trained(tmp_path_factory, "streaming", "data=streaming", f"data.data_dir={shards}", *SHARDS_RUN)


# The `folder` fixture's images in the other readers' formats (data=hf, data=list, data=wds), made once per pytest run.
@pytest.fixture(scope="session")
def records(folder, tmp_path_factory):
    """The folder's splits as a saved Hugging Face DatasetDict (records/saved: an Image feature holding each file's
    bytes, a ClassLabel), as parquet files (records/parquet) and as CSV lists of its files (records/<split>.csv);
    the same images in the same order (ImageFolder's: class folders, then names)."""

    def make(root):
        import datasets

        features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=["a", "b", "c"]))
        splits = {}
        for split in ("train", "val", "test"):
            files = sorted((folder / split).glob("*/*.png"))
            columns = {"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files],
                       "label": [["a", "b", "c"].index(f.parent.name) for f in files]}  # fmt: skip
            splits["validation" if split == "val" else split] = datasets.Dataset.from_dict(columns, features=features)
            rows = [f"{os.path.relpath(f, root)},{f.parent.name}" for f in files]
            (root / f"{split}.csv").write_text("\n".join(["path,label", *rows]) + "\n")
        datasets.DatasetDict(splits).save_to_disk(str(root / "saved"))
        (root / "parquet").mkdir()
        for name, split in splits.items():
            split.to_parquet(str(root / "parquet" / f"{name}.parquet"))

    return once(tmp_path_factory, "records", make)


@pytest.fixture(scope="session")
def wds_shards(folder, tmp_path_factory):
    """The folder's splits as WebDataset tars of 20 samples (python -m vitlab.pack format=wds): 4 a split."""

    def pack(root):
        out = root / "wds"
        r = run_cli("pack", "format=wds", "shard_size=20", "data=imagefolder", f"data.data_dir={folder}", f"out={out}",
                    "workers=2", cwd=root)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]

    return once(tmp_path_factory, "wds", pack) / "wds"
