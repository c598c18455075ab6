"""vitlab.cli.schemas: each command's schema is its YAML file's keys, every config file of the tree passes the checks
of its command (no false refusals), and the checks run before the run directory is made."""

import typing

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_conf import options
from vitlab.cli.entry import check_config
from vitlab.cli.schemas import SCHEMAS
from vitlab.utils.errors import UserError

# What each command needs given to compose whole (its `???` keys), as a user types it.
GIVEN = {
    "eval": ["ckpt_path=x.ckpt"],
    "predict": ["ckpt_path=x.ckpt", "images=[a.png]"],
    "export": ["ckpt_path=x.ckpt"],
    "visualize": ["run_dir=some/run"],
    "pack": ["data=fake"],
}


@pytest.fixture(autouse=True)
def a_checkpoint_named_x(tmp_path, monkeypatch):
    """ckpt_path=x.ckpt is looked for before anything is read (issue 64 point 17): one is there, where checks run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.ckpt").write_bytes(b"PK")
    (tmp_path / "a.png").write_bytes(b"\x89PNG")  # (predict's images too: issue 74, point 11)
    for name in (
        "imagenet",
        "shards",
        "photos",
    ):  # (and the data folders the experiments name: a missing one is refused too)
        (tmp_path / "data" / name).mkdir(parents=True)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_command_schema_lists_its_top_level_keys(compose_cfg, name):
    """A key added to conf/<command>.yaml without a type in its schema would go unchecked: the schema has every key
    that is not a config group, and nothing else."""
    from hydra.core.hydra_config import HydraConfig

    cfg = compose_cfg(name, GIVEN.get(name, []))
    groups = {g for g, choice in HydraConfig.get().runtime.choices.items() if choice is not None and "/" not in g}
    schema = set(typing.get_type_hints(SCHEMAS[name][0]))
    assert schema - set(cfg) == set()
    assert set(cfg) - groups - schema == set()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_command_passes_its_own_checks_as_composed(compose_cfg, name, tmp_path):
    overrides = GIVEN.get(name, []) + ([f"out={tmp_path / 'shards'}"] if name == "pack" else [])
    check_config(compose_cfg(name, overrides), *SCHEMAS[name])


@pytest.mark.parametrize(
    "overrides",
    [[f"experiment={e}"] for e in options("experiment")]
    + [[f"trainer={t}"] for t in options("trainer")]
    + [[f"debug={d}"] for d in options("debug")]
    + [[f"callbacks={c}"] for c in options("callbacks")],
)
def test_every_train_config_file_passes_the_checks(compose_cfg, monkeypatch, overrides):
    """The ranges (Lightning's Trainer's among them) refuse no config vitlab ships; their GPU counts are another
    machine's business (check_devices asks only where there is no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("vitlab.utils.cuda.no_cuda_here", lambda: False)  # (the device files looked for first)
    check_config(compose_cfg("train", overrides), *SCHEMAS["train"])


@pytest.mark.parametrize(
    "name, overrides, said",
    [
        ("train", ["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps 0 must be an integer >= 1 or null"),
        ("train", ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches 0 must be an integer >= 1"),
        ("train", ["progress_bar=fancy"], "progress_bar 'fancy' must be one of 'auto', 'rich', 'tqdm', 'none'"),
        (
            "train",
            ["sdpa_backend=fast"],
            "sdpa_backend 'fast' must be one of 'auto', 'flash', 'efficient', 'cudnn', 'math'",
        ),
        ("eval", ["knn.k=[0]"], "knn.k [0] must be a non-empty list of integers >= 1"),
        ("eval", ["linear.lrs=[]"], "linear.lrs [] must be a non-empty list of numbers > 0"),
        ("eval", ["data.batch_size=0"], "data.batch_size 0 must be an integer >= 1 or null"),
        ("eval", ["trainer.devices=1", "trainer.num_nodes=0"], "trainer.num_nodes 0 must be an integer >= 1"),
        ("predict", ["top_k=abc"], "top_k 'abc' must be an integer >= 1 or null"),
        ("export", ["atol=-1"], "atol -1 must be a number >= 0"),
        ("visualize", ["num_images=0"], "num_images 0 must be an integer >= 1"),
        ("parity", ["zoo_depth=0"], "zoo_depth 0 must be an integer >= 1"),
        ("pack", ["workers=0", "out=x"], "workers 0 must be an integer >= 1 or null"),
        ("benchmark", ["benchmark.batch_size=0"], "benchmark.batch_size 0 must be an integer >= 1"),
        (
            "benchmark",
            ["benchmark.sdpa_backend=fast"],
            "benchmark.sdpa_backend 'fast' is not one of ['auto', 'flash', 'efficient', 'cudnn', 'math']",
        ),
    ],
)
def test_a_bad_value_of_any_command_is_named_with_what_is_allowed(compose_cfg, name, overrides, said):
    cfg = compose_cfg(name, GIVEN.get(name, []) + overrides)
    with pytest.raises(UserError, match=f"^{said.replace('[', '.').replace(']', '.')}$"):
        check_config(cfg, *SCHEMAS[name])
        if name == "benchmark":  # its group's checks are the command's own (cli/ imports no command)
            from vitlab.benchmark.config import check_benchmark

            check_benchmark(cfg)


def test_eval_refuses_model_overrides_a_checkpoint_would_ignore(compose_cfg):
    cfg = compose_cfg("eval", ["ckpt_path=x.ckpt", "model=vit_ti16", "task=knn"])
    with pytest.raises(UserError, match="^model=vit_ti16: the model of ckpt_path 'x.ckpt' is the one its checkpoint"):
        check_config(cfg, *SCHEMAS["eval"])
    check_config(compose_cfg("eval", ["model=vit_ti16", "model.pretrained=x", "task=knn"]), *SCHEMAS["eval"])


def test_pack_checks_its_out_before_reading_any_image_and_makes_no_folder(compose_cfg, tmp_path):
    (tmp_path / "shards").mkdir()
    cfg = compose_cfg("pack", [f"out={tmp_path / 'shards'}", f"data.data_dir={tmp_path / 'no images here'}"])
    check = SCHEMAS["pack"][1]
    with pytest.raises(UserError, match="out .* already exists; give a new folder, or overwrite=true to replace it"):
        check(cfg)
    before = sorted(tmp_path.rglob("*"))
    OmegaConf.update(cfg, "out", str(tmp_path / "new" / "deeper" / "shards"))
    check(cfg)
    assert sorted(tmp_path.rglob("*")) == before  # (its parent folders are made when the shards are written)


def test_a_value_the_command_fills_in_is_left_to_it(compose_cfg):
    """eval's data=<name> reads ${model.img_size}, which eval sets from the checkpoint's model; the rest of the node is
    still held to its data module."""
    check_config(compose_cfg("eval", ["ckpt_path=x.ckpt", "data=digits"]), *SCHEMAS["eval"])
    with pytest.raises(UserError, match="^data.batch_size 'many' must be 'auto' or an integer >= 1$"):
        check_config(compose_cfg("eval", ["ckpt_path=x.ckpt", "data=digits", "data.batch_size=many"]), *SCHEMAS["eval"])
